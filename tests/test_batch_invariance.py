"""A row decodes as it does alone, whatever else is in its batch: the engine-neutral step
(``ContextReference.contexts`` and ``step(..., lengths=)``) and the transformers processors' ``padding(mask)``, for
every decoder (and the interpolation baseline), with prompts of one token beside long ones, left padding, beams,
examples before the prompts and λ_t decaying with each row's own length."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gm_solver import (
    ContextConfig,
    ContextGraphmaxLogitsProcessor,
    ContextReference,
    Datastore,
    HiddenStateTap,
    InterpolationLogitsProcessor,
    KnnContextGraphmaxLogitsProcessor,
    PaperAlgorithm1LogitsProcessor,
    PaperGraphmaxLogitsProcessor,
)
from pipelines.decoding import TimedLogitsProcessor, padded

from .helpers import random_ngram_graph

N = 40
GRAPH = random_ngram_graph(5, n=N)  # bigram counts and 3- and 4-gram tables
STORE = Datastore(np.random.default_rng(0).normal(size=(30, 4)), np.arange(30) % N, vocab_size=N)


def _decoders() -> dict:
    return {
        "context": lambda: ContextGraphmaxLogitsProcessor(GRAPH, lam=2.0),
        "context, two orders, λ decaying": lambda: ContextGraphmaxLogitsProcessor(
            GRAPH, lam=1.5, order_weights=(1.0, 0.5, 0.25), lam_decay=0.5, divergence="l2", kappa=2.0),
        "context, examples before the prompt": lambda: ContextGraphmaxLogitsProcessor(
            GRAPH, lam=1.0, lam_decay=0.3, prompt_length=2),
        "knn": lambda: KnnContextGraphmaxLogitsProcessor(GRAPH, STORE, HiddenStateTap(), knn_k=4, lam=1.0,
                                                         lam_decay=0.2),
        "interpolation": lambda: InterpolationLogitsProcessor(GRAPH, weight=0.4),
        "paper": lambda: PaperGraphmaxLogitsProcessor(GRAPH.counts, lam=1.0),
        "paper, algorithm 1": lambda: PaperAlgorithm1LogitsProcessor(GRAPH.counts, lam=1.0),
    }


DECODERS = _decoders()


def _step(proc, ids: torch.Tensor, scores: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    if isinstance(proc, KnnContextGraphmaxLogitsProcessor):
        proc.tap.states = hidden
    return proc(ids, scores)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(DECODERS)), lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
       seed=st.integers(0, 2**16))
def test_a_left_padded_row_decodes_as_it_does_alone(name, lengths, seed):
    lengths[0] = 1  # a one-token prompt beside longer ones
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, N, (t,), generator=g) for t in lengths]
    width = max(lengths)
    pad = 7  # a real token id: what the padding holds must never matter
    ids = torch.stack([torch.cat([torch.full((width - len(r),), pad), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]) for r in rows]).long()
    scores = 3 * torch.randn(len(rows), N, generator=g)
    hidden = torch.randn(len(rows), 4, generator=g)
    proc = DECODERS[name]()
    with proc.padding(mask):
        batch = _step(proc, ids, scores, hidden)
    for i, r in enumerate(rows):
        alone = _step(DECODERS[name](), r[None], scores[i:i + 1], hidden[i:i + 1])
        assert torch.equal(batch[i], alone[0]), (name, i, lengths)


def test_without_its_padding_a_short_row_reads_the_pads_and_decodes_otherwise():
    # the test above would pass for a decoder that ignored context altogether: this one shows the padding matters
    proc = ContextGraphmaxLogitsProcessor(GRAPH, lam=3.0)
    first, last = divmod(int(GRAPH.ngrams[3].dense()[0][0]), N)  # a context the trigram table holds
    short = torch.tensor([[last]])
    padded_ids = torch.tensor([[first, first, last]])  # read as context, the pads would find that trigram
    scores = torch.zeros(1, N)
    alone = proc(short, scores)
    assert not torch.equal(proc(padded_ids, scores), alone)
    with proc.padding(torch.tensor([[0, 0, 1]])):
        assert torch.equal(proc(padded_ids, scores), alone)


def test_beams_repeat_each_prompts_padding():
    proc = ContextGraphmaxLogitsProcessor(GRAPH, lam=2.0, lam_decay=0.5)
    ids = torch.tensor([[5, 5, 9], [5, 5, 9], [1, 2, 9], [1, 2, 9]])  # two prompts, two beams each
    scores = torch.randn(4, N, generator=torch.Generator().manual_seed(1))
    with proc.padding(torch.tensor([[0, 0, 1], [1, 1, 1]])):
        out = proc(ids, scores)
    assert torch.equal(out[1], proc(torch.tensor([[9]]), scores[1:2])[0])
    assert torch.equal(out[3], proc(torch.tensor([[1, 2, 9]]), scores[3:4])[0])
    with proc.padding(torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])), \
            pytest.raises(ValueError, match="input_ids has 4 rows but the attention mask given to padding"):
        proc(ids, scores)


@pytest.mark.parametrize("mask, message", [
    (torch.tensor([[1, 1, 0]]), "padded on the left"),
    (torch.tensor([[0, 0, 0]]), "with a token in every row"),
    (torch.tensor([[0, 2, 1]]), "0s and 1s"),
    (torch.tensor([1, 1]), r"\(B, T\) tensor"),
    ([[1, 1]], r"\(B, T\) tensor"),
])
def test_a_mask_that_is_not_left_padding_is_refused_in_one_line(mask, message):
    proc = ContextGraphmaxLogitsProcessor(GRAPH)
    with pytest.raises(ValueError, match=message):
        with proc.padding(mask):
            pass
    assert proc._starts is None


def test_the_padding_is_forgotten_after_the_block_even_when_it_raises():
    proc = ContextGraphmaxLogitsProcessor(GRAPH, lam=2.0)
    ids, scores = torch.tensor([[4, 5, 6]]), torch.zeros(1, N)
    plain = proc(ids, scores)
    with pytest.raises(RuntimeError), proc.padding(torch.tensor([[0, 0, 1]])):
        raise RuntimeError
    assert torch.equal(proc(ids, scores), plain)


def test_generate_helpers_tell_every_graphmax_processor_inside_a_list_or_a_wrapper():
    inner = ContextGraphmaxLogitsProcessor(GRAPH)
    other = ContextGraphmaxLogitsProcessor(GRAPH)
    mask = torch.tensor([[0, 1]])
    with padded([TimedLogitsProcessor(inner), [other], None], mask):
        assert torch.equal(inner._starts, torch.tensor([1])) and torch.equal(other._starts, torch.tensor([1]))
    assert inner._starts is None and other._starts is None


@settings(max_examples=20, deadline=None)
@given(config=st.sampled_from([ContextConfig(lam=2.0), ContextConfig(order_weights=(1.0, 0.4), lam_decay=0.5),
                               ContextConfig(divergence="kl", lam=1.0, kl_share=0.0)]),
       lengths=st.lists(st.integers(1, 12), min_size=1, max_size=5), backend=st.sampled_from(["numba", "torch"]),
       seed=st.integers(0, 2**16))
def test_the_engine_neutral_step_decodes_each_request_as_alone(config, lengths, backend, seed):
    # as a serving engine calls it: each row its own last tokens (−1 before its start) and its own length
    ref = ContextReference(GRAPH, config)
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, N, (t,), generator=g) for t in lengths]
    contexts = torch.stack([ref.contexts(r[None])[0] for r in rows])
    assert contexts.shape == (len(rows), ref.tail)
    scores = 2 * torch.randn(len(rows), N + 3, generator=g)
    together, _ = ref.step(contexts, scores, lengths=lengths, backend=backend)
    for i, r in enumerate(rows):
        alone, _ = ref.step(r[None], scores[i:i + 1], backend=backend)
        assert torch.equal(together[i], alone[0])
