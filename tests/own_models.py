"""A user's own causal LMs, made here offline in a second or two: random-weight ``save_pretrained`` folders of five
architectures, each with a tokenizer of its family trained on a few lines of text.

The three tokenizer families are those users bring:

- ``gpt2``: byte-level BPE with GPT-2's split expression (GPT-2, SmolLM2; the word cache's family);
- ``llama3``: byte-level BPE with Llama-3's expression (digits in runs of three, a letter run may take one
  punctuation character before it), a ``Split`` before a regex-less ``ByteLevel`` (Llama 3, Qwen2);
- ``sentencepiece``: SentencePiece-style BPE with byte fallback: a ``Metaspace`` pre-tokenizer (▁ for spaces) and
  ``<0x00>`` … ``<0xFF>`` for bytes the vocabulary lacks (Llama 2, Mistral, Gemma).

Each tokenizer is saved with ``save_pretrained`` beside the model's ``config.json``; transformers records its class
as ``TokenizersBackend``, so that the folder tokenizes as ``tokenizer.json`` says whatever the model type (a
``tokenizer_config.json`` without a class lets transformers pick one from the model type, and that one may split
differently: :func:`without_tokenizer_class`).

A plain helper module, imported by the test files.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
FAMILIES = ("gpt2", "llama3", "sentencepiece")

_SUBJECTS = ("The patient", "My doctor", "This café", "Our naïve team", "Привет, the nurse", "中文 readers",
             "She", "I", "They")
_VERBS = ("took", "said", "won't stop", "loved", "hated", "found", "it's", "I'll", "we've")
_OBJECTS = ("20mg daily", "the pills in 1999", "12,345 cups", "3.5 stars", "the “quoted” review",
            "side effects — again", "the emoji 👍", "a résumé", "2 weeks of rest")


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` short documents of a drug-review-like language with digits, punctuation, accents, Cyrillic, CJK, emoji,
    double spaces and newlines: the tokenizers' training text, and the tests' corpora (other seeds).

    Args:
        n (``int``): how many documents.
        seed (``int``, defaults to 0): the documents drawn.

    Returns:
        ``list[str]``: the documents.
    """
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        parts = [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
                 for _ in range(rng.randint(1, 3))]
        docs.append(rng.choice(("  ", " ", "\n", " ")).join(parts))
    return docs


def train_tokenizer(family: str, vocab_size: int = 400):
    """A ``tokenizers.Tokenizer`` of ``family`` (one of :data:`FAMILIES`) trained on :func:`sentences`.

    Args:
        family (``str``): ``"gpt2"``, ``"llama3"`` or ``"sentencepiece"``.
        vocab_size (``int``, defaults to 400): the trainer's target (the tiny text may leave it short).

    Returns:
        ``tokenizers.Tokenizer``: byte-level ones have ``<|endoftext|>`` (id 0), the SentencePiece one
        ``<unk>``, ``<s>``, ``</s>`` (ids 0-2) and then the 256 byte tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if family == "sentencepiece":
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        special = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
        trainer = trainers.BpeTrainer(vocab_size=vocab_size + 256, special_tokens=special)
    elif family in ("gpt2", "llama3"):
        tok = Tokenizer(models.BPE())
        if family == "gpt2":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    tok.train_from_iterator(sentences(300), trainer)
    return tok


def fast_tokenizer(family: str):
    """:func:`train_tokenizer`'s tokenizer as a transformers tokenizer, with its BOS, EOS (and UNK) tokens."""
    from transformers import PreTrainedTokenizerFast

    special = (dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>") if family == "sentencepiece"
               else dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>"))
    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(family), **special)


@dataclass(frozen=True)
class OwnModel:
    """One architecture a user may bring: its transformers class, tokenizer family and head.

    Args:
        name (``str``): the test's id.
        family (``str``): the tokenizer family (:data:`FAMILIES`).
        padding (``int``): head rows past the tokenizer (Qwen's head is padded to a multiple of 128).
    """

    name: str
    family: str
    padding: int = 0

    def model(self, vocab_size: int, bos: int, eos: int):
        """A random-weight model (seed 0) with ``vocab_size`` rows in its head: hidden 32, 2 layers."""
        import transformers as tf

        ids = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
        torch.manual_seed(0)
        if self.name == "gpt2":  # its head is tied to the input embeddings
            return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4,
                                                    n_positions=256, tie_word_embeddings=True, **ids))
        common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **ids)
        if self.name == "llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
        if self.name == "qwen2":
            return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False))
        if self.name == "mistral":
            return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=64))
        if self.name == "gemma2":  # soft-capping: logits = c·tanh(logits / c), with c small enough to bite here
            return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=8, query_pre_attn_scalar=8,
                                                        sliding_window=64, final_logit_softcapping=0.5,
                                                        attn_logit_softcapping=50.0))
        raise ValueError(f"no architecture {self.name!r}")


ARCHITECTURES = (
    OwnModel("llama", "llama3"),
    OwnModel("qwen2", "llama3", padding=13),
    OwnModel("mistral", "sentencepiece"),
    OwnModel("gemma2", "sentencepiece"),
    OwnModel("gpt2", "gpt2"),
)


def save_model(arch: OwnModel, folder: Path) -> Path:
    """Write ``arch``'s model and its family's tokenizer to ``folder`` with ``save_pretrained``, as a user's model
    folder is (``config.json``, weights, ``tokenizer.json``, ``tokenizer_config.json``).

    Args:
        arch (``OwnModel``): the architecture.
        folder (``pathlib.Path``): where to write (created).

    Returns:
        ``pathlib.Path``: ``folder``.
    """
    tok = fast_tokenizer(arch.family)
    model = arch.model(len(tok) + arch.padding, tok.bos_token_id, tok.eos_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def saved_tokenizer(family: str, folder: Path, model_type: str | None = None) -> Path:
    """:func:`fast_tokenizer`'s tokenizer saved to ``folder`` without a model; with ``model_type``, beside a
    ``config.json`` naming it and with no tokenizer class, so that transformers loads the class of that model type
    (``"qwen2"``: ``Qwen2Tokenizer``, which rebuilds the pre-tokenizer and adds an NFC normaliser; ``"gpt2"``:
    ``GPT2Tokenizer``).

    Args:
        family (``str``): the tokenizer family (:data:`FAMILIES`).
        folder (``pathlib.Path``): where to write (created).
        model_type (``str`` or ``None``, defaults to ``None``): the model type ``config.json`` names.

    Returns:
        ``pathlib.Path``: ``folder``.
    """
    fast_tokenizer(family).save_pretrained(folder)
    if model_type is not None:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        without_tokenizer_class(folder)
    return folder


def without_tokenizer_class(folder: Path) -> Path:
    """Drop the class ``tokenizer_config.json`` names, as many hub folders have none: transformers then picks the
    tokenizer's class from ``config.json``'s model type, when there is one (and the class may rebuild the
    tokenizer's pipeline its own way).

    Args:
        folder (``pathlib.Path``): a folder :func:`save_model` wrote.

    Returns:
        ``pathlib.Path``: ``folder``.
    """
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.pop("tokenizer_class", None)
    path.write_text(json.dumps(config))
    return folder
