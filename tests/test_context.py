"""Context-aware graphmax: the reference rows (gm_solver.context and its kernel), their step toward q, the context
processor, interpolation, and the config."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_graphs.count.ngram_counts import NgramCounts
from gm_solver import (
    ContextConfig,
    ContextGraphmaxLogitsProcessor,
    ContextReference,
    InterpolationLogitsProcessor,
    certificate_toward,
    solve_toward,
)
from gm_solver.backends import eager

from .helpers import COUNTS


def test_reference_reads_exactly_the_context_tokens_it_claims():
    one = ContextReference(COUNTS, ContextConfig(order_weights=(1.0,)))
    two = ContextReference(COUNTS, ContextConfig(order_weights=(0.7, 0.3)))
    a, b = torch.tensor([[3, 1, 0]]), torch.tensor([[3, 2, 0]])  # differ two tokens back
    assert torch.equal(one(a), one(b))  # order 1 reads only the previous token
    assert not torch.allclose(two(a), two(b))  # order 2 reads the token before it too
    assert torch.equal(two(torch.tensor([[0, 1, 1]])), two(torch.tensor([[4, 1, 1]])))  # three back: ignored
    assert not torch.equal(one(a), one(torch.tensor([[3, 1, 1]])))


@pytest.mark.parametrize("order_weights", [(1.0,), (0.6, 0.4)])
@pytest.mark.parametrize("smoothing", ["kneser-ney", "dirichlet"])
def test_reference_rows_are_distributions_with_mass_on_every_graph_token(smoothing, order_weights):
    ref = ContextReference(COUNTS, ContextConfig(smoothing=smoothing, order_weights=order_weights))
    q = ref(torch.tensor([[4, 0], [2, 1], [0, 3], [1, 4]]))
    assert torch.allclose(q.sum(-1), torch.ones(4, dtype=torch.float64)) and (q > 0).all()


def test_kneser_ney_discounts_each_seen_bigram_and_backs_off_to_the_continuation_unigram():
    ref = ContextReference(COUNTS, ContextConfig(smoothing="kneser-ney", discount=0.75, alpha=0.5))
    # continuation counts: distinct predecessors of each token
    preceded_by = np.array([2, 2, 2, 2, 1]) + 0.5
    np.testing.assert_allclose(ref.unigram, preceded_by / preceded_by.sum())
    # after token 0 (counts 5 and 1, c = 6, 2 distinct successors): (A − D)/c plus D·2/c of the unigram
    expected = np.array([0, 4.25, 0.25, 0, 0]) / 6 + 0.75 * 2 / 6 * ref.unigram
    np.testing.assert_allclose(ref(torch.tensor([[0]]))[0].numpy(), expected)
    np.testing.assert_allclose(ref(torch.tensor([[4]]))[0].numpy(), ref.unigram)  # never followed by anything


def test_dirichlet_rows_and_unseen_contexts_back_off_to_the_unigram():
    ref = ContextReference(COUNTS, ContextConfig(smoothing="dirichlet", kappa=2.0, alpha=0.5))
    q = ref(torch.tensor([[0], [1], [3]]))
    assert torch.allclose(q.sum(-1), torch.ones(3, dtype=torch.float64))
    unseen = ref(torch.tensor([[4]]))[0].numpy()  # token 4 has no successors in the corpus
    np.testing.assert_allclose(unseen, ref.unigram)
    # a frequent context trusts its row: count c = 6, κ = 2 → 6/8 of the mass on the row of Ã
    np.testing.assert_allclose(q[0].numpy(), (np.array([0, 5, 1, 0, 0]) + 2 * ref.unigram) / 8)
    wide = ref(torch.tensor([[0]]), width=8)
    assert wide.shape == (1, 8) and (wide[0, 5:] == 0).all()


def test_context_processor_lambda_zero_is_softmax_and_inputs_are_not_edited():
    scores = torch.randn(2, 5)
    before = scores.clone()
    proc = ContextGraphmaxLogitsProcessor(COUNTS, lam=0.0)
    out = proc(torch.tensor([[0], [1]]), scores)
    assert torch.equal(out, torch.log_softmax(scores.double(), -1).float()) and torch.equal(scores, before)
    assert proc.last_info.iterations.tolist() == [0, 0] and proc.last_info.gap.tolist() == [0.0, 0.0]


def test_context_processor_moves_mass_toward_the_corpus_continuation():
    scores = torch.zeros(1, 5)
    proc = ContextGraphmaxLogitsProcessor(COUNTS, lam=2.0)
    out = proc(torch.tensor([[0]]), scores).exp()[0]
    assert out.argmax().item() == 1  # after token 0 the corpus continues with 1 (5 of 6 times)
    assert proc.last_info.gap.max().item() <= 1e-6


@pytest.mark.parametrize("kwargs, error", [
    (dict(divergence="js"), "divergence"), (dict(lam=-1.0), "lam"), (dict(order_weights=()), "order_weights"),
    (dict(kappa=0.0), "kappa"), (dict(smoothing="witten-bell"), "smoothing"), (dict(discount=1.0), "discount"),
    (dict(ngram_order=1), "ngram_order"), (dict(kl_share=-0.1), "kl_share"), (dict(kl_share=2.0), "kl_share"),
    (dict(lam_decay=-0.5), "lam_decay"), (dict(lam_decay=float("inf")), "lam_decay"),
    (dict(lam_decay=float("nan")), "lam_decay"),
])
def test_config_is_validated(kwargs, error):
    with pytest.raises(ValueError, match=error):
        ContextConfig(**kwargs)


def test_a_config_stored_before_lam_decay_keeps_lambda_constant():
    stored = ContextConfig(lam=2.0).to_dict()
    del stored["lam_decay"]
    cfg = ContextConfig.from_dict(stored)
    assert cfg.lam_decay == 0.0 and cfg.lam_at(1) == cfg.lam_at(500) == 2.0


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 40), decay=st.floats(0.0, 2.0), lam=st.floats(0.05, 8.0),
       backend=st.sampled_from(["numba", "torch"]))
def test_the_step_uses_lambda_at_the_context_length(length, decay, lam, backend):
    # λ_t = λ·t^(−γ) with t the length of input_ids: the same step as passing that λ explicitly
    ref = ContextReference(COUNTS, ContextConfig(lam=lam, lam_decay=decay))
    ids = torch.randint(0, 5, (3, length), generator=torch.Generator().manual_seed(length))
    scores = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(length + 1))
    got, info = ref.step(ids, scores, backend=backend)
    expected, _ = ref.step(ids, scores, lam=lam * length ** -decay, backend=backend)
    assert torch.equal(got, expected) and bool((info.gap <= 1e-6).all())
    if lam * length ** -decay != lam:  # and not the step at λ itself
        assert not torch.equal(got, ref.step(ids, scores, lam=lam, backend=backend)[0])


def test_interpolation_is_the_mixture_of_softmax_and_the_reference():
    scores = torch.randn(1, 5, dtype=torch.float64)
    proc = InterpolationLogitsProcessor(COUNTS, weight=0.25)
    q = proc.reference(torch.tensor([[2]]))
    expected = 0.75 * torch.softmax(scores, -1) + 0.25 * q
    assert torch.allclose(proc(torch.tensor([[2]]), scores).exp(), expected)
    with pytest.raises(ValueError, match="weight"):
        InterpolationLogitsProcessor(COUNTS, weight=1.5)




# --- the reference rows and the decoding step, against formulas written out densely here ---

def _graph(seed: int, n: int = 12) -> SimpleNamespace:
    """A graph-like object: random bigram counts (a row with no successors) and 3- and 4-gram tables."""
    rng = np.random.default_rng(seed)
    dense = rng.integers(0, 6, size=(n, n)) * (rng.random((n, n)) < 0.35)
    dense[n - 2] = 0  # a token the corpus never continues
    tables = {}
    for order in (3, 4):
        keys = np.unique(rng.integers(0, n ** order, size=60))
        tables[order] = NgramCounts.from_keys(order, keys, rng.integers(1, 5, size=keys.size), n)
    return SimpleNamespace(counts=sp.csr_matrix(dense), ngrams=tables)


def _expected_rows(graph: SimpleNamespace, cfg: ContextConfig, ids: torch.Tensor, width: int) -> torch.Tensor:
    """q(· | context) from the module docstring's formulas, with dense matrices (Ãᵏ by matrix powers)."""
    counts = graph.counts.toarray().astype(float)
    n = len(counts)
    c_row = counts.sum(1)
    col = (counts > 0).sum(0) if cfg.smoothing == "kneser-ney" else counts.sum(0)
    u = (col + cfg.alpha) / (col.sum() + cfg.alpha * n)
    a = np.divide(counts, c_row[:, None], out=np.zeros_like(counts), where=c_row[:, None] > 0)
    out = np.zeros((len(ids), width))
    for b, context in enumerate(ids.tolist()):
        q, total = np.zeros(n), 0.0
        for k, beta in enumerate(cfg.order_weights, start=1):
            if beta == 0 or len(context) < k:
                continue
            tok = context[-k]
            c = c_row[tok] if 0 <= tok < n else 0.0
            if c == 0:
                qk = u.copy()
            elif k == 1 and cfg.smoothing == "kneser-ney":
                qk = cfg.discount * (counts[tok] > 0).sum() / c * u + np.maximum(counts[tok] - cfg.discount, 0) / c
            else:
                row = np.linalg.matrix_power(a, k)[tok]
                qk = (cfg.kappa + c * (1 - row.sum())) / (c + cfg.kappa) * u + c / (c + cfg.kappa) * row
            for order, table in sorted(graph.ngrams.items()):
                if k == 1 and order <= cfg.ngram_order and len(context) >= order - 1:
                    found = table.successors(context[-(order - 1):])
                    if found is not None:
                        nxt, cnt = found
                        qk = cfg.discount * len(nxt) / cnt.sum() * qk
                        qk[nxt] += np.maximum(cnt - cfg.discount, 0) / cnt.sum()
            q += beta * qk
            total += beta
        out[b, :n] = q / total if total else q
    return torch.from_numpy(out)


