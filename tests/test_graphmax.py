"""graphmax and log_graphmax (gm_solver.distribution): the certificate, the KKT fixed point, an independent dual solve,
edge cases, the real graph, and every dtype and device."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize
import scipy.sparse as sp
import torch
from hypothesis import given
from hypothesis import strategies as st

from gm_solver import certificate, graphmax, log_graphmax
from gm_solver.distribution import Graphmax
from gm_solver.objective import dual, primal
from gm_solver.operator import TransitionOperator

from .helpers import GRID, dense_l, random_counts, random_graph

LAMS = [0.1, 1.0, 10.0]


def dual_solve(z: np.ndarray, L: np.ndarray, lam: float) -> np.ndarray:
    """Independent solve: maximise g(u) with L-BFGS; x* = softmax(z − Lᵀu*)."""
    def neg_g(u):
        y = z - L.T @ u
        m = y.max()
        e = np.exp(y - m)
        lse = m + np.log(e.sum())
        x = e / e.sum()
        return lse + u @ u / (4 * lam), -(L @ x) + u / (2 * lam)
    res = scipy.optimize.minimize(neg_g, np.zeros(len(z)), jac=True, method="L-BFGS-B",
                                  options={"gtol": 1e-12, "ftol": 1e-15, "maxiter": 10_000})
    y = z - L.T @ res.x
    return np.exp(y - y.max()) / np.exp(y - y.max()).sum()


@given(n=st.integers(2, 25), density=st.floats(0.05, 0.6), seed=st.integers(0, 10_000),
       lam=st.sampled_from(LAMS), scale=st.floats(0.1, 8.0))
def test_certificate_kkt_and_independent_dual_solve(n, density, seed, lam, scale):
    a = random_graph(n, density, seed)
    z = torch.from_numpy(np.random.default_rng(seed).normal(size=n) * scale)
    x, info = graphmax(z, a, lam, return_info=True)
    assert float(info.gap) <= 1e-6 and bool(info.converged)
    op = TransitionOperator(a)
    assert float(certificate(x[None], z[None], lam, op)) <= 1e-6
    # the general dual at u = 2λLx agrees with the closed-form gap
    lx = x[None] - op.matvec(x[None])
    f_minus_g = primal(x[None], z[None], lx, lam) - dual(2 * lam * lx, z[None], lam, op)
    assert abs(float(f_minus_g) - float(info.gap)) < 1e-9
    # KKT: x = softmax(z − 2λLᵀLx)
    L = dense_l(a, n)
    fixed = torch.softmax(z - 2 * lam * torch.from_numpy(L.T @ L @ x.numpy()), -1)
    assert torch.allclose(x, fixed, atol=2e-3 * max(1.0, lam) ** 0.5)
    expected = dual_solve(z.numpy(), L, lam)
    np.testing.assert_allclose(x.numpy(), expected, atol=3e-3)


def _scores(draw_rows, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of scores with -inf entries (each row keeps one finite score), from hypothesis' lists of floats."""
    z = torch.tensor(draw_rows, dtype=torch.float64)[:, :width]
    z[:, -1] = z[:, -1].nan_to_num(neginf=0.0)
    return z.to(dtype)


SCORE_ROWS = st.lists(st.lists(st.one_of(st.floats(-60, 60), st.just(-np.inf)), min_size=24, max_size=24),
                      min_size=1, max_size=3)


@given(rows=SCORE_ROWS, width=st.integers(20, 24), dtype=st.sampled_from([torch.float32, torch.float64]),
       solver=st.sampled_from(["mirror", "paper"]), backend=st.sampled_from(["numba", "torch"]))
