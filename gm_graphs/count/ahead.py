"""Stages of a pipeline run by threads, joined by small bounded queues.

Reading a corpus, counting it and reading sorted runs back spend their time in I/O, Rust or numba kernels that
release the GIL; running each in a thread of its own lets it overlap the stage that consumes it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
END = object()  # the last item a producer puts


class Worker:
    """Runs ``target`` in a daemon thread; an error stops it (``stop`` is set) and is raised by ``check``."""

    def __init__(self, target: Callable[[], None], name: str, stop: threading.Event):
        self.error: BaseException | None = None
        self.stop = stop
        self._thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
        self._thread.start()

    def _run(self, target) -> None:
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            self.error = e
            self.stop.set()

    def join(self) -> None:
        self._thread.join()

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def put(q: queue.Queue, item, stop: threading.Event) -> bool:
    """Put ``item`` unless ``stop`` is set meanwhile (the other side has gone); whether it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def ahead(items: Iterable[T], depth: int, name: str) -> Iterator[T]:
    """The items of ``items``, produced by a thread up to ``depth`` items ahead of the caller; an error in the
    thread is raised here, and closing this generator stops the thread."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if not put(q, item, stop):
                    return
            put(q, END, stop)
        finally:
            close = getattr(items, "close", None)  # a generator's own cleanup runs in its thread, now
            if close is not None:
                close()

    worker = Worker(produce, name, stop)
    try:
        while True:
            try:
                item = q.get(timeout=0.1)
            except queue.Empty:
                worker.check()
                continue
            if item is END:
                break
            yield item
        worker.join()
        worker.check()
    finally:
        stop.set()