CONFIGS = [ContextConfig(), ContextConfig(ngram_order=3, kl_share=0.0), ContextConfig(smoothing="dirichlet", lam=2.0),
           ContextConfig(order_weights=(0.6, 0.3, 0.1), divergence="l2", lam=0.7),
           ContextConfig(order_weights=(0.0, 1.0), divergence="kl", ngram_order=2),
           ContextConfig(divergence="l2", kl_share=0.3, smoothing="dirichlet", ngram_order=4)]


def _contexts(graph: SimpleNamespace, seed: int, rows: int, length: int) -> torch.Tensor:
    """Random contexts over the graph's tokens (and beyond it, as padded vocabularies have), half of them ending
    in a context of the 4-gram table, so that the tables' discounts are exercised."""
    rng = np.random.default_rng(seed)
    n = graph.counts.shape[0]
    ids = rng.integers(0, n + 2, size=(rows, length))
    table = graph.ngrams[4]
    for b in range(0, rows, 2):
        if length >= 3:
            ids[b, -3:] = np.unravel_index(rng.choice(table.dense()[0]), (n, n, n))
    return torch.from_numpy(ids)


@given(st.integers(0, 10_000), st.sampled_from(CONFIGS), st.integers(1, 6), st.integers(0, 5))
def test_reference_rows_equal_the_formulas_on_cpu_and_in_torch(seed, cfg, rows, length):
    graph = _graph(seed)
    ids = _contexts(graph, seed, rows, length)
    ref = ContextReference(graph, cfg)
    expected = _expected_rows(graph, cfg, ids, 15)
    torch.testing.assert_close(ref(ids, width=15), expected, atol=1e-13, rtol=0)
    torch.testing.assert_close(eager.reference_rows(ref, ids, 15), expected, atol=1e-13, rtol=0)


