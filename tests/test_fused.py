"""The context decoders' compiled step (gm_solver.fused): one graph with no break, the eager torch path's numbers,
certified as the numba kernel's, the path taken said, and the eager path kept when compiling fails. On the CPU it
is traced with torch.compile's ``aot_eager`` backend; the CUDA tests compile it with inductor."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_graphs.count.ngrams import NgramCounts
from gm_solver import ContextGraphmaxLogitsProcessor
from gm_solver.context import ContextConfig, ContextReference
from gm_solver.fused import FusedStep, context_step

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
# the configurations the fused step traces whole (order weights beyond the first read a sparse Ãᵏ: eager there)
TRACED = [ContextConfig(), ContextConfig(divergence="l2", lam=0.7, kl_share=0.3), ContextConfig(divergence="kl"),
          ContextConfig(smoothing="dirichlet", ngram_order=3, lam=2.0)]


def _counts(seed: int, n: int = 40):
    """(bigram counts, 3- and 4-gram tables) drawn at random, a row with no successor among them."""
    rng = np.random.default_rng(seed)
    dense = rng.integers(0, 6, size=(n, n)) * (rng.random((n, n)) < 0.3)
    dense[3] = 0
    tables = {}
    for order in (3, 4):
        keys = np.unique(rng.integers(0, n ** order, size=200))
        tables[order] = NgramCounts.from_keys(order, keys, rng.integers(1, 5, size=keys.size), n)
    graph = type("Graph", (), {})()
    graph.counts, graph.ngrams = sp.csr_matrix(dense), tables
    return graph


def _inputs(seed: int, n: int, rows: int, width: int, knn: bool):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, n + 2, (rows, 6), generator=gen)  # ids past the graph, as a padded head gives
    scores = 3 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    scores[0, 1] = -torch.inf
    near = None
    if knn:
        weights = torch.rand(rows, 5, generator=gen, dtype=torch.float64)
        near = (torch.randint(0, width, (rows, 5), generator=gen), weights / weights.sum(1, keepdim=True), 0.4)
    return ids, scores, near


_TRACED_STEPS: dict = {}


def _traced(index: int, knn: bool):
    """(reference, its step traced whole by aot_eager): one per configuration and kNN use, for every example (a
    trace takes seconds; the examples vary the values, which no trace depends on)."""
    if (index, knn) not in _TRACED_STEPS:
        ref = ContextReference(_counts(index), TRACED[index])
        ref.on(torch.device("cpu"))
        # dynamo's own backend: the graph breaks are dynamo's to find, and it traces in a second or two
        _TRACED_STEPS[index, knn] = ref, FusedStep(ref, backend="eager", fullgraph=True).compiled
    return _TRACED_STEPS[index, knn]


@settings(max_examples=12)  # the traces are shared, but each new (configuration, kNN) is one
@given(st.integers(0, 10_000), st.integers(0, len(TRACED) - 1), st.booleans())
def test_the_step_traces_as_one_graph_and_gives_the_eager_paths_numbers(seed, index, knn):
    rows = 3
    ref, traced = _traced(index, knn)
    ids, scores, near = _inputs(seed, ref.n, rows, ref.n + 3, knn)
    lam = torch.full((rows,), ref.config.lam, dtype=torch.float64)
    ctx = ids[:, -ref.tail:]
    fused = traced(ref, ctx, scores, lam, near, 12)
    eager = context_step(ref, ctx, scores, lam, near, 12)
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    kernel, info = ref.step(ids, scores, knn=near, backend="numba")  # the reference: the CPU kernel
    torch.testing.assert_close(fused[0].exp(), kernel.exp(), atol=1e-10, rtol=0)
    assert bool((fused[2] <= 1e-6).all()) and bool((info.gap <= 1e-6).all())


def test_aot_autograd_traces_the_step_whole_as_inductor_will():
    ref = ContextReference(_counts(2), ContextConfig())
    ids, scores, near = _inputs(2, ref.n, 3, ref.n, True)
    lam = torch.full((3,), 1.2, dtype=torch.float64)
    ref.on(ids.device)
    args = (ref, ids[:, -ref.tail:], scores, lam, near, 8)
    traced = FusedStep(ref, backend="aot_eager", fullgraph=True).compiled(*args)
    for a, b in zip(traced, context_step(*args)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_reference_takes_the_fused_step_where_it_has_one_and_says_so():
    ref = ContextReference(_counts(3), ContextConfig())
    ids, scores, _ = _inputs(3, ref.n, 4, ref.n, False)
    eager, eager_info = ref.step(ids, scores, backend="torch", check_every=0)
    assert ref.backend == "torch"
    ref.use_fused = True
    ref._fused_steps["cpu"] = FusedStep(ref, backend="eager", fullgraph=True)
    logx, info = ref.step(ids, scores, backend="torch", check_every=0)
    assert ref.backend == "fused"
    torch.testing.assert_close(logx, eager, atol=0, rtol=0)
    torch.testing.assert_close(info.gap, eager_info.gap, atol=0, rtol=0)
    ref.step(ids[:, :2], scores, backend="torch", check_every=0)  # a context shorter than the tail: eager
    assert ref.backend == "torch"
    ref.step(ids, scores)  # the CPU's default: the numba kernel, whatever is compiled
    assert ref.backend == "numba"


def test_a_step_that_fails_to_compile_falls_back_to_the_eager_path():
    def broken(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    ref = ContextReference(_counts(5), ContextConfig())
    ids, scores, _ = _inputs(5, ref.n, 2, ref.n, False)
    expected, _ = ref.step(ids, scores, backend="torch", check_every=0)
    ref.use_fused = True
    ref._fused_steps["cpu"] = step = FusedStep(ref, backend=broken)
    logx, _ = ref.step(ids, scores, backend="torch", check_every=0)
    assert ref.backend == "torch" and "no compiler here" in step.failed
    torch.testing.assert_close(logx, expected, atol=0, rtol=0)
    ref.step(ids, scores, backend="torch", check_every=0)
    assert ref.backend == "torch"  # not tried again


@CUDA
@pytest.mark.parametrize("cfg", TRACED[:2])  # each configuration is a compile of tens of seconds
def test_the_compiled_step_on_cuda_equals_the_numba_kernel(cfg):
    settings = {k: v for k, v in cfg.to_dict().items() if k != "source"}
    proc = ContextGraphmaxLogitsProcessor(_counts(11), **settings).warmup("cuda")
    assert proc.warmup_seconds > 0 and proc.backend == "fused"
    for dtype in (torch.float32, torch.bfloat16):  # one compile serves both, and every batch size
        for rows in (1, 3, 8):
            ids, scores, _ = _inputs(rows, proc.reference.n, rows, proc.reference.n + 2, False)
            cpu = proc(ids, scores.to(dtype))
            assert proc.backend == "numba"
            gpu = proc(ids.cuda(), scores.to(dtype).cuda())
            assert proc.backend == "fused" and gpu.dtype == dtype and bool((proc.last_info.gap <= 1e-6).all())
            torch.testing.assert_close(gpu.double().exp().cpu(), cpu.double().exp(), rtol=0,
                                       atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
