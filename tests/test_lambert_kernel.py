"""The Lambert-W kernel of the context solve: the tabulated log W(eˢ) against scipy, and the ν step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import lambertw

from gm_solver import lambert_kernel as K
from gm_solver.divergences import certificate_toward, log_lambertw_exp


def _exact(s: float) -> float:
    # log W(e^s) in float64, from scipy's W polished by Newton on ω + e^ω = s (e^s overflows past 709)
    omega = math.log(lambertw(math.exp(s)).real) if s < 700 else math.log(s - math.log(s))
    for _ in range(4):
        e = math.exp(omega)
        omega -= (omega + e - s) / (1.0 + e)
    return omega


@given(st.floats(-80.0, 300.0))
def test_tabulated_lambert_matches_scipy_inside_and_beyond_the_table(s):
    omega, e = K.lambert(s, K.TABLE)
    exact = _exact(s)
    assert abs(omega - exact) <= 1e-13 * max(1.0, abs(exact))
    assert abs(e / math.exp(exact) - 1.0) <= 1e-13


@pytest.mark.parametrize("s", [K.S_LO, K.S_LO + 1 / K.PER_UNIT, 0.0, 1.0, K.S_HI - 1e-9, K.S_HI])
def test_tabulated_lambert_is_exact_at_nodes_and_edges(s):
    omega, _ = K.lambert(s, K.TABLE)
    assert abs(omega - _exact(s)) <= 1e-13 * max(1.0, abs(omega))


def test_torch_newton_lambert_agrees_with_the_table():
    s = torch.linspace(-30.0, 90.0, 2001, dtype=torch.float64)
    table = torch.tensor([K.lambert(float(v), K.TABLE)[0] for v in s], dtype=torch.float64)
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
