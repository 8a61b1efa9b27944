"""Where a command runs the LM and its decoders: ``--device`` and ``--dtype``, checked before anything loads.

The default device is the first GPU when torch sees one, else the CPU; the default dtype is bfloat16 on a GPU that
computes in it (Ampere and later), else float32. A device asked for and absent is refused in one line, with the
fix, before a corpus is read or a model is loaded.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from typing import TYPE_CHECKING

from gm_graphs import GraphmaxError

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "add_device_arguments", "device_error", "resolve_device",  # noqa: F822
           "resolve_dtype"]

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # --dtype's choices; DTYPES maps them to torch's dtypes
# the device types torch knows besides cpu and cuda: graphmax refuses them as devices it does not run on
OTHER_TORCH_DEVICES = ("mps", "xpu", "xla", "meta", "hip", "ipu", "mkldnn", "opengl", "opencl", "ideep", "ve", "fpga",
                       "maia", "mtia", "lazy", "vulkan", "hpu", "privateuseone")


def __getattr__(name: str):
    if name == "DTYPES":  # {name: torch.dtype}; torch is imported only when it is asked for
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_device(name: str | torch.device | None = None) -> torch.device:
    """The device ``name`` asks for, checked on this machine; ``None``: ``cuda`` when available, else ``cpu``.

    Args:
        name (``str``, ``torch.device`` or ``None``): e.g. ``"cpu"``, ``"cuda"``, ``"cuda:1"``.

    Returns:
        ``torch.device``: with its index for a GPU (``cuda:0`` for ``cuda``), so that tensors compare equal.

    Raises:
        GraphmaxError: a name torch does not know, a CPU index other than 0, or a GPU this machine does not have
            (one line, with the fix).

    Example::

        >>> resolve_device("cpu")
        device(type='cpu')
    """
    import torch

    if name is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise GraphmaxError(f"--device {name!r} is not a device torch knows; use 'cpu', 'cuda' or 'cuda:N'") from e
    if device.type == "cpu":
        if device.index not in (None, 0):  # torch runs on every core as the one device cpu (cpu:0)
            raise GraphmaxError(f"--device {name!r}: the CPU is one device, with no index {device.index} (torch "
                                f"uses every core on it); use --device cpu")
        return torch.device("cpu")
    if device.type != "cuda":
        raise GraphmaxError(f"--device {name!r}: graphmax runs on 'cpu' or 'cuda' devices; use one of them")
    if not torch.cuda.is_available():
        built = f"torch {torch.__version__} " + ("has no CUDA support" if torch.version.cuda is None
                                                  else "sees no GPU (CUDA_VISIBLE_DEVICES, driver)")
        raise GraphmaxError(f"--device {name!r} but CUDA is not available here ({built}); use --device cpu")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise GraphmaxError(f"--device {name!r} but this machine has {torch.cuda.device_count()} GPU(s), "
                            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}; pick one of them")
    return torch.device("cuda", index)


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The model's dtype: ``name`` (a key of :data:`DTYPES` or a ``torch.dtype``), else bfloat16 on a GPU that
    computes in it and float32 elsewhere.

    Args:
        name (``str``, ``torch.dtype`` or ``None``): ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device (``torch.device``): where the model will run (:func:`resolve_device`).

    Returns:
        ``torch.dtype``.

    Raises:
        GraphmaxError: another dtype, or float16 on the CPU (where torch computes it slowly and overflows easily).

    Example::

        >>> import torch
        >>> resolve_dtype(None, torch.device("cpu")), resolve_dtype("bfloat16", torch.device("cpu"))
        (torch.float32, torch.bfloat16)
    """
    import torch

    if name is None:
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    dtypes = __getattr__("DTYPES")
    dtype = name if isinstance(name, torch.dtype) else dtypes.get(name)
    if dtype not in dtypes.values():
        raise GraphmaxError(f"--dtype {name!r} is not one graphmax runs a model in; use one of "
                            f"{', '.join(DTYPE_NAMES)}")
    if dtype == torch.float16 and device.type == "cpu":
        raise GraphmaxError("--dtype float16 on the CPU is slow and overflows; use float32 or bfloat16 there")
    return dtype


