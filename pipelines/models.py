"""Loading causal LMs offline, the bundled SmolLM2-135M by default."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from gm_graphs import GraphmaxError, bundled
from gm_graphs.errors import TokenizerError

from . import model_cache
from .args import model_error
from .devices import resolve_device, resolve_dtype
from .model_check import check_model_folder

if TYPE_CHECKING:  # torch and transformers are imported by what loads a model, not by the parsers that import this
    import torch

DEFAULT_MODEL = "smollm2"
# what loading any model imports: torch, and transformers' model code (which brings its generation, its
# integrations, torch._dynamo and scipy.optimize with it)
MODEL_LIBRARIES = ("torch", "transformers.modeling_utils")


def import_model_libraries(*, keep: bool = False) -> None:
    """Import torch and transformers' model code (:data:`MODEL_LIBRARIES`) with Python's cyclic collector paused.

    These imports make some 370,000 objects that live as long as the process, and none of them is garbage. The
    collector makes a full pass each time the long-lived objects have grown by a quarter, so it would scan them
    about five times while they are made, and three times more once it runs again (each young generation, then
    the oldest): over a second of the 2.6 s these imports take on two cores (``benchmarks/first_use.py``). Once
    imported, they are moved to the oldest generation, which only the full passes scan (unless the process has
    frozen objects of its own, which that move would thaw); imported already, nothing is done.

    Args:
        keep (``bool``, defaults to ``False``): the process keeps these libraries to its end and owns its
            collector (the command line, :mod:`pipelines.cli`): every object alive is frozen (``gc.freeze``),
            never scanned again, not even at exit.
    """
    if all(name in sys.modules for name in MODEL_LIBRARIES):
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in MODEL_LIBRARIES:
            importlib.import_module(name)
    finally:
        if keep:
            gc.freeze()
        elif gc.get_freeze_count() == 0:  # (a caller's own frozen objects would be thawed with them)
            gc.freeze()
            gc.unfreeze()  # into the oldest generation: collected as before, by the full passes
        if enabled:
            gc.enable()


def _spec_path(spec: str | os.PathLike) -> Path:
    return Path(str(bundled.smollm2_gguf()) if spec == DEFAULT_MODEL else os.fspath(spec))


def load_model(spec: str | os.PathLike = DEFAULT_MODEL, *, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None):
    """``(model, tokenizer)`` from 'smollm2' (bundled GGUF), a .gguf file or a local model folder, on ``device``.

    A GGUF file is converted once into graphmax's model cache (:mod:`pipelines.model_cache`), which later loads
    read in about a second; the model is the one transformers makes from the GGUF file, bit for bit. Nothing is
    downloaded.

    Args:
        spec (``str`` or ``os.PathLike``, defaults to ``"smollm2"``): the bundled model, a ``.gguf`` file or a
            ``save_pretrained`` folder of any causal LM transformers knows (Llama, Qwen2, Mistral, Gemma 2, GPT-2…).
        device (``str``, ``torch.device`` or ``None``): ``None``: the first GPU when torch sees one, else the CPU.
        dtype (``str``, ``torch.dtype`` or ``None``): ``None``: bfloat16 on a GPU that computes in it, else float32.

    Returns:
        ``(model, tokenizer)``: the model in eval mode on ``device``; the tokenizer with a pad token (its EOS when
        it has none).

    Raises:
        GraphmaxError: a device this machine lacks, a model folder without a tokenizer or whose ``config.json`` its
            weights do not fill (:func:`pipelines.model_check.check_model_folder`, before the model is built), or a
            model that cannot be loaded (one line, with the fix).
    """
    from gm_graphs import load_tokenizer

    path = _spec_path(spec)
    if path.suffix != ".gguf":  # a folder: what the CLI refuses while parsing
        problem = model_error(argparse.Namespace(model=os.fspath(path)))
        if problem is not None:
            raise GraphmaxError(problem.removeprefix("argument --model: "))
    import_model_libraries()
    if path.suffix != ".gguf" and path.is_dir():  # its config against its weights, before the model is built
        check_model_folder(path)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    try:
        if path.suffix == ".gguf":
            from gm_graphs.tokenize.gguf import read_once

            with read_once():  # one reader of the file for its tokenizer, config and weights, where any is converted
                model, tok = _load_gguf(path, dtype)
        else:
            from transformers import AutoModelForCausalLM

            tok = load_tokenizer(path)
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    except Exception as e:  # transformers raises many kinds here; all mean "cannot load"
        raise _cannot_load(spec, e) from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.to(device).eval()
    return model, tok


def _cannot_load(spec, e: Exception) -> GraphmaxError:
    cause = e.__cause__ if isinstance(e, TokenizerError) and e.__cause__ is not None else e  # the fix is ours
    first = str(cause).splitlines()[0] if str(cause) else ""
    return GraphmaxError(f"cannot load the model {os.fspath(spec)!r} ({type(cause).__name__}: {first}); pass "
                         f"'smollm2', a .gguf file or a local model folder (no network)")


_warned = False  # a cache that cannot be written once cannot be written again: one warning per process


def _load_gguf(path: Path, dtype: torch.dtype):
    """The GGUF file's model, through the model cache, and its tokenizer (from the tokenizer cache). Where the
    model cache cannot be written, the model is read from the GGUF file with one warning per process, which also
    stands for the tokenizer cache's (both live in ``$GRAPHMAX_HOME``)."""
    global _warned
    import torch
    from transformers import AutoModelForCausalLM

    from gm_graphs import load_tokenizer

    with warnings.catch_warnings(record=True) as tokenizer_warnings:
        warnings.simplefilter("always")
        tok = load_tokenizer(path)
    try:
        with model_cache.cached_entry(path) as entry:
            model = AutoModelForCausalLM.from_pretrained(str(entry.read_path), dtype=dtype, local_files_only=True)
        model.name_or_path = model.config.name_or_path = str(path)  # not the descriptor's path it was read through
        for w in tokenizer_warnings:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return model, tok
    except model_cache.CacheUnwritable as failed:
        if not _warned:
            _warned = True
            ignored = f" (the entry there {failed.ignored})" if failed.ignored else ""
            warnings.warn(f"graphmax cannot cache the model {path}: writing in {failed.where} failed "
                          f"({failed.why}){ignored}; it is read from the GGUF file at each load (several seconds) "
                          f"until it can be; free space there or make it writable, or set GRAPHMAX_HOME to a writable "
                          f"folder", RuntimeWarning, stacklevel=3)
        if failed.model is not None and dtype == torch.float32:
            model = failed.model  # converted in float32 already
        else:
            model = model_cache.load_gguf(path, dtype)
        model.name_or_path = model.config.name_or_path = str(path)
        return model, tok


