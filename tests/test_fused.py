"""The fused backend (gm_solver.backends.fused): the context step and the mirror step each traced without a graph
break, the torch backend's numbers, certified as the numba kernels', the backend taken said, and the torch backend
kept when compiling fails. On the CPU they are traced with torch.compile's ``eager`` and ``aot_eager`` backends; the
CUDA tests compile them with inductor."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_solver import (
    ContextConfig,
    ContextGraphmaxLogitsProcessor,
    ContextReference,
    PaperGraphmaxLogitsProcessor,
    graphmax,
)
from gm_solver.backends import DEFAULTS, eager, fused
from gm_solver.operator import TransitionOperator

from .helpers import random_ngram_graph

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
# the configurations the fused step traces whole (order weights beyond the first read a sparse Ãᵏ: eager there)
TRACED = [ContextConfig(), ContextConfig(divergence="l2", lam=0.7, kl_share=0.3), ContextConfig(divergence="kl"),
          ContextConfig(smoothing="dirichlet", ngram_order=3, lam=2.0)]


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


# the ν steps of the compiled context steps here: the budget the fused step runs with on a GPU, where it is taken
# (``backends.DEFAULTS``), not the CPU's 60, which dynamo would unroll into a trace several times as long. The rows
# here converge within 3 steps and are frozen from then on, so the budget changes no number the tests compare
NU_STEPS = DEFAULTS["device"].nu_steps

# one reference per configuration for every example: dynamo guards on the reference, so a new one is a new trace
_REFERENCES: dict[int, ContextReference] = {}


def _lam(ref: ContextReference, rows: int) -> torch.Tensor:
    return torch.full((rows,), ref.config.lam, dtype=torch.float64)


@settings(max_examples=12, deadline=None)  # dynamo's traces are cached by code and configuration, not by example
# each configuration once, two of them with a kNN distribution mixed in: a trace of seconds each
@given(st.integers(0, 10_000), st.sampled_from([(0, True), (1, False), (2, False), (3, True)]))
def test_the_context_step_traces_as_one_graph_and_gives_the_torch_backends_numbers(seed, case):
    index, knn = case
    rows = 3
    ref = _REFERENCES.setdefault(index, ContextReference(random_ngram_graph(index), TRACED[index]))
    ids, scores, near = _inputs(seed, ref.n, rows, ref.n + 3, knn)
    share = 1.0 if ref.config.divergence == "kl" else ref.config.kl_share
    # dynamo's own backend: the graph breaks are dynamo's to find, and it traces in a second or two
    traced, info = fused.context_step(ref, ids, scores, _lam(ref, rows), share, tol=1e-6, max_iter=NU_STEPS,
                                      knn=near, backend="eager", fullgraph=True)
    plain, plain_info = eager.context_step(ref, ids, scores, _lam(ref, rows), share, tol=1e-6, max_iter=NU_STEPS,
                                           check_every=0, knn=near)
    torch.testing.assert_close(traced, plain, atol=0, rtol=0)
    torch.testing.assert_close(info.gap, plain_info.gap, atol=0, rtol=0)
    kernel, kernel_info = ref.step(ids, scores, knn=near, backend="numba")  # the reference: the CPU kernel
    torch.testing.assert_close(traced.exp(), kernel.exp(), atol=1e-10, rtol=0)
    assert bool((info.gap <= 1e-6).all()) and bool((kernel_info.gap <= 1e-6).all())


def test_aot_autograd_traces_the_context_step_whole_as_inductor_will():
    ref = ContextReference(random_ngram_graph(2), ContextConfig())
    ids, scores, near = _inputs(2, ref.n, 3, ref.n, True)
    args = (ref, ids, scores, _lam(ref, 3), ref.config.kl_share)
    traced, _ = fused.context_step(*args, tol=1e-6, max_iter=8, knn=near, backend="aot_eager", fullgraph=True)
    plain, _ = eager.context_step(*args, tol=1e-6, max_iter=8, check_every=0, knn=near)
    torch.testing.assert_close(traced, plain, atol=0, rtol=0)


def _paper_state(seed: int, rows: int = 3):
    rng = np.random.default_rng(seed)
    m = sp.random(30, 30, density=0.2, random_state=rng, format="csr")
    m = sp.csr_matrix(m / np.maximum(m.sum(1), 1e-12))
    op = TransitionOperator(m, backend="torch")
    z = torch.from_numpy(3 * rng.standard_normal((rows, 32)))
    z[0, 5] = -torch.inf
    return op, z


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_the_mirror_steps_pieces_trace_as_one_graph_each_and_give_the_torch_backends_numbers(compiler):
    op, z = _paper_state(4)
    valid = torch.isfinite(z)
    diag = op.gram_diagonal(z.shape[-1], z.dtype)
    s, x = eager.mirror_start(z, valid, diag, 1.0)
    lx, gram = op.residual_and_gram(x)
    f, g, ly = eager.mirror_score(z, valid, s, x, lx, gram, 1.0)
    state = [s, x, lx, gram, ly, f, g, torch.zeros_like(f), torch.zeros(3, dtype=torch.long)]
    for _ in range(3):
        traced = fused.mirror_step(z, valid, diag, *state, op, 1.0, 1e-6, backend=compiler)
        plain = eager.mirror_step(z, valid, diag, *state, op, 1.0, 1e-6)
        for a, b in zip(traced, plain):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        state = list(plain)
    assert str(z.device) not in fused.failures


def _compile_with(monkeypatch, compiler):
    """The fused backend on the CPU, compiled by ``compiler``, with a record of its failures of its own."""
    monkeypatch.setattr("gm_solver.backends.fused_available", lambda device: True)
    monkeypatch.setattr(fused, "failures", {})
    make = fused.compiled.__wrapped__  # the backend's own maker, with this test's compiler
    monkeypatch.setattr(fused, "compiled", functools.cache(lambda function, **kw: make(function, backend=compiler)))


def test_the_decoders_take_the_fused_backend_once_on_and_say_so(monkeypatch):
    _compile_with(monkeypatch, "eager")
    ref = ContextReference(random_ngram_graph(3), ContextConfig())
    ids, scores, _ = _inputs(3, ref.n, 4, ref.n, False)
    plain, plain_info = ref.step(ids, scores, backend="torch", check_every=0, max_iter=NU_STEPS)
    assert ref.backend == plain_info.backend == "torch"
    logx, info = ref.step(ids, scores, backend="fused", check_every=0, max_iter=NU_STEPS)
    assert ref.backend == info.backend == "fused"
    torch.testing.assert_close(logx, plain, atol=0, rtol=0)
    torch.testing.assert_close(info.gap, plain_info.gap, atol=0, rtol=0)
    # a context shorter than the tail is filled to it (ContextReference.contexts): the same traced step
    short, _ = ref.step(ids[:, :2], scores, backend="fused", check_every=0, max_iter=NU_STEPS)
    assert ref.backend == "fused"
    torch.testing.assert_close(short, ref.step(ids[:, :2], scores, backend="torch", check_every=0,
                                               max_iter=NU_STEPS)[0], atol=0, rtol=0)
    ref.step(ids, scores, backend="fused", check_every=1)  # a step that reads back is not the compiled one
    assert ref.backend == "torch"
    ref.use_fused = True
    ref.step(ids, scores)  # the CPU's default is the numba kernel, whatever is on
    assert ref.backend == "numba"

    op, z = _paper_state(6)
    _, plain_info = graphmax(z, op.__dict__["_matrix"], 1.0, return_info=True)  # the CPU's default: numba
    assert plain_info.backend == "numba"
    _, info = graphmax(z, op, 1.0, return_info=True)  # an operator built for torch, not yet on
    assert info.backend == "torch"
    op.use_fused = True
    _, info = graphmax(z, op, 1.0, return_info=True)
    assert info.backend == "fused"


def test_the_paper_decoder_takes_the_fused_mirror_steps_once_on(monkeypatch):
    _compile_with(monkeypatch, "eager")
    op, z = _paper_state(7)
    proc = PaperGraphmaxLogitsProcessor(op.__dict__["_matrix"], device="cpu")
    proc.operator = TransitionOperator(op.__dict__["_matrix"], backend="torch")
    # "auto" waits for a warm-up on a GPU to turn the compiled steps on; an operator asked for "torch" by name starts
    # with them off, until they are turned on by hand (the switch backends.choose reads, as the context decoder's)
    assert TransitionOperator(op.__dict__["_matrix"]).use_fused is None and proc.operator.use_fused is False
    plain = proc(None, z)
    assert proc.backend == "torch"
    proc.operator.use_fused = True
    compiled = proc(None, z)
    assert proc.backend == "fused" and bool(proc.last_info.converged.all())
    torch.testing.assert_close(compiled, plain, atol=0, rtol=0)


def test_a_step_that_fails_to_compile_falls_back_to_the_torch_backend(monkeypatch):
    def broken(graph_module, example_inputs):
        raise RuntimeError("no compiler here")

    _compile_with(monkeypatch, broken)
    ref = ContextReference(random_ngram_graph(5), ContextConfig())
    ids, scores, _ = _inputs(5, ref.n, 2, ref.n, False)
    expected, _ = ref.step(ids, scores, backend="torch", check_every=0, max_iter=NU_STEPS)
    ref.use_fused = True
    logx, _ = ref.step(ids, scores, backend="fused", check_every=0, max_iter=NU_STEPS)
    assert ref.backend == "torch" and "no compiler here" in fused.failures["cpu"]
    torch.testing.assert_close(logx, expected, atol=0, rtol=0)
    ref.step(ids, scores, backend="fused", check_every=0, max_iter=NU_STEPS)
    assert ref.backend == "torch"  # not tried again


@CUDA
def test_the_compiled_context_step_on_cuda_equals_the_numba_kernel():
    # one configuration: each is a compile of tens of seconds
    proc = ContextGraphmaxLogitsProcessor(random_ngram_graph(11)).warmup("cuda")
    assert proc.warmup_seconds > 0
    for dtype in (torch.float32, torch.bfloat16):  # one compile serves both, and every batch size
        for rows in (1, 3, 8):
            ids, scores, _ = _inputs(rows, proc.reference.n, rows, proc.reference.n + 2, False)
            cpu = proc(ids, scores.to(dtype))
            assert proc.backend == "numba"
            gpu = proc(ids.cuda(), scores.to(dtype).cuda())
            assert proc.backend == "fused" and gpu.dtype == dtype and bool((proc.last_info.gap <= 1e-6).all())
            torch.testing.assert_close(gpu.double().exp().cpu(), cpu.double().exp(), rtol=0,
                                       atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@CUDA
def test_the_compiled_mirror_steps_on_cuda_are_certified_as_the_numba_kernels():
    op, _ = _paper_state(12)
    proc = PaperGraphmaxLogitsProcessor(op.__dict__["_matrix"]).warmup("cuda")
    for rows in (1, 3, 8):
        z = torch.from_numpy(3 * np.random.default_rng(rows).standard_normal((rows, 32)))
        cpu = proc(None, z)
        assert proc.backend == "numba"
        gpu = proc(None, z.cuda())
        assert proc.backend == "fused" and bool((proc.last_info.gap <= 1e-6).all())
        torch.testing.assert_close(gpu.exp().cpu(), cpu.exp(), rtol=0, atol=2e-3)


@CUDA
@pytest.mark.parametrize("path", ["torch", "fused"])
def test_the_context_step_can_be_captured_in_a_cuda_graph(path):
    ref = ContextReference(random_ngram_graph(13), ContextConfig())
    ids, scores, _ = _inputs(13, ref.n, 4, ref.n, False)
    ids, scores = ids.cuda(), scores.cuda()
    lam = torch.full((4,), 1.2, dtype=torch.float64, device="cuda")

    def step():
        if path == "fused":
            return fused.context_step(ref, ids, scores, lam, 0.15, tol=1e-6, max_iter=8)[0]
        return eager.context_step(ref, ids, scores, lam, 0.15, tol=1e-6, max_iter=8, check_every=0)[0]

    want = step()  # the tables' copy to the device, and the compile, before the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises if the step copies from the host or synchronises
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, atol=0, rtol=0)
