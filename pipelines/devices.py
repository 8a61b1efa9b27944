"""Where a command runs the LM and its decoders: ``--device`` and ``--dtype``, checked before anything loads.

The default device is the first GPU when torch sees one, else the CPU; the default dtype is bfloat16 on a GPU that
computes in it (Ampere and later), else float32. A device asked for and absent is refused in one line, with the
fix, before a corpus is read or a model is loaded.
"""

from __future__ import annotations

import torch

from gm_graphs import GraphmaxError

__all__ = ["DTYPES", "add_device_arguments", "resolve_device", "resolve_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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

        >>> resolve_dtype(None, torch.device("cpu")), resolve_dtype("bfloat16", torch.device("cpu"))
        (torch.float32, torch.bfloat16)
    """
    if name is None:
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    dtype = name if isinstance(name, torch.dtype) else DTYPES.get(name)
    if dtype not in DTYPES.values():
        raise GraphmaxError(f"--dtype {name!r} is not one graphmax runs a model in; use one of {', '.join(DTYPES)}")
    if dtype == torch.float16 and device.type == "cpu":
        raise GraphmaxError("--dtype float16 on the CPU is slow and overflows; use float32 or bfloat16 there")
    return dtype


def add_device_arguments(parser) -> None:
    """``--device`` and ``--dtype`` on a command that loads a model (checked with :func:`resolve_device` and
    :func:`resolve_dtype` as the command starts)."""
    parser.add_argument("--device", help="where the model and the decoders run: cpu, cuda or cuda:N (default: cuda "
                                          "when torch sees a GPU, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, help="the model's dtype (default: bfloat16 on a GPU that computes "
                                                        "in it, else float32); the decoders solve in float64")
