"""The solvers (gm_solver.solvers): mirror descent's convergence checks, the simplex projection, and the paper's
solver, which stops short of the optimum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gm_solver import graphmax
from gm_solver.operator import TransitionOperator
from gm_solver.solvers import mirror_descent, project_simplex

from .helpers import random_graph


def test_checking_convergence_less_often_gives_the_same_certified_rows():
    # other devices check every 8 iterations to spare host syncs; the rows must not depend on it
    a = random_graph(30, 0.2, 6)
    z = torch.randn(6, 30, dtype=torch.float64) * 3
    op = TransitionOperator(a)
    every, info_every = mirror_descent(z, op, 1.0, check_every=1)
    sparse, info_sparse = mirror_descent(z, op, 1.0, check_every=8)
    assert (info_every.gap <= 1e-6).all() and (info_sparse.gap <= 1e-6).all()
    torch.testing.assert_close(every.exp(), sparse.exp(), atol=1e-12, rtol=0)
    assert torch.equal(info_sparse.iterations, info_every.iterations)
    never, info_never = mirror_descent(z, op, 1.0, check_every=0, max_iter=80)  # converged rows stay frozen
    torch.testing.assert_close(never.exp(), every.exp(), atol=1e-12, rtol=0)
    assert torch.equal(info_never.iterations, info_every.iterations)


@given(n=st.integers(2, 40), density=st.floats(0.0, 0.6), seed=st.integers(0, 10_000), batch=st.integers(1, 5),
       lam=st.sampled_from([0.1, 1.0, 10.0]), masked=st.integers(0, 3), pad=st.integers(0, 2),
       check_every=st.sampled_from([0, 1, 3]))
def test_the_fused_cpu_steps_take_the_torch_steps_path(n, density, seed, batch, lam, masked, pad, check_every):
    # mirror_kernel's passes (the numba backend) against backends.eager.mirror_step (torch sparse, here on the CPU): the
    # same steps on each segment, the same iterations, the same rows to rounding (in float64: in float32 a gap of
    # 1e-6 sits at the rounding, where either may halve a step the other takes)
    a = random_graph(n, density, seed)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, n + pad, generator=g, dtype=torch.float64) * 4
    z[:, :min(masked, n - 1)] = -torch.inf
    runs = {backend: mirror_descent(z, TransitionOperator(a, backend=backend), lam, check_every=check_every,
                                    max_iter=60, trace=True) for backend in ("numba", "torch")}
    (fused, fused_info), (plain, plain_info) = runs["numba"], runs["torch"]
    assert torch.equal(fused_info.iterations, plain_info.iterations)
    assert torch.equal(fused_info.converged, plain_info.converged)
    assert len(fused_info.gap_trace) == len(plain_info.gap_trace)
    assert torch.equal(torch.isinf(fused), torch.isinf(plain))
    assert bool((fused[:, :min(masked, n - 1)] == -torch.inf).all())
    torch.testing.assert_close(fused.exp(), plain.exp(), atol=1e-12, rtol=0)
    torch.testing.assert_close(fused_info.gap, plain_info.gap, atol=1e-12, rtol=0)
    # t is the secant root of φ′, a ratio of sums that near the optimum are small: its rounding is relative
    torch.testing.assert_close(fused_info.step_trace, plain_info.step_trace, atol=0, rtol=1e-8)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_a_float32_solve_is_certified_and_near_the_float64_one(backend):
    # Ã in float32, as a stored graph holds it: the numba kernels of both solves are those pipelines.warm compiles
    a = random_graph(40, 0.15, 5).astype(np.float32)
    z = torch.randn(3, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 4
    z[0, :4] = -torch.inf
    x32, info = graphmax(z, a, 1.0, backend=backend, dtype=torch.float32, return_info=True)
    assert x32.dtype == torch.float64 and bool((info.gap <= 1e-6).all()) and bool((x32[0, :4] == 0).all())
    torch.testing.assert_close(x32, graphmax(z, a, 1.0, backend=backend), atol=2e-3, rtol=0)


@given(v=st.lists(st.floats(-5, 5), min_size=1, max_size=20))
def test_simplex_projection(v):
    t = torch.tensor([v], dtype=torch.float64)
    p = project_simplex(t)
    assert (p >= 0).all() and abs(float(p.sum()) - 1) < 1e-9
    # optimality: p = max(v − θ, 0) for one θ
    support = p[0] > 0
    theta = (t[0] - p[0])[support]
    assert float(theta.max() - theta.min()) < 1e-9


def test_paper_solver_does_not_reach_the_optimum():
    a = random_graph(50, 0.1, 6)
    z = torch.randn(50, dtype=torch.float64) * 3
    x, info = graphmax(z, a, 1.0, solver="paper", return_info=True)
    assert abs(float(x.sum()) - 1) < 1e-9 and (x >= 0).all()
    assert int(info.iterations) <= 20
    assert float(info.gap) > 1e-3  # far from the certified optimum
    _, ours = graphmax(z, a, 1.0, return_info=True)
    assert float(ours.gap) <= 1e-6
