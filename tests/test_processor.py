"""GraphmaxLogitsProcessor inside generate(): greedy, sampling, beam search, batches, encoder-decoder, real SmolLM2."""

from __future__ import annotations

import pytest
import scipy.sparse as sp
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, LogitsProcessorList, T5Config,
                          T5ForConditionalGeneration, TemperatureLogitsWarper, TopKLogitsWarper)

from gm_solver import GraphmaxLogitsProcessor, graphmax

from .test_solver import random_graph

VOCAB = 64


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def graph():
    # a chain graph: token i is followed by i+1, so graphmax visibly changes decoding
    n = VOCAB
    return sp.csr_matrix(([1.0] * (n - 1), (list(range(n - 1)), list(range(1, n)))), shape=(n, n))


def test_returns_log_probabilities_without_editing_scores(graph):
    proc = GraphmaxLogitsProcessor(graph, lam=1.0)
    scores = torch.randn(2, VOCAB)
    before = scores.clone()
    out = proc(torch.zeros(2, 3, dtype=torch.long), scores)
    assert torch.equal(scores, before) and out is not scores
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(2))
    torch.testing.assert_close(out.exp(), graphmax(scores, graph, 1.0), atol=1e-6, rtol=0)
    assert (proc.last_info.gap <= 1e-6).all()


@pytest.mark.parametrize("kwargs,error", [
    ({"lam": -1.0}, "`lam`"), ({"tol": 0.0}, "`tol`"), ({"solver": "newton"}, "`solver`"),
    ({"max_iter": 0}, "`max_iter`"),
])
def test_arguments_are_validated_in_init(graph, kwargs, error):
    with pytest.raises(ValueError, match=error):
        GraphmaxLogitsProcessor(graph, **kwargs)


def _gen(model, ids, proc, **kw):
    torch.manual_seed(0)
    procs = LogitsProcessorList([proc] if proc else [])
    return model.generate(ids, logits_processor=procs, max_new_tokens=6, min_new_tokens=6, pad_token_id=0, **kw)


def test_greedy_sampling_and_beam_search(tiny_llama, graph):
    ids = torch.tensor([[5, 9, 13]])
    proc = GraphmaxLogitsProcessor(graph, lam=5.0)
    plain = _gen(tiny_llama, ids, None, do_sample=False)
    greedy = _gen(tiny_llama, ids, proc, do_sample=False)
    assert not torch.equal(plain, greedy)  # λ = 5 on a chain graph changes the path
    # λ = 0 reproduces plain decoding exactly
    assert torch.equal(plain, _gen(tiny_llama, ids, GraphmaxLogitsProcessor(graph, lam=0.0), do_sample=False))
    sampled = _gen(tiny_llama, ids, proc, do_sample=True, top_k=10, temperature=0.7)
    assert sampled.shape == (1, 9)
    beams = _gen(tiny_llama, ids, proc, do_sample=False, num_beams=3, num_return_sequences=2)
    assert beams.shape == (2, 9)


def test_warpers_after_graphmax_see_its_log_probabilities(graph):
    scores = torch.randn(1, VOCAB)
    procs = LogitsProcessorList([GraphmaxLogitsProcessor(graph, lam=1.0), TemperatureLogitsWarper(0.5),
                                 TopKLogitsWarper(5)])
    out = procs(torch.zeros(1, 1, dtype=torch.long), scores)
    assert torch.isfinite(out).sum() == 5


def test_batch_with_left_padding_equals_single_rows(tiny_llama, graph):
    proc = GraphmaxLogitsProcessor(graph, lam=2.0)
    a, b = [5, 9, 13, 17], [7, 11]
    batch = torch.tensor([a, [0, 0, *b]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    torch.manual_seed(0)
    out = tiny_llama.generate(batch, attention_mask=mask, logits_processor=LogitsProcessorList([proc]),
                              max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    for row, prompt in zip(out, (a, b)):
        single = _gen(tiny_llama, torch.tensor([prompt]), proc, do_sample=False)
        assert row[-5:].tolist() == single[0, -6:-1].tolist()


def test_encoder_decoder_model(graph):
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(cfg).eval()
    out = _gen(model, torch.tensor([[5, 6, 7]]), GraphmaxLogitsProcessor(graph, lam=1.0), do_sample=False)
    assert out.shape[1] == 7  # start token + 6


def test_padded_model_vocabulary(graph):
    proc = GraphmaxLogitsProcessor(graph, lam=1.0)
    out = proc(torch.zeros(1, 1, dtype=torch.long), torch.randn(1, VOCAB + 16))
    assert out.shape == (1, VOCAB + 16) and abs(float(out.exp().sum()) - 1) < 1e-5


@pytest.mark.slow
def test_real_smollm2_generates_with_the_real_drug_graph(smollm2, drug_graph):
    model, tok = smollm2
    proc = GraphmaxLogitsProcessor(drug_graph, lam=1.0, tokenizer=tok)
    ids = tok(["This medication"], return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate(ids, logits_processor=LogitsProcessorList([proc]), max_new_tokens=4, min_new_tokens=4,
                         do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 4
    assert (proc.last_info.gap <= 1e-6).all()
    assert tok.decode(out[0, ids.shape[1]:]).strip()