def test_lambda_zero_is_softmax_computed_in_the_working_dtype(rows, width, dtype, solver, backend):
    # no regulariser: the exact solution is softmax(z), computed in float64 and rounded once to the logits' dtype,
    # as every solution is (float32's own log-sum-exp is 1e-5 off on a large vocabulary, by an amount that varies
    # with the CPU); a row alone or in a batch, on either backend, with either solver, and whatever the padding
    z = _scores(rows, width, dtype)
    graph = random_graph(20, 0.2, 0)
    logp, info = log_graphmax(z, graph, 0.0, solver=solver, backend=backend, return_info=True)
    want = torch.log_softmax(z.double(), -1).to(dtype)
    assert logp.dtype == dtype and torch.equal(logp, want)
    x = graphmax(z, graph, 0.0, solver=solver, backend=backend)
    assert torch.equal(x, torch.log_softmax(z.double(), -1).exp().to(dtype))
    # softmax to rounding: a log's absolute error, eps·|z_i − max z| ≤ 120·eps here, is p_i's relative error (below
    # the smallest normal number, p_i's rounding is absolute)
    finfo = torch.finfo(dtype)
    torch.testing.assert_close(x, torch.softmax(z, -1), rtol=256 * finfo.eps, atol=finfo.tiny)
    assert info.iterations.tolist() == [0] * z.shape[0] and info.gap.tolist() == [0.0] * z.shape[0]
    assert bool(info.converged.all()) and info.operator_applications == 0
    assert torch.equal(log_graphmax(z[-1], graph, 0.0), want[-1])


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_at_lambda_zero_a_gradient_flows_on_either_backend(backend):
    # no kernel runs at λ = 0, so the numba backend's result keeps the logits' graph too: d log softmax
    z = torch.randn(2, 20, dtype=torch.float64, requires_grad=True)
    log_graphmax(z, random_graph(20, 0.2, 0), 0.0, backend=backend)[:, 3].sum().backward()
    want = torch.eye(20, dtype=torch.float64)[3] - torch.softmax(z.detach(), -1)
    torch.testing.assert_close(z.grad, want)


@given(shift=st.floats(-50, 50), seed=st.integers(0, 1000))
def test_invariant_to_adding_a_constant_to_the_logits(shift, seed):
    a = random_graph(15, 0.3, seed)
    z = torch.randn(15, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(graphmax(z, a, 1.0), graphmax(z + shift, a, 1.0), atol=1e-6, rtol=0)


def test_minus_inf_logits_get_exactly_zero_and_are_excluded():
    a = random_graph(12, 0.4, 3)
    z = torch.randn(12, dtype=torch.float64)
    z[[2, 7]] = -torch.inf
    x, info = graphmax(z, a, 1.0, return_info=True)
    assert x[2] == 0 and x[7] == 0 and float(info.gap) <= 1e-6
    assert torch.isneginf(log_graphmax(z, a, 1.0)[[2, 7]]).all()
    keep = [i for i in range(12) if i not in (2, 7)]
    assert abs(float(x[keep].sum()) - 1) < 1e-12


@pytest.mark.parametrize("bad,error", [
    (lambda z: z.index_fill(0, torch.tensor([1]), float("nan")), "NaN"),
    (lambda z: torch.full_like(z, -torch.inf), "entirely -inf"),
    (lambda z: z.index_fill(0, torch.tensor([1]), float("inf")), r"\+inf"),
])
def test_bad_logits_are_refused(bad, error):
    with pytest.raises(ValueError, match=error):
        graphmax(bad(torch.randn(10, dtype=torch.float64)), random_graph(10, 0.3, 0), 1.0)


@pytest.mark.parametrize("lam", [-1.0, float("inf"), float("nan"), torch.tensor(1.0)])
@pytest.mark.parametrize("call", [lambda z, a, lam: graphmax(z, a, lam), lambda z, a, lam: log_graphmax(z, a, lam),
                                  lambda z, a, lam: Graphmax(a, lam)])
def test_a_lambda_that_is_not_a_finite_float_at_least_zero_is_refused(call, lam):
    with pytest.raises(ValueError, match="lam must be a finite float >= 0"):
        call(torch.randn(10), random_graph(10, 0.3, 0), lam)


def test_narrow_logits_are_refused():
    a = random_graph(10, 0.3, 0)
    with pytest.raises(ValueError, match="graph has 10 nodes"):
        graphmax(torch.randn(8), a, 1.0)


def test_wider_logits_treat_extra_ids_as_isolated_nodes():
    a = random_graph(10, 0.3, 1)
    z = torch.randn(16, dtype=torch.float64)
    padded = sp.csr_matrix((a.data, a.indices, np.r_[a.indptr, np.full(6, a.indptr[-1])]), shape=(16, 16))
    torch.testing.assert_close(graphmax(z, a, 1.0), graphmax(z, padded, 1.0), atol=1e-7, rtol=0)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_scores_that_require_grad_are_decoded_as_the_context_decoders_do(backend):
    from gm_solver import ContextConfig, ContextReference, PaperAlgorithm1LogitsProcessor, PaperGraphmaxLogitsProcessor

    a = random_graph(12, 0.3, 2)
    z = torch.randn(2, 12, requires_grad=True)
    plain = z.detach().clone()
    ids = torch.tensor([[1, 2], [3, 4]])
    context = ContextReference(random_counts(12, 2), ContextConfig(lam=1.0))
    for solver in ("mirror", "paper"):
        x = graphmax(z, a, 1.0, solver=solver, backend=backend)
        torch.testing.assert_close(x, graphmax(plain, a, 1.0, solver=solver, backend=backend))
    op = TransitionOperator(a, backend=backend)
    for cls in (PaperGraphmaxLogitsProcessor, PaperAlgorithm1LogitsProcessor):
        out = cls(op, lam=1.0)(ids, z)
        torch.testing.assert_close(out, cls(op, lam=1.0)(ids, plain))
        # a gradient flows exactly where the context decoder's on the same backend does
        assert out.requires_grad == context.step(ids, z, backend=backend)[0].requires_grad


def test_batch_equals_rows_and_dtype_is_kept():
    a = random_graph(30, 0.2, 4)
    z = torch.randn(5, 30) * 3
    batch = graphmax(z, a, 1.0)
    assert batch.dtype == torch.float32
    rows = torch.stack([graphmax(r, a, 1.0) for r in z])
    torch.testing.assert_close(batch, rows, atol=1e-6, rtol=0)


def test_check_every_zero_never_reads_a_value_back_to_the_host(monkeypatch):
    a = random_graph(30, 0.2, 7)
    z = torch.randn(4, 30, dtype=torch.float64) * 3
    expected = graphmax(z, a, 1.0)

    def refuse(*args, **kwargs):
        raise AssertionError("a host synchronisation on a GPU")

    for name in ("__bool__", "item", "tolist", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)
    x, info = graphmax(z, a, 1.0, backend="torch", check_every=0, max_iter=80, return_info=True)
    monkeypatch.undo()
    assert info.converged.all()
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="NaN"):  # the input checks still run, asserted on the device
        graphmax(torch.full((1, 30), float("nan")), a, 1.0, check_every=0)


