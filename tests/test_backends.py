"""gm_solver.backends: the one chooser and its one set of defaults, and every operation run by every backend on
every device here, checked against the numba kernels: reference rows and log x to 1e-10, certificates ≤ 1e-6.
The fused backend runs on the CPU traced by dynamo's ``eager`` compiler (inductor on CUDA, in test_fused)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_solver import ContextConfig, ContextReference, backends, graphmax, solve_toward
from gm_solver.backends import eager, fused
from gm_solver.backends import numba as numba_backend
from gm_solver.divergences import DIVERGENCES
from gm_solver.operator import TransitionOperator

from .helpers import DEVICES, GRID, random_graph, random_ngram_graph

CPU = torch.device("cpu")


@pytest.mark.parametrize(("device", "request_", "float64_only", "on", "expected"), [
    ("cpu", "auto", False, False, "numba"),
    ("cpu", "auto", False, True, "numba"),  # the CPU keeps its kernels, compiled steps on or not
    ("cpu", "auto", True, False, "torch"),  # a numba half that takes float64 alone, given float32
    ("cpu", "torch", False, False, "torch"),
    ("cpu", "numba", False, False, "numba"),
    ("cuda", "auto", False, False, "torch"),  # (fused_available is false here for every device but cuda)
    ("meta", "auto", False, True, "torch"),
    ("meta", "torch", False, False, "torch"),
])
def test_choose_picks_one_backend_from_the_device_the_dtype_and_the_request(device, request_, float64_only, on,
                                                                             expected, monkeypatch):
    monkeypatch.setattr(backends, "fused_available", lambda d: False)
    assert backends.choose(torch.device(device), request_, float64_only=float64_only, fused=on) == expected


def test_choose_takes_fused_where_it_compiles_and_the_caller_has_it_on(monkeypatch):
    monkeypatch.setattr(backends, "fused_available", lambda d: d.type == "cuda")
    cuda = torch.device("cuda")
    assert backends.choose(cuda, fused=True) == "fused" and backends.choose(cuda, fused=False) == "torch"
    assert backends.choose(cuda, "fused") == "fused"
    # a torch operator's steps (the paper decoder's): compiled once its switch is on, eager before
    assert backends.choose(cuda, "torch", fused=True) == "fused" and backends.choose(cuda, "torch") == "torch"
    # a step that reads values back is never the compiled one, even asked for by name
    for request in ("auto", "torch", "fused"):
        assert backends.choose(cuda, request, fused=True, reads_back=True) == "torch"
    # where nothing compiles, the switch changes nothing
    meta = torch.device("meta")
    assert backends.choose(meta, "torch", fused=True) == backends.choose(meta, fused=True) == "torch"


@pytest.mark.parametrize(("device", "request_", "float64_only", "message"), [
    ("cpu", "fast", False, "backend must be one of 'auto', 'numba', 'torch', 'fused', got 'fast'"),
    ("meta", "numba", False, "the numba backend runs on the CPU, the tensors are on meta; use backend='torch'"),
    ("cpu", "numba", True, "the numba kernel takes float64 CPU tensors; use backend='torch' for other dtypes"),
    ("cpu", "fused", False, "the fused backend compiles for a CUDA device with Triton, not cpu; use backend='torch'"),
])
def test_choose_refuses_a_backend_that_cannot_run_in_one_line(device, request_, float64_only, message):
    with pytest.raises(ValueError) as e:
        backends.choose(torch.device(device), request_, float64_only=float64_only)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_defaults_are_one_table_read_by_every_solve():
    cpu, gpu = backends.defaults(CPU), backends.defaults(torch.device("meta"))
    assert (cpu.nu_steps, cpu.check_every, cpu.mirror_check_every) == (60, 1, 1)
    assert (gpu.nu_steps, gpu.check_every, gpu.mirror_check_every) == (8, 0, 8)
    # every room implements every operation
    names = {"reference_rows", "solve_rows", "context_step", "csr_layout", "csr_product", "mirror_start",
             "mirror_score", "mirror_step"}
    for name in backends.BACKENDS:
        assert names <= set(dir(backends.room(name))), name


def _problem(seed: int, rows: int, width: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed)
    z = 4 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    z[0, 1] = -torch.inf
    q = torch.rand(rows, width, generator=gen, dtype=torch.float64) * (torch.rand(rows, width, generator=gen) < 0.4)
    lam = 0.1 + 3 * torch.rand(rows, generator=gen, dtype=torch.float64)
    return z.to(device), q.to(device), lam.to(device)


def _close_logs(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    """log x of two backends: −inf at the same tokens, within ``atol`` elsewhere."""
    a, b = a.cpu(), b.cpu()
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    torch.testing.assert_close(torch.where(torch.isinf(a), 0.0, a), torch.where(torch.isinf(b), 0.0, b),
                               atol=atol, rtol=0)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(DIVERGENCES), st.sampled_from([0.0, 0.15, 1.0]),
       st.sampled_from(DEVICES))
def test_solve_rows_of_every_backend_matches_the_numba_kernel(seed, divergence, share, device):
    z, q, lam = _problem(seed, 4, 57, device)
    share = 1.0 if divergence == "kl" else share  # (as solve_toward passes it on)
    want, want_info = numba_backend.solve_rows(divergence, z.cpu(), q.cpu(), lam.cpu(), share, tol=1e-6,
                                               max_iter=60)
    for check_every in (1, 0):  # stopped at the certificate, and a fixed budget with nothing read back
        got, info = eager.solve_rows(divergence, z, q, lam, share, tol=1e-6, max_iter=60, check_every=check_every)
        _close_logs(got, want, 1e-10)
        assert bool((info.gap <= 1e-6).all()) and bool((want_info.gap <= 1e-6).all())


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["kneser-ney", "dirichlet"]), st.booleans(),
       st.sampled_from(DEVICES))
def test_reference_rows_of_every_backend_match_the_numba_kernel(seed, smoothing, knn, device):
    ref = ContextReference(random_ngram_graph(seed % 7), ContextConfig(smoothing=smoothing, order_weights=(1.0, 0.3)))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ref.n + 2, (3, 6), generator=gen)  # ids past the graph, as a padded head gives
    near = None
    if knn:
        w = torch.rand(3, 4, generator=gen, dtype=torch.float64)
        near = (torch.randint(0, ref.n + 2, (3, 4), generator=gen), w / w.sum(1, keepdim=True), 0.3)
    want = numba_backend.reference_rows(ref, ids, ref.n + 2, near)
    got = eager.reference_rows(ref, ids.to(device), ref.n + 2, None if near is None else
                               (near[0].to(device), near[1].to(device), near[2]))
    torch.testing.assert_close(got.cpu(), want, atol=1e-10, rtol=0)


_REFERENCES: dict[int, ContextReference] = {}


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0, 1]))
def test_the_context_step_of_every_backend_matches_the_numba_kernel(seed, index):
    configs = [ContextConfig(), ContextConfig(divergence="l2", lam=0.7, kl_share=0.3)]
    # one reference per configuration: the fused step's trace is guarded on it
    ref = _REFERENCES.setdefault(index, ContextReference(random_ngram_graph(index), configs[index]))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ref.n, (3, 6), generator=gen)
    scores = 3 * torch.randn(3, ref.n + 1, generator=gen, dtype=torch.float64)
    lam = torch.full((3,), ref.config.lam, dtype=torch.float64)
    share = ref.config.kl_share
    want, want_info = numba_backend.context_step(ref, ids, scores, lam, share, tol=1e-6, max_iter=60)
    got = {"torch": eager.context_step(ref, ids, scores, lam, share, tol=1e-6, max_iter=60, check_every=1),
           "fused": fused.context_step(ref, ids, scores, lam, share, tol=1e-6, max_iter=12, backend="eager",
                                       fullgraph=True)}
    for name, (logx, info) in got.items():
        _close_logs(logx, want, 1e-10)
        assert bool((info.gap <= 1e-6).all()), name
    assert bool((want_info.gap <= 1e-6).all())


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.booleans(), st.sampled_from(DEVICES))
def test_csr_products_of_every_backend_match_the_numba_kernel(seed, some_rows, device):
    m = random_graph(37, 0.2, seed)
    rng = np.random.default_rng(seed)
    v = torch.from_numpy(rng.random((5, 40)))
    base = torch.from_numpy(rng.random((5, 40)))
    rows = torch.tensor([0, 3]) if some_rows else None
    want = numba_backend.csr_product(numba_backend.csr_layout(m, CPU), v, base, True, rows)
    layout = eager.csr_layout(sp.csr_matrix(m), device)
    got = eager.csr_product(layout, v.to(device), base.to(device), True, None if rows is None else rows.to(device))
    torch.testing.assert_close(got.cpu(), want, atol=1e-12, rtol=0)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([0.3, 1.0, 4.0]), st.sampled_from(DEVICES))
def test_the_mirror_descent_of_every_backend_is_certified_as_the_numba_kernels(seed, lam, device):
    m = random_graph(30, 0.2, seed)
    z = torch.from_numpy(3 * np.random.default_rng(seed).standard_normal((3, 32)))
    want, want_info = graphmax(z, m, lam, return_info=True)  # numba, the CPU's
    assert want_info.backend == "numba"
    for name in ("torch", "fused"):
        op = TransitionOperator(m, device=device, backend="torch")
        op.use_fused = name == "fused" and device.type == "cuda"
        got, info = graphmax(z.to(device), op, lam, return_info=True)
        assert bool((info.gap <= 1e-6).all()) and bool((want_info.gap <= 1e-6).all())
        # two certified points of one strongly convex problem: each within the certificate of the optimum
        torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=0)


def test_solve_toward_reports_the_backend_it_took():
    z, q, lam = _problem(1, 2, 9, CPU)
    assert solve_toward(z, q, lam)[1].backend == "numba"
    assert solve_toward(z, q, lam, backend="torch")[1].backend == "torch"
    assert solve_toward(z.float(), q.float(), lam)[1].backend == "torch"


def test_a_device_named_without_its_index_is_the_current_one(monkeypatch):
    # an operator or a reference's tables kept for "cuda" are found again from a tensor's cuda:N
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert backends.canonical("cuda") == torch.device("cuda", 3)
    assert backends.canonical(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert backends.canonical("cpu") == CPU


@pytest.mark.parametrize(("dtype", "device"), GRID)
def test_every_solve_keeps_its_inputs_dtype_and_device_and_agrees_with_the_kernels(dtype, device):
    # solve_toward, the context step and graphmax promise any device and dtype: each on the grid against the numba
    # kernels' float64 answer, rounded to the dtype's precision
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    z, q, lam = _problem(3, 3, 41, CPU)
    want, _ = solve_toward(z, q, lam, divergence="l2", kl_share=0.2)
    got, info = solve_toward(z.to(device, dtype), q.to(device, dtype), lam.to(device), divergence="l2",
                             kl_share=0.2)
    assert got.dtype == dtype and got.device == device and info.backend in ("numba", "torch")
    torch.testing.assert_close(got.exp().cpu().double(), want.exp(), atol=tol, rtol=0)

    ref = ContextReference(random_ngram_graph(1), ContextConfig())
    ids = torch.randint(0, ref.n, (2, 5), generator=torch.Generator().manual_seed(1))
    scores = 3 * torch.randn(2, ref.n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want, _ = ref.step(ids, scores, backend="numba")
    got, _ = ref.step(ids.to(device), scores.to(device, dtype))
    assert got.dtype == dtype and got.device == device
    torch.testing.assert_close(got.exp().cpu().double(), want.exp(), atol=tol if dtype == torch.float64 else 1e-6,
                               rtol=0)

    m = random_graph(30, 0.2, 5)
    want = graphmax(z[:, :30], m, 1.0)
    got = graphmax(z[:, :30].to(device, dtype), m, 1.0)
    assert got.dtype == dtype and got.device == device
    # two certified points of one problem (numba's and, off the CPU, torch's): each within its certificate
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-3, rtol=0)