@given(st.integers(0, 10_000), st.sampled_from(CONFIGS), st.integers(1, 6), st.sampled_from([0, 1, 3]))
def test_step_solves_toward_the_reference_rows(seed, cfg, rows, masked):
    graph = _graph(seed)
    ids = _contexts(graph, seed, rows, 4)
    ref = ContextReference(graph, cfg)
    gen = torch.Generator().manual_seed(seed)
    scores = 3 * torch.randn(rows, 14, generator=gen, dtype=torch.float64)
    scores[:, :masked] = -torch.inf  # masked tokens (earlier processors)
    logx, info = ref.step(ids, scores)
    assert (info.gap <= 1e-6).all() and (logx[:, :masked] == -torch.inf).all()
    expected, _ = solve_toward(scores, _expected_rows(graph, cfg, ids, 14), cfg.lam, cfg.divergence,
                               kl_share=cfg.kl_share, backend="torch")
    torch.testing.assert_close(logx.exp(), expected.exp(), atol=1e-10, rtol=0)
    for b in range(rows):  # a row does not depend on the batch it is in: bit for bit
        alone, _ = ref.step(ids[b:b + 1], scores[b:b + 1])
        assert torch.equal(alone[0], logx[b])
    on_torch, info_torch = ref.step(ids, scores, backend="torch")
    torch.testing.assert_close(on_torch.exp(), logx.exp(), atol=1e-10, rtol=0)
    assert (info_torch.gap <= 1e-6).all()


