"""Loading causal LMs offline, the bundled SmolLM2-135M by default."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gm_graphs import GraphmaxError, bundled, load_tokenizer

DEFAULT_MODEL = "smollm2"


def load_model(spec: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from 'smollm2' (bundled GGUF), a .gguf file or a local model folder.

    GGUF weights are dequantised to ``dtype`` by transformers; nothing is downloaded.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(str(bundled.smollm2_gguf()) if spec == DEFAULT_MODEL else os.fspath(spec))
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {"local_files_only": True}
    folder = str(path.parent) if path.suffix == ".gguf" else str(path)
    try:
        tok = load_tokenizer(path) if path.suffix == ".gguf" else AutoTokenizer.from_pretrained(folder, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    except Exception as e:  # transformers raises many kinds here; all mean "cannot load"
        raise GraphmaxError(f"cannot load the model {spec!r} ({type(e).__name__}: {e}); pass 'smollm2', a .gguf "
                            f"file or a local model folder (no network)") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok
