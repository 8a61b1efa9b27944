"""solve_toward (gm_solver.divergences): each divergence's certificate and fixed point, an independent solve, the
KL share, the numba kernel against the torch path, edge cases and bad inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mpmath
import numpy as np
import pytest
import scipy.optimize
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_solver import certificate_toward, solve_toward
from gm_solver.divergences import DIVERGENCES

CASES = st.tuples(st.integers(2, 40), st.integers(0, 10_000), st.sampled_from([0.05, 0.3, 1.0, 3.0, 30.0]))


@given(CASES, st.sampled_from(DIVERGENCES))
def test_certificate_and_fixed_point_for_each_divergence(case, divergence):
    n, seed, lam = case
    g = torch.Generator().manual_seed(seed)
    z = 4 * torch.randn(3, n, generator=g, dtype=torch.float64)
    q = torch.rand(3, n, generator=g, dtype=torch.float64) ** 4
    q[1, : n // 2] = 0  # references with zeros, as rows of Ã have
    q = q / q.sum(-1, keepdim=True)
    logx, info = solve_toward(z, q, lam, divergence)
    x = logx.exp()
    assert torch.allclose(x.sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-12)
    assert (info.gap <= 1e-6).all()
    assert torch.allclose(certificate_toward(logx, z, q, lam, divergence), info.gap, atol=1e-12)


def _bfgs(z: np.ndarray, q: np.ndarray, lam: float, divergence: str, kl_share: float) -> np.ndarray:
    """The primal minimised over the simplex through a softmax parametrisation, by scipy's BFGS."""
    def f(v):
        x = np.exp(v - v.max())
        x /= x.sum()
        d = {"rkl": np.sum(q * np.log(q / x)), "l2": np.sum((x - q) ** 2), "kl": np.sum(x * np.log(x / q))}[divergence]
        return -x @ z + x @ np.log(x) + lam * ((1 - kl_share) * d + kl_share * np.sum(x * np.log(x / q)))

    v = scipy.optimize.minimize(f, np.zeros(len(z)), method="BFGS", options={"gtol": 1e-11}).x
    return np.exp(v - v.max()) / np.exp(v - v.max()).sum()


@given(st.integers(0, 10_000), st.integers(1, 4), st.sampled_from(DIVERGENCES), st.sampled_from([0.0, 0.15, 0.6]),
       st.sampled_from(["numba", "torch"]))
def test_agrees_with_an_independent_solve(seed, rows, divergence, kl_share, backend):
    rng = np.random.default_rng(seed)
    n = 7
    z, q = rng.normal(size=(rows, n)) * 2, rng.dirichlet(np.ones(n), size=rows)
    lam = rng.choice([0.3, 1.0, 2.0, 5.0], size=rows)  # one λ per row
    logx, info = solve_toward(torch.tensor(z), torch.tensor(q), torch.tensor(lam), divergence, kl_share=kl_share,
                              backend=backend)
    assert (info.gap <= 1e-6).all()
    for b in range(rows):
        np.testing.assert_allclose(logx[b].exp().numpy(), _bfgs(z[b], q[b], lam[b], divergence, kl_share), atol=1e-6)


@settings(max_examples=100)  # 39 scales × 3 divergences × 2 shares × 3 backends: more than the profile's 30
@given(st.integers(0, 38), st.integers(0, 10_000), st.sampled_from(DIVERGENCES), st.sampled_from([0.0, 0.15]),
       st.sampled_from([("numba", torch.float64), ("torch", torch.float64), ("torch", torch.float32)]))
def test_every_scale_of_scores_gives_a_certified_distribution(k, seed, divergence, kl_share, case):
    # the problem moves by a constant when z does; at 1e20 it is dominated by ⟨x, z⟩, but the certificate is a
    # difference of objectives, and x* is still a distribution (rkl keeps about λq/|Δz| off the argmax)
    backend, dtype = case
    g = torch.Generator().manual_seed(seed)
    scale = min(10.0 ** k, 3e38)
    z = scale * (2 * torch.rand(4, 20, generator=g, dtype=torch.float64) - 1)
    z[1] = scale  # all scores equal
    z[2, :4] = -torch.inf
    q = torch.rand(4, 20, generator=g, dtype=torch.float64) ** 4
    q[3, :10] = 0
    z, q = z.to(dtype), (q / q.sum(-1, keepdim=True)).to(dtype)
    logx, info = solve_toward(z, q, 1.2, divergence, kl_share=kl_share, backend=backend)
    torch.testing.assert_close(logx.double().exp().sum(-1), torch.ones(4, dtype=torch.float64), rtol=0,
                               atol=1e-12 if dtype == torch.float64 else 1e-6)
    assert (info.gap <= 1e-6).all() and (logx[2, :4] == -torch.inf).all()
    if kl_share == 0 and dtype == torch.float64:  # from scratch, on z as given and q renormalised where z is finite
        q_hat = torch.where(torch.isfinite(z), q, 0.0)
        assert (certificate_toward(logx, z, q_hat / q_hat.sum(-1, keepdim=True), 1.2, divergence) <= 1e-6).all()


