"""The CPU kernel of the context solve: the tabulated log W(eˢ) against scipy, the ν step, the batched solve and its
certificate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy.special import lambertw

from gm_solver import certificate_toward, solve_toward
from gm_solver.backends.eager import log_lambertw_exp
from gm_solver.backends.numba import lambert as K


def _exact(s: float) -> float:
    # log W(e^s) in float64, from scipy's W polished by Newton on ω + e^ω = s (e^s overflows past 709)
    omega = math.log(lambertw(math.exp(s)).real) if s < 700 else math.log(s - math.log(s))
    for _ in range(4):
        e = math.exp(omega)
        omega -= (omega + e - s) / (1.0 + e)
    return omega


@given(st.floats(-80.0, 300.0))
def test_tabulated_lambert_matches_scipy_inside_and_beyond_the_table(s):
    omega, e = K.lambert_omega(s, K.TABLE), K.lambert_e(s, K.TABLE)
    exact = _exact(s)
    assert abs(omega - exact) <= 1e-13 * max(1.0, abs(exact))
    assert abs(e / math.exp(exact) - 1.0) <= 1e-13


@pytest.mark.parametrize("s", [K.S_LO, K.S_LO + 1 / K.PER_UNIT, 0.0, 1.0, K.S_HI - 1e-9, K.S_HI])
def test_tabulated_lambert_is_exact_at_nodes_and_edges(s):
    omega = K.lambert_omega(s, K.TABLE)
    assert abs(omega - _exact(s)) <= 1e-13 * max(1.0, abs(omega))


def test_torch_newton_lambert_agrees_with_the_table():
    s = torch.linspace(-30.0, 90.0, 2001, dtype=torch.float64)
    table = torch.tensor([K.lambert_omega(float(v), K.TABLE) for v in s], dtype=torch.float64)
    torch.testing.assert_close(log_lambertw_exp(s), table, atol=1e-12, rtol=1e-13)


@pytest.mark.parametrize("kind, total, slope, curve, root", [
    # softmax's own form, Σx = e^(−0.3−ν): γ = 0
    (K.RKL, math.exp(-0.3), -math.exp(-0.3), math.exp(-0.3), -0.3),
    # rkl where the reference dominates, x ≈ λq/(ν + c): Σx = 40/(ν + 3), γ = 1
    (K.RKL, 40 / 3, -40 / 9, 80 / 27, 37.0),
    # l2 where the reference dominates, x ≈ (c − ν)/2λ: Σx = (5 − ν)/2, γ = −1
    (K.L2, 2.5, -0.5, 0.0, 3.0),
])
def test_the_nu_step_lands_on_the_root_of_each_limiting_form(kind, total, slope, curve, root):
    assert 0.0 + K.nu_step(kind, total, slope, curve) == pytest.approx(root, rel=1e-12, abs=1e-12)


@given(st.integers(0, 10_000), st.sampled_from([K.RKL, K.L2]), st.sampled_from([0.1, 1.0, 10.0]))
def test_kernel_certificate_equals_the_torch_certificate(seed, kind, lam):
    g = torch.Generator().manual_seed(seed)
    z = 4 * torch.randn(300, generator=g, dtype=torch.float64)
    z[:5] = -torch.inf
    q = torch.rand(300, generator=g, dtype=torch.float64) ** 4
    t = torch.log_softmax(z, -1)
    q_hat = torch.where(torch.isfinite(z), q, 0.0) / q[5:].sum()
    # any point of the simplex, not only the optimum: here softmax of perturbed logits
    logx = torch.log_softmax(z + torch.randn(300, generator=g, dtype=torch.float64), -1)
    a = (lam if kind == K.RKL else 2 * lam) * q_hat
    divergence = "rkl" if kind == K.RKL else "l2"
    expected = float(certificate_toward(logx[None], t[None], q_hat[None], lam, divergence))
    assert K.certificate(kind, t.numpy(), a.numpy(), lam, logx.numpy()) == pytest.approx(expected, rel=1e-10)


BATCHES = st.tuples(st.integers(0, 10_000), st.integers(1, 6), st.sampled_from([5, 300, 9000]),
                    st.sampled_from(["rkl", "l2", "kl"]), st.sampled_from([0.0, 0.15, 0.7]))


def _batch(seed: int, rows: int, width: int):
    g = torch.Generator().manual_seed(seed)
    z = 4 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    z[0, : width // 3] = -torch.inf  # masked tokens
    q = torch.rand(rows, width, generator=g, dtype=torch.float64) ** 4
    q[-1, width // 2:] = 0  # a reference with zeros
    if rows > 2:
        q[1] = 0  # and one with no mass at all: softmax
    lam = torch.tensor([0.05, 1.0, 3.0, 30.0, 0.0, 300.0][:rows], dtype=torch.float64)
    return z, q, lam


def _log(q) -> np.ndarray:
    """log q where q > 0 (what the kernels read), -inf elsewhere."""
    q = np.asarray(q)
    return np.log(q, out=np.full_like(q, -np.inf), where=q > 0)


def _solve(z, q, lam, divergence, share, max_iter=60, mode=K.LOCKSTEP):
    kind = K.L2 if divergence == "l2" else K.RKL
    out, iters, gaps = np.empty(z.shape), np.empty(len(z), dtype=np.int64), np.empty(len(z))
    share = 1.0 if divergence == "kl" else share
    assert K.solve_batch(kind, z.numpy(), q.numpy(), _log(q), lam.numpy(), share, max_iter, K.TABLE,
                         np.empty((2, *z.shape)), out, iters, gaps, mode) == K.FINE
    return out, iters, gaps


@given(BATCHES)
def test_a_row_comes_out_of_the_batched_kernel_as_it_does_alone(case):
    # rows are solved in lockstep over all their chunks, or each by one thread (in parallel or one after another),
    # but each row's chunk sums are added in one order: a row alone or in a batch, any way, is solved bit for bit
    # alike
    seed, rows, width, divergence, share = case
    z, q, lam = _batch(seed, rows, width)
    out, iters, gaps = _solve(z, q, lam, divergence, share)
    assert (gaps <= 1e-6).all()
    for mode in (K.SERIAL, K.ROWS, K.LOCKSTEP):
        batch = _solve(z, q, lam, divergence, share, mode=mode)
        np.testing.assert_array_equal(batch[0], out)
        np.testing.assert_array_equal(batch[1], iters)
        np.testing.assert_array_equal(batch[2], gaps)
        for b in range(rows):
            alone = _solve(z[b:b + 1], q[b:b + 1], lam[b:b + 1], divergence, share, mode=mode)
            np.testing.assert_array_equal(alone[0][0], out[b])
            assert alone[1][0] == iters[b] and alone[2][0] == gaps[b]
    # and it is the torch path's solution (Newton for W instead of the table, every row in torch), to the ν search's
    # tolerance: each stops at |log Σx| ≤ τ = NU_TOL/max(1, λ), so ν is within τ/|d log Σx/dν| of the root, and for
    # rkl d log xᵢ/dν = −1/(1 + λqᵢ/xᵢ) ∈ [−1, 0): each xᵢ is within about NU_TOL of the optimum, relatively (8 times
    # closer in 300 random batches; an absolute 1e-10 held on 30 fixed ones only)
    expected, info = solve_toward(z, q, lam, divergence, kl_share=share, backend="torch")
    torch.testing.assert_close(torch.from_numpy(out).exp(), expected.exp(), rtol=2 * K.NU_TOL,
                               atol=torch.finfo(torch.float64).tiny)
    assert torch.equal(torch.from_numpy(iters), info.iterations)


@given(BATCHES, st.sampled_from([1, 2, 60]))
def test_the_fused_certificate_is_the_certificate_computed_from_scratch(case, max_iter):
    # the last pass sums the certificate while it writes log x, shifted by ν; out of ν steps (max_iter 1 or 2)
    # ν may be no safe shift and the kernel sums again from the max: either way, the certificate of what it returns
    seed, rows, width, divergence, share = case
    z, q, lam = _batch(seed, rows, width)
    out, _, gaps = _solve(z, q, lam, divergence, share, max_iter)
    share = 1.0 if divergence == "kl" else share
    for b in range(rows):
        allowed = torch.isfinite(z[b])
        mass = float(q[b][allowed].sum())
        if lam[b] == 0 or mass == 0:
            assert gaps[b] == 0
            continue
        scale = 1.0 + lam[b] * share
        lam_d = float(lam[b] * (1.0 - share) / scale)
        q_hat = torch.where(allowed, q[b], 0.0) / mass
        t = torch.log_softmax(z[b], -1)
        if share > 0:  # the logits leaned toward q by KL(x‖q)'s share
            t = torch.log_softmax(torch.where(q_hat > 0, (t + lam[b] * share * q_hat.log()) / scale, -torch.inf), -1)
        a = (lam_d if divergence != "l2" else 2 * lam_d) * q_hat
        expected = float(scale) * K.certificate(K.L2 if divergence == "l2" else K.RKL, t.numpy(), a.numpy(), lam_d,
                                                out[b])
        assert gaps[b] == pytest.approx(expected, rel=1e-9, abs=1e-11)  # at the optimum: rounding of ±ν-sized sums


def _prepared_row(seed: int, lam: float, share: float, width: int = 3 * K.BIN_MIN_WIDTH // 2):
    # a wide rkl row through the kernel's first pass and _begin: (v, q, base, state), as solve_row has them before
    # its ν steps
    g = torch.Generator().manual_seed(seed)
    z = (4 * torch.randn(width, generator=g, dtype=torch.float64)).numpy()
    q = (torch.rand(width, generator=g, dtype=torch.float64) ** 4).numpy()
    q[: width // 50] = 0.0  # tokens without reference mass: softmax's own form
    v, base = np.empty(width), np.empty(width)
    sums, st = np.zeros(((width + K.CHUNK - 1) // K.CHUNK, 6)), np.zeros(K.STATE)
    K._prepare_row(K.RKL, z, q, _log(q), lam, share, v, base, sums, st)
    assert K._begin(K.RKL, z, v, sums, lam, share, st) == K.FINE
    return v, q, base, st


@given(st.integers(0, 10_000), st.sampled_from([0.05, 1.0, 30.0]), st.sampled_from([0.0, 0.15]),
       st.floats(-0.5, 5.0))
def test_the_binned_nu_sums_are_the_exact_sums(seed, lam, share, nu):
    # exact against approximate: Σx, Σx′ and Σx″ at any ν from the row's histogram, against every token's own
    v, q, base, st_ = _prepared_row(seed, lam, share)
    hist = np.empty((K.BINS, 4))
    K._bin_row(v, q, base, st_, hist)
    assume(st_[K.BINNED] == 1.0)  # (a reference of 1e-30, 1 seed in 2,000, lies outside the bins: exact passes)
    st_[K.NU] = nu
    binned = K._binned_sums(st_, hist, K.TABLE)
    exact = K._sums(K.RKL, v, q, base, K._shift(K.RKL, st_, nu), st_[K.LSE] + nu, st_[K.KAP], 0.0, K.TABLE, 0, v.size)
    # Σx⁽ʲ⁾ is Taylor's to the order 3 − j in d, |d| ≤ h/2 = 1/64: each bin is off by at most |f⁗|·(h/2)⁴⁻ʲ/(4 − j)!,
    # and |f⁗| ≤ 1.04·|f⁽ʲ⁾| for f = 1/W(eˢ) (each f⁽ʲ⁾ of one sign): 2.5e-9 of Σx, 6.4e-7 of Σx′, 1.3e-4 of Σx″
    half = 0.5 / K.BIN_PER_UNIT
    for j in range(3):
        assert binned[j] == pytest.approx(exact[j], rel=1.05 * half ** (4 - j) / math.factorial(4 - j))


def test_a_row_beyond_the_bins_or_too_narrow_keeps_the_exact_passes():
    v, q, base, st_ = _prepared_row(0, 1.0, 0.15)
    hist = np.empty((K.BINS, 4))
    K._bin_row(v, q, base, st_, hist)
    assert st_[K.BINNED] == 1.0
    K._bin_row(v[:K.BIN_MIN_WIDTH - 1], q, base, st_, hist)
    assert st_[K.BINNED] == 0.0
    far = q.size // 2  # a reference 1e-300: its s lies 690 below the others', outside the bins
    base[far] += math.log(1e-300 / q[far])
    K._bin_row(v, q, base, st_, hist)
    assert st_[K.BINNED] == 0.0
    # and such a row is solved as the torch path solves it (exact ν steps both)
    g = torch.Generator().manual_seed(1)
    z = 4 * torch.randn(2, v.size, generator=g, dtype=torch.float64)
    q2 = torch.rand(2, v.size, generator=g, dtype=torch.float64) ** 4
    q2[0, 7] = 1e-300
    lam = torch.tensor([1.0, 1.0], dtype=torch.float64)
    out, iters, gaps = _solve(z, q2, lam, "rkl", 0.15)
    expected, info = solve_toward(z, q2, lam, "rkl", kl_share=0.15, backend="torch")
    assert (gaps <= 1e-6).all() and np.isclose(np.exp(out).sum(-1), 1.0, rtol=0, atol=1e-12).all()
    torch.testing.assert_close(torch.from_numpy(out).exp(), expected.exp(), atol=1e-10, rtol=0)


def test_the_kernel_reports_bad_logits_before_any_nu_step():
    z, q, lam = _batch(0, 3, 300)
    for edit, status in ((lambda v: v.index_fill(1, torch.tensor([7]), float("nan")), K.HAS_NAN),
                         (lambda v: v.index_fill(1, torch.tensor([7]), float("inf")), K.HAS_POSINF),
                         (lambda v: v.index_fill(0, torch.tensor([2]), -float("inf")), K.ALL_MASKED)):
        out, iters, gaps = np.empty(z.shape), np.empty(3, dtype=np.int64), np.empty(3)
        for mode in (K.SERIAL, K.ROWS, K.LOCKSTEP):
            assert K.solve_batch(K.RKL, edit(z).numpy(), q.numpy(), _log(q), lam.numpy(), 0.15, 60, K.TABLE,
                                 np.empty((2, *z.shape)), out, iters, gaps, mode) == status