@pytest.mark.slow
@pytest.mark.parametrize("lam", LAMS)
def test_real_graph_and_real_logits(drug_graph, smollm2, lam):
    model, tok = smollm2
    ids = tok("I have been taking this medication for two weeks and", return_tensors="pt").input_ids
    with torch.no_grad():
        z = model(ids).logits[0, -4:]
    x, info = graphmax(z, drug_graph, lam, return_info=True)
    assert (info.gap <= 1e-6).all()
    op = TransitionOperator(drug_graph)
    assert (certificate(x.double(), z.double(), lam, op) <= 2e-6).all()  # x was rounded to float32


@pytest.mark.parametrize("dtype, device", GRID)
@pytest.mark.parametrize("check_every", [None, 0])
def test_cuda_agrees_with_cpu(dtype, device, check_every):
    """Any dtype on any device (CUDA where there is one) agrees with the CPU's float64 rows, processor included."""
    from gm_solver import PaperGraphmaxLogitsProcessor

    atol = 1e-6 if dtype == torch.float64 else 1e-5
    a = random_graph(60, 0.1, 8)
    z = torch.randn(5, 64, dtype=torch.float64) * 3  # wider than the graph, as padded vocabularies are
    z[0, 3] = -torch.inf
    cpu = graphmax(z, a, 1.0)
    x, info = graphmax(z.to(device, dtype), a, 1.0, return_info=True, check_every=check_every, max_iter=100)
    assert x.device.type == device.type and x.dtype == dtype and bool(info.converged.all())
    torch.testing.assert_close(x.cpu().double(), cpu, atol=atol, rtol=0)
    assert x[0, 3].item() == 0.0
    proc = PaperGraphmaxLogitsProcessor(a, lam=1.0, device=device, check_every=check_every, max_iter=100)
    ids = torch.zeros(5, 2, dtype=torch.long)
    out = proc(ids.to(device), z.to(device, dtype))
    assert out.device.type == device.type and out.dtype == dtype
    torch.testing.assert_close(out.exp().cpu(), PaperGraphmaxLogitsProcessor(a, lam=1.0)(ids, z.to(dtype)).exp(),
                               atol=1e-5, rtol=0)