def _exact(z: np.ndarray, q: np.ndarray, lam: float, divergence: str, kl_share: float) -> np.ndarray:
    """The solution from its optimality conditions in 50-digit arithmetic (BFGS through a softmax stalls on the
    tokens softmax starves once |z| is in the tens): with c = 1 + λm, r = z − max z + λm·log q, each log x
    for a multiplier ν in closed form, c·log x − λ(1−m)q/x = r + ν (rkl), c·log x + 2λ(1−m)(x − q) = r + ν
    (l2), c·log x = r + ν (kl, m = 1), and ν found so that Σx = 1."""
    with mpmath.workdps(50):
        return _exact_50_digits(z, q, lam, divergence, kl_share)


def _exact_50_digits(z, q, lam, divergence, kl_share):
    mp = mpmath.mp
    m = 1.0 if divergence == "kl" else kl_share
    c = 1 + mp.mpf(lam) * m
    b = mp.mpf(lam) * (1 - m) * (2 if divergence == "l2" else 1)
    keep = [i for i in range(len(z)) if q[i] > 0 or m == 0]  # KL(x‖q) keeps x at 0 where q = 0
    r = {i: mp.mpf(z[i]) - mp.mpf(max(z)) + (mp.mpf(lam) * m * mp.log(q[i]) if m > 0 else 0) for i in keep}

    def log_x(i, nu):
        if divergence == "rkl" and q[i] > 0:
            return (r[i] + nu) / c + mpmath.lambertw(b * q[i] / c * mp.exp(-(r[i] + nu) / c)).real
        if divergence == "l2":
            right = r[i] + nu + b * q[i]
            return right / c - mpmath.lambertw(b / c * mp.exp(right / c)).real
        return (r[i] + nu) / c

    def log_mass(nu):  # increasing in ν
        return mp.log(mp.fsum(mp.exp(log_x(i, nu)) for i in keep))

    lo, hi = mp.mpf(-1), mp.mpf(1)
    while log_mass(lo) > 0:
        lo *= 2
    while log_mass(hi) < 0:
        hi *= 2
    nu = mpmath.findroot(log_mass, (lo, hi), solver="anderson")
    x = np.zeros(len(z))
    for i in keep:
        x[i] = float(mp.exp(log_x(i, nu)))
    return x


@pytest.mark.parametrize("k", [1, 2, 3, 9, 20, 38])
@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_large_scores_agree_with_an_independent_solve(divergence, backend, k):
    # every token to 1e-6 relatively, the smallest too (rkl keeps about λq/|Δz| on them: 1e-40 at |z| = 1e38)
    rng = np.random.default_rng(k)
    z, q = rng.uniform(-1, 1, size=(2, 7)) * 10.0 ** k, rng.dirichlet(np.ones(7), size=2)
    logx, info = solve_toward(torch.tensor(z), torch.tensor(q), 1.5, divergence, kl_share=0.15, backend=backend)
    assert (info.gap <= 1e-6).all()
    for b in range(2):
        np.testing.assert_allclose(logx[b].exp().numpy(), _exact(z[b], q[b], 1.5, divergence, 0.15), rtol=1e-6,
                                   atol=1e-300)


