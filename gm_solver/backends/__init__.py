"""Where a solve runs: one room per backend, each with the same operations, and one chooser.

Every solve graphmax offers is built from a few operations, and each backend implements every one of them with one
signature (``numba`` in ``backends/numba/``, ``torch`` in ``backends/eager.py``, ``fused`` in ``backends/fused.py``):

=====================  ==========================================================================================
operation              what it computes
=====================  ==========================================================================================
``reference_rows``     q(· | context) for each row: the context decoders' reference (``ContextReference``)
``solve_rows``         log x toward given rows q, with the certificate per row (``divergences.solve_toward``)
``context_step``       both at once, one decoding step of the context decoders
``csr_product``        M·v or base − M·v for the rows of a batch (``TransitionOperator``)
``mirror_start``,      the paper decoder's certified mirror descent (``solvers.mirror_descent``): its start, the
``mirror_score``,      score (f, gap) of a point, and one step
``mirror_step``
=====================  ==========================================================================================

- **numba**: CPU kernels in float64, every row in one call, a step stops at its certificate.
- **torch**: eager torch on any device and dtype: the same steps as the kernels, all rows at once.
- **fused**: the torch backend's own operations compiled by ``torch.compile`` (CUDA with Triton): a few fused
  kernels instead of hundreds of launches. It is used once a decoder's ``warmup()`` has paid the compile.

:func:`choose` is the one place a backend is picked from the device, the dtype and what the caller asked for, and
:data:`DEFAULTS` the one place the step budgets and the host synchronisation are set.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

BACKENDS = ("numba", "torch", "fused")
REQUESTS = ("auto", *BACKENDS)


@dataclass(frozen=True)
class Defaults:
    """The step budgets and the host synchronisation of the solves where they run.

    Args:
        nu_steps (``int``): ν steps per row at most (the Lambert solves: ``solve_rows``, ``context_step``).
        check_every (``int``): steps between the checks that read the rows' convergence back to the host; 0 reads
            nothing back: every row takes the budget's steps, frozen once converged (a step free of host
            synchronisation, safe to capture in a CUDA graph).
        mirror_check_every (``int``): the same for the paper decoder's mirror steps, whose rows take from one to
            hundreds of steps: a fixed budget would pay for the slowest row at every step.
    """

    nu_steps: int
    check_every: int
    mirror_check_every: int


#: On the CPU a check costs nothing and the kernels stop each row at its certificate. On a GPU the ν solve takes a
#: fixed 8 steps with no read-back (the context decoders' step on an H100: the safeguarded Newton steps converge
#: within them), and the mirror descent reads its gaps back every 8 steps.
DEFAULTS = {"cpu": Defaults(nu_steps=60, check_every=1, mirror_check_every=1),
            "device": Defaults(nu_steps=8, check_every=0, mirror_check_every=8)}


def defaults(device: torch.device) -> Defaults:
    """:data:`DEFAULTS` for ``device``: the CPU's, or every other device's.

    Example::

        >>> defaults(torch.device("cpu")).nu_steps
        60
    """
    return DEFAULTS["cpu" if device.type == "cpu" else "device"]


def check_request(request: str) -> None:
    """Refuse a backend name that is not ``"auto"`` or one of :data:`BACKENDS`, in one line."""
    if request not in REQUESTS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, REQUESTS))}, got {request!r}")


def choose(device: torch.device, request: str = "auto", *, float64_only: bool = False, fused: bool = False,
           reads_back: bool = False) -> str:
    """The backend that runs an operation on ``device``: the one place a backend is picked.

    ``"auto"`` takes numba on the CPU (where ``float64_only`` says the operation's numba half takes float64 alone
    and the input is another dtype, torch instead). Elsewhere, and for ``"torch"`` asked for by name or resolved so
    by an operator, it takes torch's steps compiled (fused) where the caller has them on (``fused``: a warmed-up
    decoder, or by hand) and they compile, eager torch otherwise. A step that reads values back to the host within
    itself (``reads_back``) is never the compiled one. A named backend is refused in one line where it cannot run.

    Args:
        device (``torch.device``): where the operation's tensors are.
        request (``str``, defaults to ``"auto"``): ``"auto"`` or one of :data:`BACKENDS`.
        float64_only (``bool``, defaults to ``False``): the input is not float64 and the numba half would need it.
        fused (``bool``, defaults to ``False``): the caller has its compiled steps on (a decoder's ``use_fused``).
        reads_back (``bool``, defaults to ``False``): the step reads values back within itself (the compiled one
            traces a single shape and reads nothing back).

    Returns:
        ``str``: one of :data:`BACKENDS`.

    Example::

        >>> choose(torch.device("cpu")), choose(torch.device("cpu"), "torch")
        ('numba', 'torch')
        >>> choose(torch.device("cpu"), "fused")
        Traceback (most recent call last):
        ValueError: the fused backend compiles for a CUDA device with Triton, not cpu; use backend='torch' or 'auto'
    """
    check_request(request)
    cpu = device.type == "cpu"
    if request == "numba" and not cpu:
        raise ValueError(f"the numba backend runs on the CPU, the tensors are on {device}; use backend='torch'")
    if request == "numba" and float64_only:
        raise ValueError("the numba kernel takes float64 CPU tensors; use backend='torch' for other dtypes")
    if request == "fused" and not fused_available(device):
        raise ValueError(f"the fused backend compiles for a CUDA device with Triton, not {device}; "
                         f"use backend='torch' or 'auto'")
    if request == "numba":
        return "numba"
    if request == "auto" and cpu and not float64_only:
        return "numba" if _numba_ready() else "torch"
    compiled = request == "fused" or (fused and fused_available(device))
    return "fused" if compiled and not reads_back else "torch"


#: the numba kernels the decoders' steps call first (``gm_solver.backends.numba``'s ``module.kernel``), which
#: ``pipelines.warm`` compiles: the context decoders' step, and the paper decoder's CSR product and mirror start.
#: Cached, a step loads them in about a second instead of compiling them for minutes.
ENTRY_KERNELS = ("context.decode_step", "csr.product", "mirror.start_rows")
_quick = {"command": None, "kernels": ENTRY_KERNELS, "ready": None, "threads": None, "numba_threads": None}


@contextlib.contextmanager
def compile_in_background(command: list[str], kernels: tuple[str, ...] = ENTRY_KERNELS) -> Iterator[None]:
    """Inside this block, :func:`choose`'s ``"auto"`` takes numba on the CPU only where the kernels the run's
    decoders call first (``kernels``) are in the kernel cache already; where they are not (a first run after
    installing), it takes torch, which needs no compiling, prints one line saying so, and starts ``command``
    detached (a process that compiles them into the cache, e.g. ``python -m pipelines.warm --background``) for the
    next run. Outside it, numba compiles where it is first called, as a library's caller expects. Decided once per
    block, so that a run does not switch backends between steps.

    Only the run's own kernels count: a run of the context decoder takes numba once its step is cached, whether or
    not the paper decoder's kernels are. The cache is read through graphmax's own sealed files
    (``gm_graphs.store.kernel_cache.kernel_cached``); one that is damaged or another user's is a miss.

    While such a compile runs (started here, or by an earlier run and still holding :func:`compile_lock`), torch's
    threads and numba's (those of the thread that entered the block, where the command line decodes) are one fewer
    than the cores inside the block, and are restored after it: a team of threads one of which waits for the core
    the compile holds stalls at every operation. Measured on 2 cores
    (``benchmarks/first_use.py``): the torch step 1.5 s a token on 2 threads beside the compile, 75 ms on 1; the
    numba step (its kernels compiled, others still compiling) 358 ms a token on 2 threads, 63 ms on 1.

    Args:
        command (``list[str]``): the compiling process' command line.
        kernels (``tuple[str, ...]``, defaults to :data:`ENTRY_KERNELS`): the kernels the run's decoders call first,
            as ``"module.kernel"`` of ``gm_solver.backends.numba`` (a decoder's ``kernels``), e.g.
            ``("context.decode_step",)`` for the context decoder, ``("csr.product", "mirror.start_rows")`` for the
            paper one; ``()``: none, numba as outside the block.

    Raises:
        ValueError: a name in ``kernels`` that is not ``"module.kernel"`` (at the block's start), or not a kernel of
            the numba backend (where it is first checked).

    Example::

        >>> with compile_in_background(["true"], kernels=()):  # no numba kernel to wait for
        ...     choose(torch.device("cpu"))
        'numba'
    """
    kernels = tuple(kernels)
    malformed = [name for name in kernels if not isinstance(name, str) or name.count(".") != 1]
    if malformed:
        raise ValueError(f"kernels are named 'module.kernel' of gm_solver.backends.numba, like "
                         f"'context.decode_step'; got {', '.join(map(repr, malformed))}")
    import numba  # its threads too; a decoding command has it imported already (graphs count with it)

    try:  # (numba's count is the calling thread's: the one that decodes, in the command line)
        numba_threads = numba.get_num_threads()
    except Exception:  # a threading layer that cannot start: its own error comes at a parallel kernel, as before
        numba_threads = None
    before = dict(_quick)
    _quick.update(command=list(command), kernels=kernels, ready=None, threads=torch.get_num_threads(),
                  numba_threads=numba_threads)
    if _compiling():
        _leave_a_core()
    try:
        yield
    finally:
        torch.set_num_threads(_quick["threads"])
        if numba_threads is not None:
            numba.set_num_threads(numba_threads)
        _quick.update(before)


def compile_lock() -> Path:
    """The file a background compile (``python -m pipelines.warm --background``) holds locked while it runs: one
    compile at a time per user, and a sign to the commands beside it that a core is taken."""
    return Path(tempfile.gettempdir()) / f"graphmax-warm-{os.getuid()}.lock"


def _open_lock(flags: int) -> int | None:
    """:func:`compile_lock` opened with ``flags``, never following a link nor waiting on a FIFO; None where it is
    missing (and not created) or is anything but a regular file."""
    try:
        fd = os.open(compile_lock(), flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def holding_compile_lock() -> Iterator[bool]:
    """For a background compile: :func:`compile_lock` held for the block, which is told whether this process holds
    it (True) or must leave the compiling to another (False: one holds it already, or its path is taken by anything
    but a regular file)."""
    fd = _open_lock(os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    if fd is None:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _compiling() -> bool:
    """Whether a background compile holds :func:`compile_lock` now; False wherever that cannot be told."""
    fd = _open_lock(os.O_RDONLY)
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free unless the compile's exclusive lock is held
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # and with it the shared lock


def _leave_a_core() -> None:
    """torch's and numba's threads one fewer than the block started with (at most the cores), however often it is
    called."""
    import numba

    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, min(_quick["threads"], cores) - 1))
    if _quick["numba_threads"] is not None:
        numba.set_num_threads(max(1, min(_quick["numba_threads"], cores) - 1))


def _numba_ready() -> bool:
    if _quick["command"] is None:
        return True
    if _quick["ready"] is None:
        _quick["ready"] = ready = _kernels_cached(_quick["kernels"])
        if not ready:
            print("graphmax: numba's kernels are not compiled yet on this machine; this run decodes with torch on the "
                  "CPU (slower a token), while they compile in the background (a few minutes) for the next run",
                  file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                subprocess.Popen(_quick["command"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
                _leave_a_core()
    return _quick["ready"]


def _kernels_cached(kernels: tuple[str, ...]) -> bool:
    """Whether every kernel named in ``kernels`` would be loaded from the kernel cache rather than compiled; True
    where that cannot be told (numba's caching not graphmax's, ``NUMBA_DISABLE_JIT``): numba then loads or compiles
    them as before."""
    from gm_graphs.store.kernel_cache import kernel_cached

    room_ = importlib.import_module(".numba", __name__) if kernels else None
    found = []
    for name in kernels:
        module, kernel = name.split(".")
        try:
            found.append(getattr(getattr(room_, module), kernel))
        except AttributeError:
            raise ValueError(f"{name!r} is not a kernel of gm_solver.backends.numba; name one of its modules' "
                             f"kernels, like {ENTRY_KERNELS[0]!r}") from None
    return all(kernel_cached(kernel) is not False for kernel in found)


def canonical(device: str | torch.device) -> torch.device:
    """``device`` with its index where it has one: ``cuda`` is the current GPU's ``cuda:N``, as a tensor's
    ``.device`` says, so that what is kept per device (an operator, a reference's tables, a compiled step's
    switch) is found again whichever way the device was named.

    Example::

        >>> canonical("cpu")
        device(type='cpu')
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def room(name: str) -> ModuleType:
    """The module that implements backend ``name``'s operations (imported on first use: the fused backend's
    imports torch.compile's machinery only then)."""
    check_request(name)
    return importlib.import_module({"numba": ".numba", "torch": ".eager", "fused": ".fused"}[name], __name__)


def fused_available(device: torch.device) -> bool:
    """Whether the fused backend can compile for ``device``: a CUDA device, with Triton for inductor's kernels."""
    if device.type != "cuda" or not hasattr(torch, "compile"):
        return False
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()