def model_folder(spec: str | os.PathLike = DEFAULT_MODEL) -> Path:
    """A ``save_pretrained`` folder holding the model and tokenizer of ``spec``, for a library that reads folders
    (vLLM): a GGUF file's entry in the model cache (converted first when it has none), or the folder given.

    Args:
        spec (``str`` or ``os.PathLike``, defaults to ``"smollm2"``): the bundled model, a ``.gguf`` file or a
            ``save_pretrained`` folder.

    Returns:
        ``pathlib.Path``: the folder; a GGUF file's holds ``config.json``, ``model.safetensors`` (float32) and the
        tokenizer's files.

    Raises:
        GraphmaxError: no such file or folder, a GGUF file that cannot be read, or a model cache that cannot be
            written (one line, with the fix).

    Example::

        >>> folder = model_folder("smollm2")  # doctest: +SKIP
        >>> sorted(p.name for p in folder.glob("*.json"))  # doctest: +SKIP
        ['config.json', 'generation_config.json', 'graphmax-model.json', 'tokenizer.json', 'tokenizer_config.json']
    """
    path = _spec_path(spec)
    if path.suffix != ".gguf":
        if not path.is_dir():
            raise GraphmaxError(f"no model folder at {str(path)!r}; pass 'smollm2', a .gguf file or a folder that "
                                f"save_pretrained wrote")
        return path
    try:
        with model_cache.cached_entry(path) as entry:
            return entry.path
    except model_cache.CacheUnwritable as failed:
        raise GraphmaxError(f"cannot write the model cache in {failed.where} ({failed.why}); free space there or "
                            f"make it writable, or set GRAPHMAX_HOME to a writable folder") from None
    except Exception as e:  # transformers raises many kinds for a GGUF file it cannot read
        raise _cannot_load(spec, e) from e


def check_fits(graph, model, tok) -> None:
    """Refuse, in one line with the fix, a model that cannot decode with ``graph``: another vocabulary or another
    split of text (``Graph.check_tokenizer``), or a head narrower than the graph's vocabulary
    (``Graph.check_output_width``; a head padded past it is fine)."""
    graph.check_tokenizer(tok)
    head = model.get_output_embeddings()
    graph.check_output_width(int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size))
