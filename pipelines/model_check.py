"""A model folder checked against its weights before transformers builds the model.

transformers builds the model its ``config.json`` describes and then fills it from the weights: a weight the file
lacks is initialised at random, with a "MISSING" report as the only sign, and a config that claims 10⁹ layers makes
it build layers one by one until memory runs out. :func:`check_model_folder` reads ``config.json`` and the
safetensors headers (8 bytes of length and a JSON table of names, dtypes and shapes: no tensor is read), builds the
model on torch's ``meta`` device (shapes without memory) and refuses, in one line naming the fix:

- a config that claims more than :data:`MAX_LAYERS` layers, before anything is built;
- a ``model_type`` whose weights are not the file's (``bert`` over Llama weights: none of the names match);
- a config with more layers than the weights hold, or any weight the config expects that the file lacks (a head
  tied to the input embeddings aside), or holds in another shape.

A folder with no safetensors file (``pytorch_model.bin``) is checked for its layer count alone.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from gm_graphs import GraphmaxError

MAX_LAYERS = 1024  # the largest causal LMs have ~130 layers; a config claiming more is not a model's
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_MAX_CONFIG = 1 << 20  # bytes of config.json
_MAX_HEADER = 100 << 20  # bytes of a safetensors header (safetensors' own limit)
_LAYER = re.compile(r"\.(\d+)\.")  # the layer index in a weight's name: model.layers.3.…, transformer.h.3.…


def _refuse(folder: Path, what: str, fix: str) -> GraphmaxError:
    return GraphmaxError(f"the model folder {os.fsdecode(folder)}: {what}; {fix}")


def _layer_counts(config: object) -> list[tuple[str, int]]:
    """Each layer count ``config.json`` states (top level and nested configs such as ``text_config``)."""
    found = []
    if isinstance(config, dict):
        for key, value in config.items():
            if key in _LAYER_KEYS and isinstance(value, int) and not isinstance(value, bool):
                found.append((key, value))
            elif isinstance(value, dict):
                found.extend(_layer_counts(value))
    return found


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors of a safetensors file, by name: their shapes, read from its header alone.

    Args:
        path (``pathlib.Path``): a ``.safetensors`` file.

    Returns:
        ``dict[str, tuple[int, ...]]``: each tensor's shape.

    Raises:
        GraphmaxError: the file is not a whole safetensors file (one line, with the fix).

    Example::

        >>> import tempfile, torch; from safetensors.torch import save_file
        >>> path = Path(tempfile.mkdtemp()) / "w.safetensors"
        >>> save_file({"a.weight": torch.zeros(2, 3)}, path)
        >>> read_header(path)
        {'a.weight': (2, 3)}
    """
    bad = f"{os.fsdecode(path)} is not a whole safetensors file"
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if length is None or length > min(_MAX_HEADER, size - 8):
                raise GraphmaxError(f"{bad} (its header's length is wrong); save the model again")
            table = json.loads(f.read(length))
    except (OSError, ValueError) as e:
        raise GraphmaxError(f"{bad} ({type(e).__name__}: {e}); save the model again") from None
    shapes = {}
    for name, entry in table.items() if isinstance(table, dict) else ():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if name != "__metadata__":
            if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
                raise GraphmaxError(f"{bad} (tensor {name!r} has no shape); save the model again")
            shapes[name] = tuple(shape)
    return shapes


def _weights(folder: Path) -> tuple[dict[str, tuple[int, ...]], str] | None:
    """The shapes of every tensor in the folder's safetensors file(s), and the file's name for messages; None
    where there is none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise _refuse(folder, f"{index.name} is not a safetensors index", "save the model again") from None
        shapes = {}
        for shard in shards:
            if Path(shard).name != shard:
                raise _refuse(folder, f"{index.name} names a file outside the folder ({shard!r})",
                              "save the model again")
            shapes.update(read_header(folder / shard))
        return shapes, index.name
    single = folder / "model.safetensors"
    return (read_header(single), single.name) if single.is_file() else None


def check_model_folder(folder: str | os.PathLike) -> None:
    """Refuse a ``save_pretrained`` model folder whose ``config.json`` the weights do not fill, before the model is
    built (module docstring).

    Args:
        folder (``str`` or ``os.PathLike``): the model folder.

    Raises:
        GraphmaxError: one line naming what disagrees and the fix.

    Example::

        >>> import tempfile; from transformers import LlamaConfig, LlamaForCausalLM
        >>> folder = Path(tempfile.mkdtemp())
        >>> LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...                              num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
        >>> check_model_folder(folder)  # the weights fill the config
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    fix = "put the config.json saved with these weights beside them (save_pretrained writes both)"
    try:
        with open(folder / "config.json", "rb") as f:
            raw = json.loads(f.read(_MAX_CONFIG + 1))
    except (OSError, ValueError):
        return  # no config to check: transformers says what is wrong with the folder
    for key, layers in _layer_counts(raw):
        if layers > MAX_LAYERS:
            raise _refuse(folder, f"config.json claims {layers:,} layers ({key}), more than any model has (at most "
                                  f"{MAX_LAYERS} here)", fix)
    weights = _weights(folder)
    if weights is None:
        return
    shapes, file = weights
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with torch.device("meta"):  # shapes, no memory
        model = AutoModelForCausalLM.from_config(config)
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    expected = dict((name, tuple(p.shape)) for name, p in model.named_parameters())  # a tied head once
    found = {}
    for name in expected:  # a base model's file holds the names without the prefix
        key = name if name in shapes else name.removeprefix(prefix) if name.removeprefix(prefix) in shapes else None
        if key is not None:
            found[name] = shapes[key]
    kind = f"{raw.get('model_type')!r} ({type(model).__name__})"
    if not found:
        example = next(iter(sorted(shapes)), "nothing")
        raise _refuse(folder, f"config.json's model_type {kind} expects weights of which {file} holds none (it holds "
                              f"e.g. {example!r}): the config is another architecture's", fix)
    missing = [name for name in expected if name not in found]
    layers_expected = {m[1] for name in expected if (m := _LAYER.search(name))}
    layers_found = {m[1] for name in found if (m := _LAYER.search(name))}
    if len(layers_expected) > len(layers_found):
        raise _refuse(folder, f"config.json names {len(layers_expected)} layers but {file} holds weights for "
                              f"{len(layers_found)}; transformers would fill the others with random weights",
                      f"{fix}, or set its layer count to {len(layers_found)}")
    if missing:
        raise _refuse(folder, f"{file} lacks {len(missing)} weight(s) that config.json's {kind} expects (e.g. "
                              f"{missing[0]!r}); transformers would initialise them at random", fix)
    for name, shape in expected.items():
        if found[name] != shape:
            raise _refuse(folder, f"weight {name!r} is {found[name]} in {file}, but config.json makes it {shape}", fix)
