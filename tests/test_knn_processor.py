"""The kNN context decoder: the reference it mixes into q (numba kernel, torch and an explicit dense mix agree),
KnnContextGraphmaxLogitsProcessor, and the marginal bias (its weight in the kNN processor and
MarginalBiasLogitsProcessor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessorList

from gm_graphs.errors import DatastoreError
from gm_solver import (
    ContextConfig,
    ContextGraphmaxLogitsProcessor,
    ContextReference,
    Datastore,
    HiddenStateTap,
    KnnContextGraphmaxLogitsProcessor,
    MarginalBiasLogitsProcessor,
    solve_toward,
)
from gm_solver.backends import eager

from .helpers import random_counts, random_marginals

# ---- the reference and the processor ------------------------------------------------------------------------------

CONFIGS = [ContextConfig(), ContextConfig(order_weights=(1.0, 0.5, 0.2), divergence="l2", kl_share=0.3),
           ContextConfig(smoothing="dirichlet", divergence="kl", kl_share=0.0, lam=3.0)]


@given(config=st.sampled_from(CONFIGS), rows=st.integers(1, 4), k=st.integers(1, 9), extra=st.integers(0, 3),
       share=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_the_knn_reference_is_the_dense_mix_on_every_path(config, rows, k, extra, share, seed):
    n = 30
    rng = np.random.default_rng(seed)
    ref = ContextReference(random_counts(n, seed % 7), config)
    ids = torch.tensor(rng.integers(0, n, (rows, 5)))
    width = n + extra  # ids past the graph (padded vocabularies) may come from the datastore too
    tokens = torch.tensor(rng.integers(0, width, (rows, k)))
    weights = torch.softmax(torch.tensor(rng.normal(size=(rows, k))), 1)
    knn = (tokens, weights, share)
    dense = torch.zeros(rows, width, dtype=torch.float64).scatter_add_(1, tokens, weights)
    want = (1 - share) * ref(ids, width=width) + share * dense
    assert torch.allclose(ref(ids, width=width, knn=knn), want, atol=1e-15)
    assert torch.allclose(eager.reference_rows(ref, ids, width, ref._check_knn(knn, rows, width)), want, atol=1e-15)
    z = torch.tensor(rng.normal(size=(rows, width)) * 3)
    logx, info = ref.step(ids, z, knn=knn)
    logt, _ = ref.step(ids, z, knn=knn, backend="torch", check_every=1)
    q = want / want.sum(1, keepdim=True)
    share_kl = 1.0 if config.divergence == "kl" else config.kl_share
    logs, _ = solve_toward(z, q, config.lam, config.divergence, kl_share=share_kl)
    finite = torch.isfinite(logx)
    assert torch.equal(finite, torch.isfinite(logt)) and torch.equal(finite, torch.isfinite(logs))
    assert torch.allclose(logx[finite], logt[finite], atol=1e-9)
    assert torch.allclose(logx[finite], logs[finite], atol=1e-9)
    assert float(info.gap.max()) <= 1e-6


def test_bad_knn_rows_are_refused():
    ref = ContextReference(random_counts(10, 0))
    ids, z = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 10)
    good = (torch.zeros(2, 3, dtype=torch.long), torch.full((2, 3), 1 / 3, dtype=torch.float64))
    for knn, match in [((good[0][:1], good[1][:1], 0.5), "rows"), ((good[0] + 10, good[1], 0.5), r"\[0, 10\)"),
                       ((good[0], -good[1], 0.5), ">= 0"), ((good[0], good[1], 1.5), r"\[0, 1\]"),
                       ((good[0].double(), good[1], 0.5), "rows"), ((good[0], 100 * good[1], 0.5), "sum to 1"),
                       ((good[0], good[1] * torch.nan, 0.5), "finite"), ((good[0], good[1], True), "share"),
                       ((good[0], good[1], "0.5"), "share"), ((good[0], good[1]), "tuple"),
                       ((good[0][:, :0], good[1][:, :0], 0.5), "k >= 1")]:
        with pytest.raises(ValueError, match=match):
            ref.step(ids, z, knn=knn)


def _refuse_host_reads(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a host synchronisation on a GPU")

    for name in ("__bool__", "item", "tolist", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", refuse)


@pytest.mark.parametrize("config", CONFIGS)
def test_the_knn_step_on_the_torch_path_reads_no_value_back_to_the_host(monkeypatch, config):
    rng = np.random.default_rng(5)
    ref = ContextReference(random_counts(30, 2), config)
    store = Datastore(rng.normal(size=(200, 6)), rng.integers(0, 33, 200), vocab_size=33)
    ids, hidden = torch.tensor(rng.integers(0, 30, (3, 5))), torch.tensor(rng.normal(size=(3, 6)), dtype=torch.float32)
    z = torch.tensor(rng.normal(size=(3, 33)) * 3)
    tokens, weights = store.distribution(hidden, 16, 2.0)
    expected, _ = ref.step(ids, z, knn=(tokens, weights, 0.4))  # the numba kernel, checked on the host
    _refuse_host_reads(monkeypatch)
    tokens_t, weights_t = store.distribution(hidden, 16, 2.0, sync=False)
    logx, info = ref.step(ids, z, knn=(tokens_t, weights_t, 0.4), backend="torch", check_every=0, max_iter=20)
    monkeypatch.undo()
    assert torch.equal(tokens_t, tokens) and torch.equal(weights_t, weights) and info.converged.all()
    torch.testing.assert_close(logx.exp(), expected.exp(), atol=1e-10, rtol=0)
    # the checks still run, asserted on the device (on the CPU they raise at once)
    for bad, match in [((tokens + 40, weights, 0.4), r"\[0, 33\)"), ((tokens, 2 * weights, 0.4), "sum to 1")]:
        with pytest.raises(RuntimeError, match=match):
            ref.step(ids, z, knn=bad, backend="torch", check_every=0)
    with pytest.raises(RuntimeError, match="not finite"):
        store.distribution(hidden * torch.nan, 16, 2.0, sync=False)
    with pytest.raises(ValueError, match="sum to 1"):  # the numba kernel is handed only rows checked on the host
        ref.step(ids, z, knn=(tokens, 2 * weights, 0.4), backend="numba", check_every=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the device tool lends one to some sessions)")
def test_the_knn_processor_on_cuda_equals_the_cpu_kernel():
    rng = np.random.default_rng(9)
    keys, values = rng.normal(size=(500, 6)), rng.integers(0, 30, 500)
    counts, ids = random_counts(30, 4), torch.tensor(rng.integers(0, 30, (4, 5)))
    z, hidden = torch.tensor(rng.normal(size=(4, 30)) * 3), torch.tensor(rng.normal(size=(4, 6)), dtype=torch.float32)
    tap = HiddenStateTap()
    tap.states = hidden.cuda()
    store = Datastore(keys, values, vocab_size=30, device="cuda", precision="float32")
    proc = KnnContextGraphmaxLogitsProcessor(counts, store, tap, knn_k=32, knn_temperature=2.0, lam=1.5)
    gpu = proc(ids.cuda(), z.cuda())
    tokens, weights = store.distribution(hidden.cuda(), 32, 2.0)
    cpu_tokens, cpu_weights = Datastore(keys, values, vocab_size=30, precision="float32").distribution(hidden, 32, 2.0)
    assert torch.equal(tokens.cpu(), cpu_tokens)  # the same neighbours; their weights up to float32 rounding
    torch.testing.assert_close(weights.cpu(), cpu_weights, atol=1e-5, rtol=0)
    cpu, _ = ContextReference(counts, proc.config).step(ids, z, knn=(tokens.cpu(), weights.cpu(), 0.5))
    assert gpu.device.type == "cuda" and bool(proc.last_info.converged.all())
    torch.testing.assert_close(gpu.exp().cpu(), cpu.exp(), atol=1e-10, rtol=0)


def _processor(**kw):
    counts = random_counts(12, 3)
    store = Datastore(np.random.default_rng(0).normal(size=(40, 4)), np.arange(40) % 12, vocab_size=12)
    tap = HiddenStateTap()
    tap.states = torch.tensor(np.random.default_rng(1).normal(size=(2, 4)), dtype=torch.float32)
    return counts, store, tap, KnnContextGraphmaxLogitsProcessor(counts, store, tap, **kw)


def test_the_knn_processor_solves_toward_the_mix_and_is_softmax_at_lambda_zero():
    counts, store, tap, proc = _processor(lam=0.0)
    ids, z = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.randn(2, 12)
    assert torch.equal(proc(ids, z), ContextGraphmaxLogitsProcessor(counts, lam=0.0)(ids, z))
    _, _, _, proc = _processor(knn_weight=0.4, knn_k=5, knn_temperature=3.0, lam=2.0)
    tokens, weights = store.distribution(tap.last, 5, 3.0)
    q = ContextReference(counts, ContextConfig(lam=2.0))(ids, knn=(tokens, weights, 0.4))
    want, _ = solve_toward(z.double(), q, 2.0, "rkl", kl_share=0.15)
    assert torch.allclose(proc(ids, z).double(), want, atol=1e-6) and float(proc.last_info.gap.max()) <= 1e-6


def test_the_knn_processor_counts_lambda_t_after_its_prompt_length():
    kw = dict(knn_weight=0.4, knn_k=5, knn_temperature=3.0, lam=2.0, lam_decay=0.5, marginal_weight=0.0)
    ids, z = torch.tensor([[7, 8, 9, 1, 2, 3], [7, 8, 9, 4, 5, 6]]), torch.randn(2, 12)
    _, _, _, after = _processor(prompt_length=3, **kw)
    _, _, _, alone = _processor(**kw)
    assert torch.allclose(after(ids, z), alone(ids[:, 3:], z), atol=1e-12, rtol=0)
    assert not torch.allclose(alone(ids, z), alone(ids[:, 3:], z), atol=1e-9, rtol=0)  # (the whole input: another λ_t)
    assert "prompt_length=3" in repr(after) and "prompt_length" not in repr(alone)


@pytest.mark.parametrize("kw, match", [({"knn_weight": 1.5}, "knn_weight"), ({"knn_weight": "0.5"}, "knn_weight"),
                                       ({"knn_weight": -0.1}, "knn_weight"),
                                       ({"knn_k": 0}, "knn_k"), ({"knn_k": 2.5}, "knn_k"),
                                       ({"knn_temperature": 0.0}, "knn_temperature"),
                                       ({"knn_temperature": float("inf")}, "knn_temperature"),
                                       ({"lam": -1.0}, "lam"), ({"ngram_order": 5}, "ngram_order")])
def test_the_knn_processor_validates_every_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        _processor(**kw)


def test_the_knn_processor_refuses_a_wrong_datastore_tap_or_row_count():
    counts, store, tap, proc = _processor()
    with pytest.raises(TypeError, match="datastore"):
        KnnContextGraphmaxLogitsProcessor(counts, "store", tap)
    with pytest.raises(TypeError, match="tap"):
        KnnContextGraphmaxLogitsProcessor(counts, store, object())
    with pytest.raises(ValueError, match="vocabulary"):
        KnnContextGraphmaxLogitsProcessor(counts, Datastore(np.zeros((2, 4)), [0, 20], vocab_size=21), tap)
    with pytest.raises(ValueError, match="rows of scores"):
        proc(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 12))
    with pytest.raises(RuntimeError, match="no forward call"):
        KnnContextGraphmaxLogitsProcessor(counts, store, HiddenStateTap())(torch.zeros(1, 2, dtype=torch.long),
                                                                           torch.zeros(1, 12))


def test_the_engine_neutral_step_takes_the_hidden_states_as_an_input():
    counts, store, tap, proc = _processor(knn_weight=0.4, knn_k=5, knn_temperature=3.0, lam=2.0)
    ids, z = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.randn(2, 12)
    contexts = proc.reference.contexts(ids, torch.zeros(2, dtype=torch.long))
    # each row its own λ and length: the step an engine calls, with the states it holds, equals the tap's
    assert torch.equal(proc.step_rows(contexts, [3, 3], z, hidden=tap.last), proc(ids, z))
    other = proc.step_rows(contexts, [3, 3], z, [2.0, 0.5], hidden=tap.last)
    assert torch.equal(other[0], proc(ids, z)[0]) and not torch.equal(other[1], proc(ids, z)[1])
    with pytest.raises(ValueError, match="got none for 2 rows of scores"):
        proc.step_rows(contexts, [3, 3], z)


def test_a_datastore_without_marginals_refuses_a_marginal_bias_in_one_line():
    store = Datastore(np.eye(3, 2), np.array([0, 1, 1]), vocab_size=2)
    with pytest.raises(DatastoreError, match="no marginals") as err:
        store.marginal_bias(1.0)
    assert "\n" not in str(err.value)
    tap = HiddenStateTap()
    with pytest.raises(DatastoreError, match="no marginals"):
        KnnContextGraphmaxLogitsProcessor(random_counts(2, 0), store, tap, marginal_weight=0.5)
    assert KnnContextGraphmaxLogitsProcessor(random_counts(2, 0), store, tap).marginal_bias is None


@settings(max_examples=30, deadline=None)
@given(config=st.sampled_from(CONFIGS), weight=st.floats(0.05, 2.0), lam=st.sampled_from([0.0, 0.5, 2.0]),
       extra=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_the_marginal_weight_decodes_the_scores_plus_the_bias(config, weight, lam, extra, seed):
    rng = np.random.default_rng(seed)
    vocab = 12
    store = Datastore(rng.normal(size=(40, 4)), rng.integers(0, vocab, 40), vocab_size=vocab,
                      marginals=random_marginals(vocab, 40, seed))
    tap = HiddenStateTap()
    tap.states = torch.tensor(rng.normal(size=(2, 4)), dtype=torch.float32)
    counts = random_counts(vocab + extra, seed)  # graph and scores wider than the datastore's vocabulary: padded ids
    kw = dict(config.to_dict(), lam=lam, knn_k=5, knn_temperature=3.0)
    kw.pop("source")
    ids, z = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor(rng.normal(size=(2, vocab + extra)))
    before = z.clone()
    biased = KnnContextGraphmaxLogitsProcessor(counts, store, tap, marginal_weight=weight, **kw)(ids, z)
    assert torch.equal(z, before)  # the caller's scores are not changed in place
    shifted = z.clone()
    shifted[:, :vocab] += store.marginal_bias(weight).double()
    plain = KnnContextGraphmaxLogitsProcessor(counts, store, tap, **kw)(ids, shifted)
    assert torch.allclose(biased, plain, rtol=0, atol=1e-12)
    if lam == 0:  # a batch of one row gets the bias too, with no search (the tap holds two rows)
        assert torch.equal(KnnContextGraphmaxLogitsProcessor(counts, store, tap, marginal_weight=weight, **kw)(
            ids[:1], z[:1]), plain[:1])


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), "1", True])
def test_the_knn_processor_checks_its_marginal_weight(bad):
    with pytest.raises(ValueError, match="marginal_weight"):
        _processor(marginal_weight=bad)


def test_the_marginal_bias_alone_searches_nothing_and_moves_the_base_decoder(monkeypatch):
    rng = np.random.default_rng(5)
    store = Datastore(rng.normal(size=(40, 4)), rng.integers(0, 12, 40), vocab_size=12,
                      marginals=random_marginals(12, 40))
    counts, tap = random_counts(12, 3), HiddenStateTap()  # the tap holds nothing: reading it would raise
    monkeypatch.setattr(Datastore, "neighbours", lambda *a, **k: pytest.fail("searched at knn_weight=0"))
    with pytest.raises(ValueError, match="`knn_weight` must be a float in \\[0, 1\\]"):
        KnnContextGraphmaxLogitsProcessor(counts, store, tap, knn_weight=-0.1, marginal_weight=0.8, lam=1.5)
    bias = MarginalBiasLogitsProcessor(store, 0.8)
    # at knn_weight=0 the kNN decoder is the bias alone: no search, the tap never read (it holds nothing)
    alone = KnnContextGraphmaxLogitsProcessor(counts, store, tap, knn_weight=0.0, marginal_weight=0.8, lam=1.5)
    proc = LogitsProcessorList([bias, ContextGraphmaxLogitsProcessor(counts, lam=1.5).warmup()])
    ids, z = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.randn(2, 12, dtype=torch.float64)
    before = z.clone()
    want = ContextGraphmaxLogitsProcessor(counts, lam=1.5)(ids, z + store.marginal_bias(0.8).double())
    assert torch.equal(proc(ids, z), want) and torch.equal(z, before)
    assert torch.equal(alone.warmup()(ids, z), want) and torch.equal(z, before)
    assert torch.equal(bias(ids, z[:, :5]), z[:, :5] + store.marginal_bias(0.8)[:5].double())  # narrower scores


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), 11.0, "1", True])
def test_the_marginal_bias_checks_its_weight(bad):
    store = Datastore(np.eye(4, 2), np.array([0, 0, 0, 1]), vocab_size=3, marginals=[1.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="`weight` must be a float in \\(0, 10\\]"):
        MarginalBiasLogitsProcessor(store, bad)