@given(CASES, st.sampled_from(["rkl", "l2"]), st.floats(0.01, 0.99))
def test_a_kl_share_is_certified_on_the_whole_objective(case, divergence, kl_share):
    n, seed, lam = case
    g = torch.Generator().manual_seed(seed)
    z = 4 * torch.randn(3, n, generator=g, dtype=torch.float64)
    z[2, 0] = -torch.inf
    q = torch.rand(3, n, generator=g, dtype=torch.float64) ** 4 + 1e-3
    q[1, : n // 2] = 0
    q = q / q.sum(-1, keepdim=True)
    logx, info = solve_toward(z, q, lam, divergence, kl_share=kl_share)
    x = logx.exp()
    torch.testing.assert_close(x.sum(-1), torch.ones(3, dtype=torch.float64))
    assert (info.gap <= 1e-6).all() and logx[2, 0] == -torch.inf and (x[1, : n // 2] == 0).all()
    # the certificate of the objective as written: KL(x ‖ softmax(z − λ∇R(x))), R = (1−m)·D + m·KL(x‖q),
    # with q renormalised over the allowed tokens; a bound on f(x) − f* like the reported one, and as small
    on = (q > 0) & torch.isfinite(z)
    q = torch.where(on, q, 0.0) / torch.where(on, q, 0.0).sum(-1, keepdim=True)
    grad_d = -q / x.clamp_min(1e-300) if divergence == "rkl" else 2 * (x - q)
    y = z - lam * ((1 - kl_share) * grad_d + kl_share * (logx - q.log()))
    y = torch.where(on, y, torch.full_like(y, -torch.inf))
    direct = (x * (logx - torch.log_softmax(y, -1))).where(x > 0, 0.0).sum(-1)
    assert (direct <= 1e-6).all()


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_kl_share_runs_from_the_divergence_alone_to_kl(divergence):
    g = torch.Generator().manual_seed(3)
    z = 3 * torch.randn(4, 30, generator=g, dtype=torch.float64)
    q = torch.softmax(2 * torch.randn(4, 30, generator=g, dtype=torch.float64), -1)
    alone, _ = solve_toward(z, q, 1.5, divergence)
    torch.testing.assert_close(solve_toward(z, q, 1.5, divergence, kl_share=0.0)[0], alone)
    torch.testing.assert_close(solve_toward(z, q, 1.5, divergence, kl_share=1.0)[0], solve_toward(z, q, 1.5, "kl")[0])
    if divergence == "kl":  # KL(x‖q) shared with itself is itself
        torch.testing.assert_close(solve_toward(z, q, 1.5, "kl", kl_share=0.4)[0], alone)
    with pytest.raises(ValueError, match="kl_share"):
        solve_toward(z, q, 1.5, divergence, kl_share=1.5)


@given(CASES, st.sampled_from(["rkl", "l2"]), st.sampled_from([0.0, 0.15]))
def test_numba_kernel_and_torch_path_agree(case, divergence, kl_share):
    n, seed, lam = case
    g = torch.Generator().manual_seed(seed)
    z = 4 * torch.randn(3, n, generator=g, dtype=torch.float64)
    z[2, 0] = -torch.inf  # a masked token
    q = torch.rand(3, n, generator=g, dtype=torch.float64) ** 4
    q[1, n // 2:] = 0
    a, info_a = solve_toward(z, q, lam, divergence, kl_share=kl_share, backend="numba")
    b, info_b = solve_toward(z, q, lam, divergence, kl_share=kl_share, backend="torch")
    torch.testing.assert_close(a.exp(), b.exp(), atol=1e-10, rtol=0)
    assert a[2, 0] == -torch.inf and (info_a.gap <= 1e-6).all() and (info_b.gap <= 1e-6).all()


@pytest.mark.parametrize("lam", [1000.0, 1e5])
@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("divergence", ["rkl", "l2"])
def test_large_lambda_still_reaches_the_tolerance(divergence, backend, lam):
    # the ν search once bounced between the sides of its bracket here (l2, λ = 1000: gap 443)
    g = torch.Generator().manual_seed(0)
    z = 4 * torch.randn(200, 500, generator=g, dtype=torch.float64)
    q = torch.softmax(3 * torch.randn(200, 500, generator=g, dtype=torch.float64), -1)
    _, info = solve_toward(z, q, lam, divergence, backend=backend)
    assert (info.gap <= 1e-6).all()


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("lam", [1000.0, 1e6])
def test_a_reference_on_one_token_at_large_lambda_is_certified(backend, lam):
    # every other token's x underflows to 0 (log x ≈ −λ): the certificate must not read 0/0
    z = 0.1 * torch.randn(2, 3000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q = torch.zeros_like(z)
    q[:, 5] = 1.0
    logx, info = solve_toward(z, q, lam, "rkl", backend=backend)
    assert (info.gap <= 1e-6).all() and not torch.isnan(logx).any()
    torch.testing.assert_close(logx.exp().sum(-1), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("kl_share", [0.0, 0.15])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_a_reference_with_no_mass_on_the_allowed_tokens_leaves_softmax(divergence, kl_share):
    z = torch.tensor([[0.0, 2.0, -torch.inf, 1.0]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)  # all its mass on the masked token
    logx, info = solve_toward(z, q, 1.0, divergence, kl_share=kl_share)
    torch.testing.assert_close(logx, torch.log_softmax(z, -1))
    assert info.gap.item() == 0.0


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("kl_share", [0.0, 0.15])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_lambda_zero_is_softmax(divergence, kl_share, backend):
    z = torch.tensor([[0.5, -torch.inf, 2.0, -1.0]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    logx, info = solve_toward(z, q, 0.0, divergence, kl_share=kl_share, backend=backend)
    torch.testing.assert_close(logx, torch.log_softmax(z, -1))
    assert info.gap.item() == 0.0
    with pytest.raises(ValueError, match="lam"):
        solve_toward(z, q, -1.0, divergence)


def test_kl_is_the_closed_form_product_of_experts():
    z = torch.tensor([[1.0, 0.0, -1.0, 2.0]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    logx, info = solve_toward(z, q, 0.5, "kl")
    expected = torch.log_softmax((z + 0.5 * q.log()) / 1.5, -1)
    assert torch.allclose(logx, expected) and info.gap.item() <= 1e-12


@pytest.mark.parametrize("kl_share", [0.0, 0.15])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_masked_logits_stay_masked_whatever_q_says(divergence, kl_share):
    z = torch.tensor([[0.0, -torch.inf, 1.0, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.8, 0.05, 0.05]], dtype=torch.float64)
    logx, info = solve_toward(z, q, 1.0, divergence, kl_share=kl_share)
    assert logx[0, 1] == -torch.inf and torch.isclose(logx.exp().sum(), torch.tensor(1.0, dtype=torch.float64))
    assert info.gap.item() <= 1e-6


# --- what solve_toward refuses before any kernel reads the arrays (issue 13) ---

def _z_and_q():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 50, generator=g, dtype=torch.float64), torch.rand(3, 50, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("edit, error", [
    (lambda z, q, lam: (z, q[:, :40], lam), "q has shape"),  # narrower: the kernel would read past q
    (lambda z, q, lam: (z, torch.cat([q, q], 1), lam), "q has shape"),
    (lambda z, q, lam: (z, q[:2], lam), "q has shape"),
    (lambda z, q, lam: (z, q.index_fill(1, torch.tensor([3]), float("nan")), lam), "q contains NaN or ±inf"),
    (lambda z, q, lam: (z, q.index_fill(1, torch.tensor([3]), float("inf")), lam), "q contains NaN or ±inf"),
    (lambda z, q, lam: (z, q.index_fill(1, torch.tensor([3]), -float("inf")), lam), "q contains NaN or ±inf"),
    (lambda z, q, lam: (z, q - 0.5, lam), "negative entries"),
    (lambda z, q, lam: (z.index_fill(1, torch.tensor([3]), float("nan")), q, lam), "z contains NaN"),
    (lambda z, q, lam: (z.index_fill(1, torch.tensor([3]), float("inf")), q, lam), r"z contains \+inf"),
    (lambda z, q, lam: (z.index_fill(0, torch.tensor([2]), -float("inf")), q, lam), "entirely -inf"),
    (lambda z, q, lam: (z, q, float("inf")), "lam must be finite"),
    (lambda z, q, lam: (z, q, float("nan")), "lam must be finite"),
    (lambda z, q, lam: (z, q, torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)), "lam must be finite and >= 0"),
    (lambda z, q, lam: (z, q, torch.tensor([1.0, float("inf"), 1.0])), "lam must be finite and >= 0"),
    (lambda z, q, lam: (z, q, torch.ones(4)), r"shape \(3,\)"),
    (lambda z, q, lam: (z[0], q[0], lam), r"shape \(B, V\)"),
])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_solve_toward_refuses_bad_inputs(edit, error, backend):
    z, q, lam = edit(*_z_and_q(), 1.0)
    with pytest.raises(ValueError, match=error):
        solve_toward(z, q, lam, "rkl", backend=backend)


def test_q_narrower_than_z_is_refused_at_a_width_where_reading_past_it_would_crash():
    # run apart: had the kernel read past q (as it once did), a segfault would end the process, not raise
    code = ("import torch\nfrom gm_solver import solve_toward\n"
            "z = torch.randn(2, 4_000_000, dtype=torch.float64)\nq = torch.rand(2, 1000, dtype=torch.float64)\n"
            "try:\n    solve_toward(z, q, 1.0)\nexcept ValueError as e:\n    print('refused:', e)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: q has shape (2, 1000) but z has (2, 4000000)" in done.stdout