def add_device_arguments(parser) -> None:
    """``--device`` and ``--dtype`` on a command that loads a model (checked with :func:`resolve_device` and
    :func:`resolve_dtype` as the command starts)."""
    parser.add_argument("--device", help="where the model and the decoders run: cpu, cuda or cuda:N (default: cuda "
                                          "when torch sees a GPU, else cpu)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, help="the model's dtype (default: bfloat16 on a GPU that "
                                                             "computes in it, else float32); the decoders solve in "
                                                             "float64")


def device_error(args) -> str | None:
    """What is wrong with ``args.device`` and ``args.dtype`` that can be told without loading torch, or None.

    Checked as the command line is parsed (``pipelines.cli``), so that these refusals come before torch's and
    transformers' seconds of importing: a name that is not ``cpu``, ``cpu:0``, ``cuda`` or ``cuda:N``; ``cuda`` with a
    torch built without CUDA (read from ``torch/version.py``, which does not import torch) or with
    ``CUDA_VISIBLE_DEVICES`` hiding every GPU; float16 on the CPU. The rest (how many GPUs there are) is
    :func:`resolve_device`'s, as the command starts; so is all of it where torch is imported already.
    """
    name, dtype = getattr(args, "device", None), getattr(args, "dtype", None)
    if name is None and dtype is None:
        return None
    if "torch" in sys.modules:  # imported already: nothing to save; the command's resolve_device says it all
        return None
    try:
        _static_device_checks(name, dtype)
    except GraphmaxError as e:
        return str(e)
    return None


def _static_device_checks(name: str | None, dtype: str | None) -> None:
    match = re.fullmatch(r"([a-z_]+)(?::(\d+))?", name or "")
    if name is not None:
        kind = match and match.group(1)
        if kind not in ("cpu", "cuda"):
            if kind in OTHER_TORCH_DEVICES:
                raise GraphmaxError(f"--device {name!r}: graphmax runs on 'cpu' or 'cuda' devices; use one of them")
            raise GraphmaxError(f"--device {name!r} is not a device torch knows; use 'cpu', 'cuda' or 'cuda:N'")
        index = None if match.group(2) is None else int(match.group(2))
        if kind == "cpu" and index not in (None, 0):
            raise GraphmaxError(f"--device {name!r}: the CPU is one device, with no index {index} (torch uses every "
                                f"core on it); use --device cpu")
        if kind == "cuda":
            build = _torch_build()
            if build is not None and build.get("cuda") is None and build.get("hip") is None:
                raise GraphmaxError(f"--device {name!r} but CUDA is not available here (torch "
                                    f"{build.get('__version__')} has no CUDA support); use --device cpu")
            if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
                raise GraphmaxError(f"--device {name!r} but CUDA is not available here (CUDA_VISIBLE_DEVICES hides "
                                    f"every GPU); use --device cpu")
    cpu = name is not None and match is not None and match.group(1) == "cpu"
    if dtype == "float16" and (cpu or name is None and _torch_build(missing={}).get("cuda", 0) is None):
        raise GraphmaxError("--dtype float16 on the CPU is slow and overflows; use float32 or bfloat16 there")


def _torch_build(missing=None) -> dict | None:
    """torch's ``version.py`` (``__version__``, ``cuda``, ``hip``), read as text without importing torch; ``missing``
    where it cannot be read."""
    try:
        spec = importlib.util.find_spec("torch")
        folder = spec.submodule_search_locations[0]
        with open(os.path.join(folder, "version.py"), encoding="utf-8") as fh:
            text = fh.read()
    except (ImportError, AttributeError, IndexError, TypeError, OSError, ValueError):
        return missing
    build = {}
    for key in ("__version__", "cuda", "hip"):
        found = re.search(rf"^{re.escape(key)}\s*(?::[^=]*)?=\s*(.+)$", text, re.MULTILINE)
        if found is None:
            return missing
        value = found.group(1).strip()
        build[key] = None if value == "None" else value.strip("'\"")
    return build
