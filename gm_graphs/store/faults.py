"""Named fault points, for tests that kill or fail a write at every step and check what is left on disk.

``fault_point("name")`` does nothing unless ``GRAPHMAX_FAULT`` names that point:

- ``GRAPHMAX_FAULT=name`` ends the process there at once (``os._exit(137)``, as a SIGKILL would: no cleanup);
- ``GRAPHMAX_FAULT=name:raise`` raises :class:`InjectedFault` there;
- ``GRAPHMAX_FAULT=name:enospc`` raises ``OSError(ENOSPC)`` there, as a full disk would;
- ``GRAPHMAX_FAULT=name:pause`` waits there (up to a minute, then goes on), so that a test can signal the process
  at a known point: a signal handler that raises raises out of the wait.

``GRAPHMAX_FAULT_LOG=FILE`` appends the name of every point reached to FILE, so a test can list a job's points
and then fail the job at each of them. ``GRAPHMAX_FAULT_ONCE=FILE`` makes the fault fire once across every process
that shares FILE's folder (the first to create FILE), so a retried task then succeeds.
"""

from __future__ import annotations

import errno
import os
import time


class InjectedFault(RuntimeError):
    """Raised at a fault point named by ``GRAPHMAX_FAULT=name:raise``."""


def fault_point(name: str) -> None:
    log = os.environ.get("GRAPHMAX_FAULT_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(name + "\n")
    spec = os.environ.get("GRAPHMAX_FAULT")
    if not spec:
        return
    point, _, action = spec.partition(":")
    if point != name:
        return
    once = os.environ.get("GRAPHMAX_FAULT_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    if action == "raise":
        raise InjectedFault(f"fault injected at {name}")
    if action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
    if action == "pause":
        time.sleep(60)
        return
    os._exit(137)
