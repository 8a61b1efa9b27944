"""The Lambert-W kernel of the context solve: the tabulated log W(eˢ) against scipy, and the ν step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import lambertw

from gm_solver import lambert_kernel as K
from gm_solver.divergences import log_lambertw_exp


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


def test_a_row_without_reference_mass_is_softmax_after_one_nu_step():
    # Σx(ν) = e^(−ν)·Σe^t: γ = 0, and Newton on log Σx lands on the root
    t = torch.log_softmax(torch.randn(1000, dtype=torch.float64), -1).numpy() + 0.3
    out = np.empty_like(t)
    iters = K.solve_row(K.RKL, t, np.zeros_like(t), 1.0, 60, K.TABLE, out)
    assert iters == 1
    np.testing.assert_allclose(out, t - 0.3, atol=1e-12)


def test_the_nu_step_is_exact_where_the_reference_dominates_rkl():
    # x = λq/(ν + c) for every token: Σx = λ/(ν + c), a hyperbola, which the γ = 1 step solves in one
    lam, c, nu = 40.0, 3.0, 0.0
    total, slope, curve = lam / (nu + c), -lam / (nu + c) ** 2, 2 * lam / (nu + c) ** 3
    assert nu + K.nu_step(K.RKL, total, slope, curve) == pytest.approx(lam - c, rel=1e-12)
