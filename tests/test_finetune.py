"""LoRA fine-tuning within a budget: the loss falls, the caller's model is untouched, the budget holds, runs repeat."""

from __future__ import annotations

import pytest
import torch

from pipelines.finetune import finetune_lora, training_batches

from .helpers import make_docs


@pytest.fixture(scope="module")
def tiny_lm(bpe_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 32-wide matrices: a thread pool only adds waiting, a lot on a busy machine
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(bpe_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    if bpe_tokenizer.pad_token_id is None:
        bpe_tokenizer.pad_token = bpe_tokenizer.eos_token
    yield model, bpe_tokenizer
    torch.set_num_threads(threads)


def lm_loss(model, tok, texts: list[str]) -> float:
    ids, mask, labels = next(training_batches(tok, texts, 24, len(texts), seed=0))
    with torch.no_grad():
        return float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def test_loss_falls_and_the_base_model_is_untouched(tiny_lm):
    model, tok = tiny_lm
    texts = make_docs(40, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = finetune_lora(model, tok, texts, budget_s=600, max_steps=30, seq_len=24, lr=1e-2, progress=False)
    assert result.steps == 30 and len(result.losses) == 30
    assert lm_loss(result.model, tok, texts) < lm_loss(model, tok, texts) - 0.1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert result.model is not model and type(result.model) is type(model)  # the adapter is merged away
    # tokens: every real token after the first of each opening, over the 30 batches the run drew
    batches = training_batches(tok, texts, 24, 8, seed=0)
    drawn = [next(batches)[1] for _ in range(30)]
    assert result.tokens == sum(int(m.sum()) - len(m) for m in drawn)


def test_batches_are_document_openings_each_once_per_epoch(tiny_lm):
    _, tok = tiny_lm
    texts = make_docs(21, seed=5)
    openings = sorted(tuple(tok(t, add_special_tokens=False)["input_ids"][:10]) for t in texts)
    batches = training_batches(tok, texts, 10, 4, seed=7)
    for _ in range(2):  # two epochs, 6 batches each (21 documents, 4 per batch)
        seen = []
        for _ in range(6):
            ids, mask, labels = next(batches)
            assert ids.shape[1] <= 10 and torch.equal(labels == -100, mask == 0)
            seen += [tuple(ids[r, :int(mask[r].sum())].tolist()) for r in range(len(ids))]
        assert sorted(seen) == [o for o in openings if len(o) >= 2]


def test_same_seed_same_weights_other_seed_other_weights(tiny_lm):
    model, tok = tiny_lm
    texts = make_docs(20, seed=4)
    runs = [finetune_lora(model, tok, texts, budget_s=600, max_steps=3, seq_len=16, seed=s, progress=False)
            for s in (1, 1, 2)]
    a, b, c = (r.model.state_dict() for r in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert runs[0].losses == runs[1].losses


@pytest.mark.parametrize("step_seconds", [0.3, 1.0, 2.5])
def test_the_budget_is_respected(tiny_lm, monkeypatch, step_seconds):
    """A fake clock on which each training step costs ``step_seconds`` and everything else nothing."""
    model, tok = tiny_lm
    now = {"t": 0.0}
    real_step = torch.optim.AdamW.step

    def slow_step(self, *args, **kwargs):
        now["t"] += step_seconds
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", slow_step)
    result = finetune_lora(model, tok, make_docs(10), budget_s=5.0, seq_len=12, clock=lambda: now["t"],
                           progress=False)
    assert result.seconds <= 5.0
    # it stops only when one more step would not fit
    assert result.steps == int(5.0 // step_seconds) and result.seconds + step_seconds > 5.0


def test_a_budget_spent_before_the_first_step_still_trains_one(tiny_lm):
    """On a loaded machine the model's copy can take the whole budget: one step still runs, so the merged LM is
    not the base LM under another name."""
    model, tok = tiny_lm
    now = {"t": 0.0}

    def clock():  # every reading 2 s later: the budget of 1 s is gone before the first step
        now["t"] += 2.0
        return now["t"]

    result = finetune_lora(model, tok, make_docs(10), budget_s=1.0, seq_len=12, clock=clock, progress=False)
    assert result.steps == 1 and len(result.losses) == 1
    base, merged = model.state_dict(), result.model.state_dict()
    assert not all(torch.equal(base[k], merged[k]) for k in base)


def test_bad_arguments_are_refused(tiny_lm):
    model, tok = tiny_lm
    with pytest.raises(ValueError, match="budget_s"):
        finetune_lora(model, tok, make_docs(10), budget_s=0, progress=False)
    with pytest.raises(ValueError, match="rank"):
        finetune_lora(model, tok, make_docs(10), budget_s=10, rank=0, progress=False)
    with pytest.raises(ValueError, match="two tokens"):
        finetune_lora(model, tok, ["", "a"], budget_s=10, progress=False)
