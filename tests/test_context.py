"""Context-aware graphmax: the reference rows, the separable solvers and their certificate, the processor, tuning."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize
import scipy.sparse as sp
import torch
from hypothesis import given
from hypothesis import strategies as st

from gm_solver import (
    DIVERGENCES,
    ContextConfig,
    ContextGraphmaxLogitsProcessor,
    ContextReference,
    InterpolationLogitsProcessor,
    certificate_toward,
    solve_toward,
)

COUNTS = sp.csr_matrix(np.array([[0, 5, 1, 0, 0],
                                 [2, 0, 0, 3, 0],
                                 [0, 0, 0, 0, 4],
                                 [1, 1, 1, 1, 0],
                                 [0, 0, 0, 0, 0]], dtype=float))


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


@pytest.mark.parametrize("kl_share", [0.0, 0.3])
@pytest.mark.parametrize("divergence", ["rkl", "l2"])
def test_agrees_with_an_independent_solve(divergence, kl_share):
    rng = np.random.default_rng(0)
    n, lam = 7, 2.0
    z, q = rng.normal(size=n) * 2, rng.dirichlet(np.ones(n))

    def f(v):  # the primal on the simplex through a softmax parametrisation
        x = np.exp(v - v.max())
        x /= x.sum()
        d = np.sum(q * np.log(q / x)) if divergence == "rkl" else np.sum((x - q) ** 2)
        return -x @ z + x @ np.log(x) + lam * ((1 - kl_share) * d + kl_share * np.sum(x * np.log(x / q)))

    v = scipy.optimize.minimize(f, np.zeros(n), method="BFGS", options={"gtol": 1e-11}).x
    ref = np.exp(v - v.max()) / np.exp(v - v.max()).sum()
    logx, _ = solve_toward(torch.tensor([z]), torch.tensor([q]), lam, divergence, kl_share=kl_share)
    np.testing.assert_allclose(logx.exp()[0].numpy(), ref, atol=1e-6)


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
    assert torch.equal(out, torch.log_softmax(scores, -1)) and torch.equal(scores, before)


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
])
def test_config_is_validated(kwargs, error):
    with pytest.raises(ValueError, match=error):
        ContextConfig(**kwargs)


def test_interpolation_is_the_mixture_of_softmax_and_the_reference():
    scores = torch.randn(1, 5, dtype=torch.float64)
    proc = InterpolationLogitsProcessor(COUNTS, weight=0.25)
    q = proc.reference(torch.tensor([[2]]))
    expected = 0.75 * torch.softmax(scores, -1) + 0.25 * q
    assert torch.allclose(proc(torch.tensor([[2]]), scores).exp(), expected)
    with pytest.raises(ValueError, match="weight"):
        InterpolationLogitsProcessor(COUNTS, weight=1.5)
