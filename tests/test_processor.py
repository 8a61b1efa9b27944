"""The two graphmax decoders as logits processors: their arguments, from_graph, the lazy import, and generate()."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import scipy.sparse as sp
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    T5Config,
    T5ForConditionalGeneration,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from gm_graphs import load_graph
from gm_graphs.errors import GraphFormatError
from gm_solver import (
    ContextConfig,
    ContextGraphmaxLogitsProcessor,
    Datastore,
    GraphmaxLogitsProcessor,
    HiddenStateTap,
    KnnContextGraphmaxLogitsProcessor,
    PaperAlgorithm1LogitsProcessor,
    PaperGraphmaxLogitsProcessor,
    graphmax,
    log_graphmax,
)

from .helpers import COUNTS

VOCAB = 64


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def graph():
    # a chain graph: token i is followed by i+1, so graphmax visibly changes decoding
    n = VOCAB
    return sp.csr_matrix(([1.0] * (n - 1), (list(range(n - 1)), list(range(1, n)))), shape=(n, n))


@pytest.fixture(scope="module")
def small_graph(built):
    """A real graph folder (Ã and Ã², n-gram tables of orders 3 and 4) over the 300-token test tokenizer."""
    return load_graph(built)


def _ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows)


# ---- the base class, from_graph and the lazy import


def test_the_base_class_is_not_constructed_and_names_what_to_use(graph):
    with pytest.raises(TypeError, match="PaperGraphmaxLogitsProcessor.*ContextGraphmaxLogitsProcessor.*from_graph"):
        GraphmaxLogitsProcessor(graph, lam=1.0)
    assert isinstance(PaperGraphmaxLogitsProcessor(graph), GraphmaxLogitsProcessor)
    assert isinstance(ContextGraphmaxLogitsProcessor(COUNTS), GraphmaxLogitsProcessor)


def test_import_gm_solver_does_not_import_transformers_and_exports_no_internals():
    code = ("import sys, gm_solver; assert 'transformers' not in sys.modules, 'imported'; "
            "assert not any(hasattr(gm_solver, n) for n in ('primal', 'dual', 'project_simplex', 'get_operator')); "
            "[getattr(gm_solver, n) for n in gm_solver.__all__]; assert 'transformers' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    import gm_solver

    assert set(gm_solver.__all__) <= set(dir(gm_solver))
    with pytest.raises(AttributeError, match="no attribute 'primal'"):
        gm_solver.primal


def test_from_graph_round_trips_the_stored_choice(small_graph, tmp_path):
    import shutil

    path = tmp_path / "g"
    shutil.copytree(small_graph.path, path)
    graph = load_graph(path)
    default = GraphmaxLogitsProcessor.from_graph(graph)
    assert type(default) is ContextGraphmaxLogitsProcessor and default.config == ContextConfig()
    assert default.config.source == {"tuned": False}
    chosen = ContextConfig(divergence="l2", lam=0.7, kl_share=0.2, order_weights=(0.8, 0.2), kappa=10.0,
                           ngram_order=3, source={"tuned": True})
    graph.set_decoder({"mode": "context", **chosen.to_dict()})
    reloaded = GraphmaxLogitsProcessor.from_graph(load_graph(path))
    assert reloaded.config == chosen and reloaded.config.source == {"tuned": True}
    assert load_graph(path).counts.nnz == small_graph.counts.nnz  # the arrays are untouched and still verify
    # arguments override the stored settings, and the record says which
    louder = GraphmaxLogitsProcessor.from_graph(load_graph(path), lam=2.0)
    assert louder.config == ContextConfig(**{**chosen.to_dict(), "lam": 2.0})
    assert louder.config.source == {"tuned": True, "overridden": ["lam"]}
    with pytest.raises(ValueError, match="`tol` applies to the paper decoder; pass decoder='paper'"):
        GraphmaxLogitsProcessor.from_graph(load_graph(path), tol=1e-4)
    with pytest.raises(TypeError, match="`beam` is not an argument of ContextGraphmaxLogitsProcessor"):
        GraphmaxLogitsProcessor.from_graph(load_graph(path), beam=4)
    with pytest.raises(ValueError, match="`solver` applies to the paper decoder"):
        GraphmaxLogitsProcessor.from_graph(load_graph(path), solver="paper")
    other = GraphmaxLogitsProcessor.from_graph(load_graph(path), decoder="paper", solver="paper", lam=0.5)
    assert type(other) is PaperAlgorithm1LogitsProcessor and other.lam == 0.5
    assert other.origin == "defaults" and reloaded.origin == "stored"
    graph.set_decoder({"mode": "paper", "lam": 0.3})
    paper = GraphmaxLogitsProcessor.from_graph(load_graph(path), tol=1e-4)
    assert type(paper) is PaperGraphmaxLogitsProcessor and (paper.lam, paper.tol) == (0.3, 1e-4)
    # a choice missing a setting is refused, never read with today's defaults
    graph.set_decoder({"mode": "context", "divergence": "rkl", "lam": 1.0, "order_weights": [1.0], "kappa": 3.0})
    with pytest.raises(GraphFormatError, match="has no .*store it again with `graphmax tune`"):
        GraphmaxLogitsProcessor.from_graph(load_graph(path))


def test_settings_given_to_the_factory_are_kept_and_checked_for_their_type():
    cfg = ContextConfig(divergence="kl", lam=0.5, kl_share=0.0, source={"tuned": True, "perplexity": 3.0})
    proc = GraphmaxLogitsProcessor.from_graph(COUNTS, settings=cfg)
    assert proc.config == cfg and proc.config.source == cfg.source and proc.reference.config == cfg
    assert proc.origin == "given" and proc.kind.name == "context"
    with pytest.raises(TypeError, match="`settings` must be the settings of a registered decoder kind"):
        GraphmaxLogitsProcessor.from_graph(COUNTS, settings={"lam": 1.0})
    with pytest.raises(ValueError, match="`decoder`='paper' but `settings` are those of the 'context' decoder"):
        GraphmaxLogitsProcessor.from_graph(COUNTS, decoder="paper", settings=cfg)


def test_repr_names_the_decoder_and_every_setting(graph):
    assert repr(PaperGraphmaxLogitsProcessor(graph, lam=2.0)) == \
        "PaperGraphmaxLogitsProcessor(lam=2.0, tol=1e-06, max_iter=200)"
    assert repr(PaperAlgorithm1LogitsProcessor(graph, lam=2.0)) == "PaperAlgorithm1LogitsProcessor(lam=2.0)"
    assert repr(ContextGraphmaxLogitsProcessor(COUNTS, divergence="l2")).startswith(
        "ContextGraphmaxLogitsProcessor(divergence='l2', lam=1.2, kl_share=0.15, ngram_order=4,")


# ---- the paper's decoder


def test_paper_returns_log_probabilities_without_editing_scores(graph):
    proc = PaperGraphmaxLogitsProcessor(graph, lam=1.0)
    scores = torch.randn(2, VOCAB)
    before = scores.clone()
    out = proc(torch.zeros(2, 3, dtype=torch.long), scores)
    assert torch.equal(scores, before) and out is not scores
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2))
    torch.testing.assert_close(out.exp(), graphmax(scores, graph, 1.0), atol=1e-6, rtol=0)
    assert (proc.last_info.gap <= 1e-6).all()


@pytest.mark.parametrize("kwargs, error", [
    ({"lam": -1.0}, "`lam` must be a finite float >= 0 .*, got -1.0"), ({"lam": math.inf}, "`lam`.*got inf"),
    ({"lam": math.nan}, "`lam`.*got nan"), ({"lam": "1"}, "`lam`.*got '1'"), ({"lam": True}, "`lam`.*got True"),
    ({"tol": 0.0}, "`tol` must be a finite float > 0, got 0.0"), ({"tol": math.inf}, "`tol`.*got inf"),
    ({"max_iter": 0}, "`max_iter` must be an int >= 1, got 0"), ({"max_iter": 2.5}, "`max_iter`.*got 2.5"),
    ({"check_every": -1}, "`check_every` must be None or an int >= 0.*got -1"),
    ({"device": "gpu"}, "`device` must be a torch.device or its name.*got 'gpu'"),
    ({"tokenizer": "smollm2"}, "`tokenizer` can only be checked against a gm_graphs.Graph, got a csr_matrix"),
])
def test_paper_arguments_are_validated_in_init(graph, kwargs, error):
    with pytest.raises(ValueError, match=error):
        PaperGraphmaxLogitsProcessor(graph, **kwargs)


@pytest.mark.parametrize("kwargs, error", [
    ({"lam": -1.0}, "`lam` must be a finite float >= 0 .*, got -1.0"), ({"lam": True}, "`lam`.*got True"),
    ({"device": "gpu"}, "`device` must be a torch.device or its name.*got 'gpu'"),
    ({"tokenizer": "smollm2"}, "`tokenizer` can only be checked against a gm_graphs.Graph, got a csr_matrix"),
])
def test_algorithm1_arguments_are_validated_in_init(graph, kwargs, error):
    with pytest.raises(ValueError, match=error):
        PaperAlgorithm1LogitsProcessor(graph, **kwargs)


def test_algorithm1_takes_no_convergence_settings_and_runs_the_papers_twenty_steps(graph):
    for name in ("tol", "max_iter", "check_every", "solver"):
        with pytest.raises(TypeError, match=name):
            PaperAlgorithm1LogitsProcessor(graph, **{name: 1})
    scores, ids = torch.randn(3, VOCAB) * 3, torch.zeros(3, 2, dtype=torch.long)
    proc = PaperAlgorithm1LogitsProcessor(graph, lam=1.0)
    out = proc(ids, scores)
    assert torch.equal(out, log_graphmax(scores, graph, 1.0, solver="paper"))
    assert (proc.last_info.iterations == 20).all()
    assert not torch.allclose(out, PaperGraphmaxLogitsProcessor(graph, lam=1.0)(ids, scores), atol=1e-7)


def test_paper_refuses_a_device_it_cannot_use(graph):
    from gm_solver.operator import TransitionOperator

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="`device`='cuda' but CUDA is not available"):
            PaperGraphmaxLogitsProcessor(graph, device="cuda")
    with pytest.raises(ValueError, match="differs from the TransitionOperator's device"):
        PaperGraphmaxLogitsProcessor(TransitionOperator(graph), device="meta")
    with pytest.raises(TypeError, match="graph must be"):
        PaperGraphmaxLogitsProcessor([[0, 1], [1, 0]])


def test_every_paper_argument_changes_the_output_or_reaches_the_solver(graph, small_graph, bpe_tokenizer,
                                                                         smollm2_tokenizer, monkeypatch):
    torch.manual_seed(1)
    scores, ids = torch.randn(3, VOCAB) * 3, torch.zeros(3, 2, dtype=torch.long)
    base = PaperGraphmaxLogitsProcessor(graph)(ids, scores)
    for kwargs in ({"lam": 3.0}, {"tol": 1e-2}, {"max_iter": 2}):
        assert not torch.allclose(PaperGraphmaxLogitsProcessor(graph, **kwargs)(ids, scores), base, atol=1e-7), kwargs
    # check_every and device change where and how often the solve synchronises, not its result
    import gm_solver.processor as module

    seen = {}
    solve = module.log_graphmax
    monkeypatch.setattr(module, "log_graphmax", lambda *a, **kw: seen.update(kw) or solve(*a, **kw))
    out = PaperGraphmaxLogitsProcessor(graph, check_every=0)(ids, scores)
    assert seen["check_every"] == 0 and torch.allclose(out, base, atol=1e-6)
    assert PaperGraphmaxLogitsProcessor(graph, device="cpu").operator.device == torch.device("cpu")
    # tokenizer: the graph's own passes, another vocabulary is refused
    PaperGraphmaxLogitsProcessor(small_graph, tokenizer=bpe_tokenizer)
    with pytest.raises(ValueError, match="was built with the tokenizer"):
        PaperGraphmaxLogitsProcessor(small_graph, tokenizer=smollm2_tokenizer)


# ---- the context decoder


@pytest.mark.parametrize("kwargs, error", [
    ({"divergence": "js"}, "`divergence` must be one of \\('kl', 'rkl', 'l2'\\), got 'js'"),
    ({"lam": -0.5}, "`lam` must be a finite float >= 0 .*got -0.5"), ({"lam": math.inf}, "`lam`.*got inf"),
    ({"kl_share": 1.5}, "`kl_share` must be a float in \\[0, 1\\].*got 1.5"), ({"kl_share": math.nan}, "`kl_share`"),
    ({"ngram_order": 1}, "`ngram_order` must be an int >= 2.*got 1"), ({"ngram_order": 3.0}, "`ngram_order`.*3.0"),
    ({"order_weights": ()}, "`order_weights` must be .*got \\(\\)"), ({"order_weights": (1, -1)}, "`order_weights`"),
    ({"order_weights": (0.0,)}, "positive sum"), ({"order_weights": "1"}, "`order_weights`.*got '1'"),
    ({"order_weights": 1.0}, "`order_weights`.*got 1.0"),
    ({"smoothing": "witten-bell"}, "`smoothing` must be one of .*got 'witten-bell'"),
    ({"discount": 1.0}, "`discount` must be a float in \\(0, 1\\).*got 1.0"),
    ({"kappa": 0.0}, "`kappa` must be a finite float > 0.*got 0.0"), ({"alpha": -1}, "`alpha`.*got -1"),
    ({"lam_decay": -0.1}, "`lam_decay` must be a finite float >= 0 .*got -0.1"),
    ({"lam_decay": math.inf}, "`lam_decay`.*got inf"), ({"lam_decay": "0.5"}, "`lam_decay`.*got '0.5'"),
    ({"prompt_length": -1}, "`prompt_length` must be an int >= 0.*got -1"),
    ({"prompt_length": 2.0}, "`prompt_length`.*got 2.0"), ({"prompt_length": True}, "`prompt_length`.*got True"),
    ({"tokenizer": "smollm2"}, "`tokenizer` can only be checked against a gm_graphs.Graph"),
    # a setting that another one switches off
    ({"kappa": 10.0}, "`kappa`=10.0 has no effect with smoothing='kneser-ney' and one order"),
    ({"smoothing": "dirichlet", "discount": 0.5}, "`discount`=0.5 has no effect with smoothing='dirichlet'"),
    ({"ngram_order": 3}, "`ngram_order`=3 has no effect on a graph whose n-gram tables are none"),
    ({"divergence": "kl", "kl_share": 0.3}, "`kl_share`=0.3 has no effect with divergence='kl'"),
    ({"divergence": "l2", "kl_share": 1.0}, "`divergence`='l2' has no effect at kl_share=1"),
])
def test_context_arguments_are_validated_in_init(kwargs, error):
    with pytest.raises(ValueError, match=error):
        ContextGraphmaxLogitsProcessor(COUNTS, **kwargs)


@given(st.integers(0, 12), st.integers(1, 9), st.integers(1, 3), st.sampled_from([0.0, 0.5, 1.0]),
       st.integers(0, 2**16))
def test_a_prompt_length_counts_lambda_t_from_the_text_after_it(prompt, text, rows, decay, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (rows, prompt + text), generator=g)
    scores = torch.randn(rows, 5, generator=g, dtype=torch.float64)
    settings = dict(lam=2.0, lam_decay=decay, order_weights=(1.0,))  # q reads the last token only
    after = ContextGraphmaxLogitsProcessor(COUNTS, prompt_length=prompt, **settings)(ids, scores)
    alone = ContextGraphmaxLogitsProcessor(COUNTS, **settings)(ids[:, prompt:], scores)
    assert torch.allclose(after, alone, atol=1e-12, rtol=0)
    if decay > 0 and prompt > 0:  # counted from the first column, λ_t is another
        whole = ContextGraphmaxLogitsProcessor(COUNTS, **settings)(ids, scores)
        assert not torch.allclose(whole, alone, atol=1e-9, rtol=0)


def test_context_takes_the_graphs_counts_at_order_one_only(small_graph):
    with pytest.raises(TypeError, match="`graph` must be a gm_graphs.Graph or a square scipy sparse count matrix"):
        ContextGraphmaxLogitsProcessor(torch.eye(3).to_sparse_csr())
    with pytest.raises(ValueError, match="`graph` is loaded as order2.*load_graph\\(name\\)"):
        ContextGraphmaxLogitsProcessor(load_graph(small_graph.path, order=2))
    with pytest.raises(ValueError, match="`ngram_order`=5 has no effect on a graph whose n-gram tables are \\[3, 4\\]"):
        ContextGraphmaxLogitsProcessor(small_graph, ngram_order=5)
    # what the switched-off settings need is there: accepted
    ContextGraphmaxLogitsProcessor(small_graph, smoothing="dirichlet", discount=0.5)   # the n-gram tables' D
    ContextGraphmaxLogitsProcessor(COUNTS, kappa=10.0, order_weights=(0.8, 0.2))        # Ã² rows' prior
    ContextGraphmaxLogitsProcessor(COUNTS, divergence="kl", kl_share=0.0)


def test_every_context_argument_changes_the_output(small_graph, bpe_tokenizer, smollm2_tokenizer):
    torch.manual_seed(2)
    n = small_graph.vocab_size
    scores = torch.randn(2, n) * 2
    ids = torch.tensor([bpe_tokenizer(text)["input_ids"][-3:] for text in ("the movie was really", "I loved it so")])

    def out(**kwargs):
        return ContextGraphmaxLogitsProcessor(small_graph, **kwargs)(ids, scores)

    base = out()
    changes = [{"divergence": "l2"}, {"lam": 0.5}, {"kl_share": 0.4}, {"ngram_order": 3}, {"order_weights": (0.7, 0.3)},
               {"smoothing": "dirichlet"}, {"discount": 0.5}, {"alpha": 5.0},
               {"smoothing": "dirichlet", "kappa": 30.0}, {"order_weights": (0.7, 0.3), "kappa": 30.0}]
    for kwargs in changes:
        assert not torch.allclose(out(**kwargs), base, atol=1e-6), kwargs
    assert not torch.allclose(out(smoothing="dirichlet", kappa=30.0), out(smoothing="dirichlet"), atol=1e-6)
    assert not torch.allclose(out(order_weights=(0.7, 0.3), kappa=30.0), out(order_weights=(0.7, 0.3)), atol=1e-6)
    ContextGraphmaxLogitsProcessor(small_graph, tokenizer=bpe_tokenizer)
    with pytest.raises(ValueError, match="was built with the tokenizer"):
        ContextGraphmaxLogitsProcessor(small_graph, tokenizer=smollm2_tokenizer)


@pytest.mark.parametrize("make", [PaperGraphmaxLogitsProcessor, ContextGraphmaxLogitsProcessor],
                         ids=["paper", "context"])
@pytest.mark.parametrize("bad, error", [
    (math.nan, "(logits|scores) contains? NaN"), (math.inf, "(logits|scores) contains? \\+inf"),
    ("row", "a row of (logits|scores) is entirely -inf"),
])
def test_both_decoders_refuse_bad_scores_alike(make, bad, error):
    proc = make(COUNTS)
    scores = torch.zeros(2, 5)
    if bad == "row":
        scores[1] = -math.inf
    else:
        scores[1, 2] = bad
    with pytest.raises(ValueError, match=error):
        proc(_ids([0], [1]), scores)


def test_context_lambda_zero_is_softmax_and_narrow_scores_are_refused():
    scores = torch.randn(2, 5)
    assert torch.equal(ContextGraphmaxLogitsProcessor(COUNTS, lam=0.0)(_ids([0], [1]), scores),
                       torch.log_softmax(scores.double(), -1).float())
    with pytest.raises(ValueError, match="scores have 4 entries but the graph has 5 nodes"):
        ContextGraphmaxLogitsProcessor(COUNTS)(_ids([0]), torch.zeros(1, 4))


@pytest.mark.parametrize("make", [lambda g: PaperGraphmaxLogitsProcessor(g, lam=2.0),
                                  lambda g: ContextGraphmaxLogitsProcessor(g, lam=2.0)], ids=["paper", "context"])
def test_warmup_returns_the_processor_and_leaves_no_trace(make):
    proc = make(COUNTS)
    assert proc.warmup() is proc and proc.last_info is None
    scores = torch.randn(1, 5)
    torch.testing.assert_close(proc(_ids([0, 1]), scores), make(COUNTS)(_ids([0, 1]), scores))


def test_the_paper_decoders_warmup_takes_solver_steps(monkeypatch):
    # a warm-up whose rows were certified where the solve starts would leave the step kernels to compile inside
    # the first real step: on a cycle, equal scores are (uniform x, Lx = 0)
    from gm_solver.backends.numba import mirror as mirror_kernel

    cycle = sp.csr_matrix(([1.0] * 5, ([0, 1, 2, 3, 4], [1, 2, 3, 4, 0])), shape=(5, 5))

    judged = []
    judge = mirror_kernel.judge_rows
    monkeypatch.setattr(mirror_kernel, "judge_rows", lambda *args: judged.append(args[0].shape[0]) or judge(*args))
    PaperGraphmaxLogitsProcessor(cycle, lam=2.0).warmup()
    assert judged


# ---- every decoder at λ = 0

_LAMBDA_ZERO = {
    "paper": lambda: PaperGraphmaxLogitsProcessor(COUNTS, lam=0.0),
    "algorithm 1": lambda: PaperAlgorithm1LogitsProcessor(COUNTS, lam=0.0),
    "context": lambda: ContextGraphmaxLogitsProcessor(COUNTS, lam=0.0, lam_decay=0.5, prompt_length=2),
    "knn": lambda: KnnContextGraphmaxLogitsProcessor(COUNTS, Datastore(torch.eye(5, 3).numpy(), [1, 2, 3, 4, 0],
                                                                       vocab_size=5), HiddenStateTap(), lam=0.0),
}


@given(rows=st.lists(st.lists(st.one_of(st.floats(-60, 60), st.just(-math.inf)), min_size=5, max_size=5),
                     min_size=1, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64]), length=st.integers(1, 6),
       decoder=st.sampled_from(sorted(_LAMBDA_ZERO)))
def test_at_lambda_zero_every_decoder_is_the_softmax_of_its_scores(rows, dtype, length, decoder):
    # no regulariser: the problem's exact solution is softmax, computed in float64 and rounded once to the scores'
    # dtype as every solution is, on any CPU (float32's own log-sum-exp over 49k logits is 1e-5 off, and by more
    # with AVX2 than with AVX-512); with a step's info, as any solve leaves: no iteration, gap 0
    scores = torch.tensor(rows, dtype=torch.float64)
    scores[:, 0] = scores[:, 0].nan_to_num(neginf=1.0)  # every row keeps a finite score
    scores = scores.to(dtype)
    ids = torch.arange(scores.shape[0] * length).reshape(scores.shape[0], length) % 5
    proc = _LAMBDA_ZERO[decoder]()
    out = proc(ids, scores)
    assert out.dtype == dtype and torch.equal(out, torch.log_softmax(scores.double(), -1).to(dtype))
    info = proc.last_info
    assert info.iterations.tolist() == [0] * len(rows) and info.gap.tolist() == [0.0] * len(rows)
    assert bool(info.converged.all())


@pytest.mark.parametrize("lam_decay", [0.0, 0.5, 3.0])
@pytest.mark.parametrize("prompt_length", [0, 3])
def test_a_decaying_lambda_is_never_zero_after_any_prompt(monkeypatch, lam_decay, prompt_length):
    # λ_t = λ·t^(−γ) with t ≥ 1 counted after the prompt: positive, so every step solves (softmax only at λ = 0)
    from gm_solver import context

    def no_softmax(z):
        raise AssertionError("λ_t > 0 solved as λ = 0")

    monkeypatch.setattr(context, "softmax_solution", no_softmax)
    proc = ContextGraphmaxLogitsProcessor(COUNTS, lam=2.0, lam_decay=lam_decay, prompt_length=prompt_length)
    scores = torch.zeros(2, 5)
    for length in (1, prompt_length, prompt_length + 1, prompt_length + 8):
        out = proc(torch.zeros(2, max(length, 1), dtype=torch.long), scores)
        assert not torch.equal(out, torch.log_softmax(scores, -1)) and proc.last_info.gap.max() <= 1e-6


# ---- inside generate()


def _gen(model, ids, proc, **kw):
    torch.manual_seed(0)
    procs = LogitsProcessorList([proc] if proc else [])
    return model.generate(ids, logits_processor=procs, max_new_tokens=6, min_new_tokens=6, pad_token_id=0, **kw)


@pytest.mark.parametrize("decoder", ["paper", "context"])
def test_greedy_sampling_and_beam_search(tiny_llama, graph, decoder):
    ids = torch.tensor([[5, 9, 13]])
    if decoder == "paper":
        proc, off = PaperGraphmaxLogitsProcessor(graph, lam=5.0), PaperGraphmaxLogitsProcessor(graph, lam=0.0)
    else:
        proc, off = ContextGraphmaxLogitsProcessor(graph, lam=5.0), ContextGraphmaxLogitsProcessor(graph, lam=0.0)
    plain = _gen(tiny_llama, ids, None, do_sample=False)
    greedy = _gen(tiny_llama, ids, proc, do_sample=False)
    assert not torch.equal(plain, greedy)  # λ = 5 on a chain graph changes the path
    assert torch.equal(plain, _gen(tiny_llama, ids, off, do_sample=False))  # λ = 0 is plain decoding exactly
    sampled = _gen(tiny_llama, ids, proc, do_sample=True, top_k=10, temperature=0.7)
    assert sampled.shape == (1, 9)
    beams = _gen(tiny_llama, ids, proc, do_sample=False, num_beams=3, num_return_sequences=2)
    assert beams.shape == (2, 9)


def test_warpers_after_graphmax_see_its_log_probabilities(graph):
    scores = 3 * torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    procs = LogitsProcessorList([PaperGraphmaxLogitsProcessor(graph, lam=1.0), TemperatureLogitsWarper(0.5),
                                 TopKLogitsWarper(5)])
    out = procs(torch.zeros(1, 1, dtype=torch.long), scores.clone())
    logp = log_graphmax(scores, graph, 1.0).to(scores.dtype)  # graphmax's log-probabilities, by the function
    kept = torch.isfinite(out)
    # the warpers kept graphmax's five most likely tokens, tempered: what the raw scores would give differs
    assert set(kept.nonzero()[:, 1].tolist()) == set(logp.topk(5).indices[0].tolist())
    torch.testing.assert_close(out[kept], logp[kept] / 0.5)
    assert not torch.allclose(out[kept], scores[kept] / 0.5)


def test_batch_with_left_padding_equals_single_rows(tiny_llama, graph):
    proc = PaperGraphmaxLogitsProcessor(graph, lam=2.0)
    a, b = [5, 9, 13, 17], [7, 11]
    batch = torch.tensor([a, [0, 0, *b]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    torch.manual_seed(0)
    out = tiny_llama.generate(batch, attention_mask=mask, logits_processor=LogitsProcessorList([proc]),
                              max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    for row, prompt in zip(out, (a, b)):
        single = _gen(tiny_llama, torch.tensor([prompt]), proc, do_sample=False)
        assert row[-5:].tolist() == single[0, -6:-1].tolist()


def test_encoder_decoder_model(graph):
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(cfg).eval()
    for proc in (PaperGraphmaxLogitsProcessor(graph, lam=1.0), ContextGraphmaxLogitsProcessor(graph)):
        seen = []  # each step's scores as the model gave them, and as the decoder returned them

        def recorded(ids, scores, proc=proc, seen=seen):
            seen.append((scores.clone(), proc(ids, scores.clone())))
            return seen[-1][1]

        out = _gen(model, torch.tensor([[5, 6, 7]]), recorded, do_sample=False)
        assert out.shape[1] == 7 and len(seen) == 6  # start token + 6, one decoder step each
        for step, (raw, logp) in enumerate(seen):
            # greedy took graphmax's most likely token, certified, and not the raw scores' argmax alone
            assert out[0, step + 1] == logp.argmax(-1)[0]
            torch.testing.assert_close(logp.exp().sum(-1), torch.ones(1))
            assert not torch.allclose(logp, torch.log_softmax(raw, -1))
        assert bool((proc.last_info.gap <= 1e-6).all())


@pytest.mark.parametrize("make", [PaperGraphmaxLogitsProcessor, ContextGraphmaxLogitsProcessor],
                         ids=["paper", "context"])
def test_padded_model_vocabulary(graph, make):
    out = make(graph)(torch.zeros(1, 1, dtype=torch.long), torch.randn(1, VOCAB + 16))
    assert out.shape == (1, VOCAB + 16) and abs(float(out.exp().sum()) - 1) < 1e-5


@pytest.mark.slow
def test_real_smollm2_generates_with_the_real_drug_graph(smollm2, drug_graph):
    model, tok = smollm2
    ids = tok(["This medication"], return_tensors="pt", add_special_tokens=False).input_ids
    for proc in (PaperGraphmaxLogitsProcessor(drug_graph, lam=1.0, tokenizer=tok),
                 GraphmaxLogitsProcessor.from_graph(drug_graph, tokenizer=tok)):
        out = model.generate(ids, logits_processor=LogitsProcessorList([proc]), max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, pad_token_id=tok.pad_token_id)
        assert out.shape[1] == ids.shape[1] + 4
        assert (proc.last_info.gap <= 1e-6).all()
        assert tok.decode(out[0, ids.shape[1]:]).strip()
