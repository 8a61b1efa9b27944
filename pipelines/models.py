"""Loading causal LMs offline, the bundled SmolLM2-135M by default."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gm_graphs import GraphmaxError, bundled, load_tokenizer
from gm_graphs.errors import TokenizerError

DEFAULT_MODEL = "smollm2"


def load_model(spec: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` from 'smollm2' (bundled GGUF), a .gguf file or a local model folder.

    GGUF weights are dequantised to ``dtype`` by transformers; nothing is downloaded.
    """
    from transformers import AutoModelForCausalLM

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
    model.eval()
    return model, tok