SCALED = [ContextConfig(), ContextConfig(kl_share=0.0), ContextConfig(divergence="kl"),
          ContextConfig(divergence="l2", kl_share=0.0), ContextConfig(divergence="l2", lam=3.0)]


@settings(max_examples=100)  # 39 scales × 5 configs × 2 backends × 2 dtypes: more than the profile's 30
@given(st.integers(0, 38), st.integers(0, 10_000), st.sampled_from(SCALED), st.sampled_from(["numba", "torch"]),
       st.sampled_from([torch.float64, torch.float32]))
def test_the_step_is_a_certified_distribution_at_every_scale_of_scores(k, seed, cfg, backend, dtype):
    # the objective moves by a constant when the scores do (⟨x, z + c⟩ = ⟨x, z⟩ + c on the simplex): scores of
    # 1e20 are as solvable as scores of 1, x* near the argmax one-hot (rkl keeps about λq/|Δz| on the others)
    graph = _graph(seed)
    ids = _contexts(graph, seed, 4, 4)
    ref = ContextReference(graph, cfg)
    scale = min(10.0 ** k, 3e38)
    scores = scale * (2 * torch.rand(4, 14, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) - 1)
    scores[1] = scale  # all scores equal
    scores[2, :3] = -torch.inf
    scores = scores.to(dtype)
    logx, info = ref.step(ids, scores, backend=backend)
    assert logx.dtype == dtype and (logx[2, :3] == -torch.inf).all()
    torch.testing.assert_close(logx.double().exp().sum(-1), torch.ones(4, dtype=torch.float64), rtol=0,
                               atol=1e-12 if dtype == torch.float64 else 1e-6)
    assert (info.gap <= 1e-6).all()
    if dtype == torch.float64 and (cfg.kl_share == 0 or cfg.divergence == "kl"):
        # the certificate again, from scratch, on the scores as given
        gap = certificate_toward(logx, scores, ref.restricted(ids, scores), cfg.lam, cfg.divergence)
        assert (gap <= 1e-6).all()


@given(st.integers(0, 10_000), st.sampled_from(CONFIGS), st.sampled_from(["numba", "torch"]))
def test_step_takes_one_lambda_per_row(seed, cfg, backend):
    graph = _graph(seed)
    ids = _contexts(graph, seed, 4, 4)
    ref = ContextReference(graph, cfg)
    scores = 3 * torch.randn(4, 12, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    lam = torch.tensor([0.0, 0.4, 1.7, 12.0], dtype=torch.float64)
    logx, info = ref.step(ids, scores, lam=lam, backend=backend)
    assert info.gap[0] == 0 and (info.gap <= 1e-6).all()
    torch.testing.assert_close(logx[0], torch.log_softmax(scores[0], -1))
    for b in range(1, 4):
        alone, _ = ref.step(ids[b:b + 1], scores[b:b + 1], lam=float(lam[b]), backend=backend)
        torch.testing.assert_close(logx[b].exp(), alone[0].exp(), atol=1e-12, rtol=0)


def test_step_on_the_torch_path_reads_no_value_back_to_the_host(monkeypatch):
    graph = _graph(7)
    ids = _contexts(graph, 7, 5, 4)
    ref = ContextReference(graph, ContextConfig(order_weights=(0.7, 0.3)))
    scores = 3 * torch.randn(5, 13, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    scores[1, 2] = -torch.inf
    expected, _ = ref.step(ids, scores)

    def refuse(*args, **kwargs):
        raise AssertionError("a host synchronisation on a GPU")

    for name in ("__bool__", "item", "tolist", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)
    logx, info = ref.step(ids, scores, backend="torch", check_every=0, max_iter=12)
    monkeypatch.undo()
    assert info.converged.all()
    torch.testing.assert_close(logx.exp(), expected.exp(), atol=1e-10, rtol=0)
    with pytest.raises(RuntimeError, match="NaN"):  # the input checks still run, asserted on the device
        ref.step(ids, torch.full_like(scores, float("nan")), backend="torch", check_every=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the device tool lends one to some sessions)")
@pytest.mark.parametrize("cfg", CONFIGS)
def test_step_on_cuda_equals_the_cpu_kernel(cfg):
    graph = _graph(11)
    ids = _contexts(graph, 11, 6, 4)
    ref = ContextReference(graph, cfg)
    scores = 3 * torch.randn(6, 16, generator=torch.Generator().manual_seed(11))
    scores[0, 3] = -torch.inf
    cpu, _ = ref.step(ids, scores.double())
    gpu, info = ref.step(ids.cuda(), scores.double().cuda())
    assert gpu.device.type == "cuda" and bool(info.converged.all())
    torch.testing.assert_close(gpu.exp().cpu(), cpu.exp(), atol=1e-10, rtol=0)
    torch.testing.assert_close(ref(ids.cuda(), width=16).cpu(), ref(ids, width=16), atol=1e-13, rtol=0)


@pytest.mark.parametrize("call, error", [
    (lambda ref, ids, s: ref.step(ids[:2], s), "input_ids has 2 rows but scores has 3"),
    (lambda ref, ids, s: ref.step(ids, s[:, :10]), "graph has 12 nodes"),
    (lambda ref, ids, s: ref.step(ids.double(), s), "input_ids must be an integer tensor"),
    (lambda ref, ids, s: ref.step(ids, s.index_fill(1, torch.tensor([4]), float("nan"))), "scores contains NaN"),
    (lambda ref, ids, s: ref.step(ids, s.index_fill(1, torch.tensor([4]), float("inf"))), r"scores contains \+inf"),
    (lambda ref, ids, s: ref.step(ids, s.index_fill(0, torch.tensor([1]), -float("inf"))), "entirely -inf"),
    (lambda ref, ids, s: ref.step(ids, s, lam=float("inf")), "lam must be finite"),
    (lambda ref, ids, s: ref.step(ids, s, lam=torch.tensor([1.0, float("nan"), 1.0])), "lam must be finite"),
    (lambda ref, ids, s: ref.step(ids, s, lam=torch.ones(2)), r"shape \(3,\)"),
    (lambda ref, ids, s: ref(ids, width=5), "narrower than the graph"),
])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_step_refuses_bad_inputs(call, error, backend):
    graph = _graph(3)
    ref = ContextReference(graph, ContextConfig())
    step = ref.step
    ref.step = lambda *a, **kw: step(*a, **kw, backend=backend)
    with pytest.raises(ValueError, match=error):
        call(ref, _contexts(graph, 3, 3, 4), torch.randn(3, 14, dtype=torch.float64))


def test_counts_that_are_not_counts_are_refused():
    with pytest.raises(ValueError, match="integers >= 0"):
        ContextReference(COUNTS * 0.5)
    with pytest.raises(ValueError, match="integers >= 0"):
        ContextReference(-COUNTS)


def _broken_index(g):
    g.counts.indices[0] = 99


def _broken_next(g):
    g.ngrams[3].table.arrays["next"][0] = 12


def _broken_indptr(g):
    g.ngrams[4].table.arrays["indptr"][1] = g.ngrams[4].entries + 1


@pytest.mark.parametrize("damage, error", [(_broken_index, "column indices outside"),
                                           (_broken_next, "order-3 n-gram table is malformed"),
                                           (_broken_indptr, "order-4 n-gram table is malformed")])
def test_arrays_that_would_send_the_kernel_out_of_bounds_are_refused(damage, error):
    graph = _graph(5)
    graph.ngrams = {n: dataclasses.replace(t, levels=tuple(
        dataclasses.replace(level, arrays={k: np.array(v) for k, v in level.arrays.items()}) for level in t.levels))
        for n, t in graph.ngrams.items()}
    damage(graph)
    with pytest.raises(ValueError, match=error):
        ContextReference(graph)


@pytest.mark.parametrize("mode", ["SERIAL", "ROWS", "LOCKSTEP"])
def test_the_step_is_the_same_however_the_batch_is_spread_over_threads(mode, monkeypatch):
    from gm_solver.backends.numba import lambert as lambert_kernel

    graph = _graph(9)
    ids = _contexts(graph, 9, 5, 4)
    ref = ContextReference(graph, ContextConfig(order_weights=(0.8, 0.2)))
    scores = 3 * torch.randn(5, 13, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    expected, info = ref.step(ids, scores)
    monkeypatch.setattr(lambert_kernel, "schedule", lambda rows: getattr(lambert_kernel, mode))
    logx, spread = ref.step(ids, scores)
    assert torch.equal(logx, expected) and torch.equal(spread.gap, info.gap)
