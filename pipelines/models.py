"""Loading causal LMs offline, the bundled SmolLM2-135M by default."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gm_graphs import GraphmaxError, bundled, load_tokenizer
from gm_graphs.errors import TokenizerError

from .devices import resolve_device, resolve_dtype

DEFAULT_MODEL = "smollm2"


def load_model(spec: str | os.PathLike = DEFAULT_MODEL, *, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None):
    """``(model, tokenizer)`` from 'smollm2' (bundled GGUF), a .gguf file or a local model folder, on ``device``.

    GGUF weights are dequantised to ``dtype`` by transformers; nothing is downloaded.

    Args:
        spec (``str`` or ``os.PathLike``, defaults to ``"smollm2"``): the bundled model, a ``.gguf`` file or a
            ``save_pretrained`` folder of any causal LM transformers knows (Llama, Qwen2, Mistral, Gemma 2, GPT-2…).
        device (``str``, ``torch.device`` or ``None``): ``None``: the first GPU when torch sees one, else the CPU.
        dtype (``str``, ``torch.dtype`` or ``None``): ``None``: bfloat16 on a GPU that computes in it, else float32.

    Returns:
        ``(model, tokenizer)``: the model in eval mode on ``device``; the tokenizer with a pad token (its EOS when
        it has none).

    Raises:
        GraphmaxError: a device this machine lacks, or a model that cannot be loaded (one line, with the fix).
    """
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    path = Path(str(bundled.smollm2_gguf()) if spec == DEFAULT_MODEL else os.fspath(spec))
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {"local_files_only": True}
    folder = str(path.parent) if path.suffix == ".gguf" else str(path)
    try:
        tok = load_tokenizer(path)  # a GGUF file's from graphmax's tokenizer cache; a folder's as transformers reads it
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    except Exception as e:  # transformers raises many kinds here; all mean "cannot load"
        cause = e.__cause__ if isinstance(e, TokenizerError) and e.__cause__ is not None else e  # the fix is ours
        first = str(cause).splitlines()[0] if str(cause) else ""
        raise GraphmaxError(f"cannot load the model {spec!r} ({type(cause).__name__}: {first}); pass 'smollm2', a "
                            f".gguf file or a local model folder (no network)") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.to(device).eval()
    return model, tok


def check_fits(graph, model, tok) -> None:
    """Refuse, in one line with the fix, a model that cannot decode with ``graph``: another vocabulary or another
    split of text (``Graph.check_tokenizer``), or a head narrower than the graph's vocabulary
    (``Graph.check_output_width``; a head padded past it is fine)."""
    graph.check_tokenizer(tok)
    head = model.get_output_embeddings()
    graph.check_output_width(int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size))
