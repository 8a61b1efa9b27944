"""Sorted runs: the windows of one order of a corpus counted exactly in bounded memory (an external merge sort).

Keys of windows (``gm_graphs.count.bigrams``) are buffered, ``run_entries`` at a time (8 bytes each); a full buffer is
sorted and packed into a run, written to a folder (or, without one, kept in memory and merged with the runs
before it, so that memory holds about the distinct windows). A run on disk is compressed a block of ``SAMPLE``
entries at a time: the differences of its sorted entries, byte plane by byte plane, in Arrow's LZ4 (at 4M
documents 2.4× smaller, 3.3 bytes an entry: the runs set the build's peak disk). The runs are then merged a range
of contexts at a time (``SortedRuns.ranges``): a thread reads each range from every run with ``pread`` (not
memory-mapped, so what was read leaves the process), front to back, each entry once, while the ranges before it
are sorted and summed and handed on in ascending order. Memory is the buffer, plus the ranges being read and merged;
neither grows with the corpus. Consecutive orders are counted from one buffer and one sort (``NestedRuns``): a
window's first tokens are the window one shorter, so sorting the longest windows sorts them all but for each
document's last ones.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
import pyarrow as pa

from gm_graphs.count.ahead import ahead
from gm_graphs.count.bigrams import count_bits, last_keys, pack_sorted, prefix_entries, unpack, window_keys
from gm_graphs.store.kernel_cache import ensure_cache_dir
from gm_graphs.store.pagecache import DropBehind, drop

ensure_cache_dir()  # before the cached kernels below are defined

SAMPLE = 4096  # every SAMPLE-th entry of a run stays in memory, to find a key's place in the run by one small read
RUN_ENTRIES = 1 << 24  # entries of an order buffered (8 bytes each) before they are sorted into a run
RANGE_ENTRIES = 1 << 22  # entries merged at a time by default (32 MB of packed entries, ~100 MB while merged)


@numba.njit(nogil=True, cache=True)
def _repack(keys, counts, bits, out):
    """Packed entries of unique sorted keys with their counts (a count above the cap split over entries)."""
    cap = (np.uint64(1) << np.uint64(bits)) - np.uint64(1)
    m = 0
    for i in range(keys.size):
        left = np.uint64(counts[i])
        while left > 0:
            c = left if left < cap else cap
            out[m] = (np.uint64(keys[i]) << np.uint64(bits)) | c
            m += 1
            left -= c
    return m


def repack(keys: np.ndarray, counts: np.ndarray, bits: int) -> np.ndarray:
    cap = (1 << bits) - 1
    out = np.empty(int(np.sum(-(-counts // cap))) if counts.size else 0, dtype=np.uint64)
    return out[:_repack(keys, counts, bits, out)]


_CODEC = pa.Codec("lz4")
_ENCODE_BLOCKS = 256  # blocks whose differences and byte planes are made at once (8 MB)


def encode_blocks(packed: np.ndarray):
    """The compressed blocks of a run's sorted entries (``SAMPLE`` a block, the last one shorter): each block's
    differences (its first entry as it is), its bytes grouped by significance (sorted neighbours differ in the low
    bytes only), compressed."""
    step = _ENCODE_BLOCKS * SAMPLE
    for start in range(0, packed.size, step):
        part = packed[start:start + step]
        diff = np.empty_like(part)
        np.subtract(part[1:], part[:-1], out=diff[1:])
        diff[::SAMPLE] = part[::SAMPLE]
        whole = part.size // SAMPLE * SAMPLE
        planes = diff[:whole].view(np.uint8).reshape(-1, SAMPLE, 8).transpose(0, 2, 1).copy()
        for block in planes:
            yield _CODEC.compress(block)
        if whole < part.size:
            yield _CODEC.compress(np.ascontiguousarray(diff[whole:].view(np.uint8).reshape(-1, 8).T))


def decode_block(data, out: np.ndarray) -> None:
    """One block of :func:`encode_blocks` back into ``out`` (its entries)."""
    planes = np.frombuffer(_CODEC.decompress(data, decompressed_size=out.size * 8), np.uint8)
    out.view(np.uint8).reshape(-1, 8)[:] = planes.reshape(8, -1).T
    np.cumsum(out, out=out)


@dataclass
class Run:
    """One sorted run of packed entries: a file of compressed blocks (``path``, each block's byte offset in
    ``offsets``) or an array in memory (``data``)."""

    length: int
    sample: np.ndarray  # entries 0, SAMPLE, 2·SAMPLE, …
    path: Path | None = None
    offsets: np.ndarray | None = None
    data: np.ndarray | None = None

    def read(self, a: int, b: int, out: np.ndarray) -> None:
        """Entries ``a:b`` into ``out``, then dropped from the page cache (each entry is read once); ``a`` starts a
        block and ``b`` ends one (the cursor reads up to sampled entries)."""
        if self.data is not None:
            out[:] = self.data[a:b]
            return
        if b <= a:
            return
        if a % SAMPLE or (b % SAMPLE and b != self.length) or b > self.length:
            raise AssertionError(f"entries {a}:{b} of a run of {self.length} do not fall on its blocks")
        first, last = a // SAMPLE, -(-b // SAMPLE)
        start, stop = int(self.offsets[first]), int(self.offsets[last])
        raw = np.empty(stop - start, dtype=np.uint8)
        view = memoryview(raw)
        # opened for each read: a descriptor kept open grows the kernel's readahead past the range (benchmarks/build.py)
        with open(self.path, "rb", buffering=0) as fh:
            done = 0
            while done < len(view):
                n = os.preadv(fh.fileno(), [view[done:]], start + done)
                if n == 0:
                    raise OSError(f"{self.path} ends before entry {b}")
                done += n
            drop(fh.fileno(), start, done)
        for i in range(first, last):
            lo, hi = int(self.offsets[i]) - start, int(self.offsets[i + 1]) - start
            block = out[i * SAMPLE - a:min(b, (i + 1) * SAMPLE) - a]
            decode_block(view[lo:hi], block)
            # Arrow's LZ4 keeps no checksum and fills a short frame's tail with whatever memory held: a damaged
            # block must still start at its sample, ascend, and end at or below the next block's sample
            if (block[0] != self.sample[i] or (i + 1 < self.sample.size and block[-1] > self.sample[i + 1])
                    or (block.size > 1 and np.any(block[1:] < block[:-1]))):
                raise OSError(f"{self.path} is damaged: block {i} does not decode to its sorted entries")


class _WindowBuffer(ABC):
    """A buffer of window keys, sorted into runs by ``flush`` whenever it is full."""

    _buffer: np.ndarray
    _fill: int

    @abstractmethod
    def flush(self) -> None:
        """Sort the buffered keys into runs."""

    def _buffer_windows(self, ids: np.ndarray, offsets: np.ndarray, runs: SortedRuns) -> None:
        """Key the windows of ``runs``' order into the buffer (``runs.run_entries`` long), flushed when full."""
        if self._buffer.size == 0:
            self._buffer = np.empty(runs.run_entries, dtype=np.uint64)
        if self._fill + ids.size > runs.run_entries:
            self.flush()
        if ids.size <= runs.run_entries:
            self._fill = window_keys(ids, offsets, runs.vocab_size, runs.order, runs.inset, self._buffer, self._fill)
            return
        keys = np.empty(ids.size, dtype=np.uint64)  # a batch larger than the buffer: in buffer-sized pieces
        n = window_keys(ids, offsets, runs.vocab_size, runs.order, runs.inset, keys, 0)
        for start in range(0, n, runs.run_entries):
            piece = keys[start:min(n, start + runs.run_entries)]
            self._buffer[:piece.size] = piece
            self._fill = piece.size
            self.flush()


class _Cursor:
    """Reads one run front to back, a range at a time: each entry from disk once, in order."""

    def __init__(self, run: Run):
        self.run = run
        self.pos = 0  # the next entry to read
        self.carry = np.empty(0, dtype=np.uint64)  # entries read that belong to the next ranges

    def need(self, hi: int) -> int:
        """An upper bound on the entries below ``hi`` not yet taken."""
        return self.carry.size + self._end(hi) - self.pos

    def _end(self, hi: int) -> int:
        # the first sampled entry >= hi bounds hi's place: reading up to it finds the place without another read
        if hi >= 1 << 64:
            return self.run.length
        return max(self.pos, min(self.run.length, int(np.searchsorted(self.run.sample, np.uint64(hi))) * SAMPLE))

    def take(self, hi: int, out: np.ndarray) -> int:
        """Write the entries below ``hi`` not yet taken to the start of ``out`` (``need(hi)`` long); their number."""
        end = self._end(hi)
        c = self.carry.size
        out[:c] = self.carry
        self.run.read(self.pos, end, out[c:c + end - self.pos])
        got = c + end - self.pos
        self.pos = end
        k = got if hi >= 1 << 64 else int(np.searchsorted(out[:got], np.uint64(hi)))
        self.carry = out[k:got].copy()
        return k


class SortedRuns(_WindowBuffer):
    """Counts the windows of ``order`` tokens of encoded documents; see the module's docstring."""

    def __init__(self, order: int, vocab_size: int, run_entries: int = RUN_ENTRIES, folder: Path | None = None,
                 inset: int = 0):
        if not isinstance(run_entries, int) or run_entries < 1:
            raise ValueError(f"run_entries must be an integer >= 1, got {run_entries!r}")
        self.order, self.vocab_size, self.run_entries, self.inset = order, int(vocab_size), run_entries, inset
        self.bits = count_bits(order, vocab_size)
        if self.bits < 1:
            raise ValueError(f"order {order} over a vocabulary of {vocab_size:,} tokens overflows 64-bit keys")
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self.runs: list[Run] = []
        self.windows = 0  # windows counted
        self.bytes_written = 0  # run bytes written to the folder
        self.removed = False
        self._buffer = np.empty(0, dtype=np.uint64)
        self._fill = 0

    # ---- counting -------------------------------------------------------------------------------------------

    def add(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        """Count the windows of documents ``ids[offsets[i]:offsets[i+1]]`` (none crosses a document boundary)."""
        if ids.size >= self.order:
            self._buffer_windows(ids, offsets, self)

    def flush(self) -> None:
        """Sort and pack the buffered keys into a run."""
        if self._fill == 0:
            return
        keys = self._buffer[:self._fill]
        keys.sort()
        m = pack_sorted(keys, self._fill, self.bits)
        self.add_run(keys[:m], self._fill)
        self._fill = 0

    def add_run(self, packed: np.ndarray, windows: int) -> None:
        """Keep the sorted packed entries ``packed`` (of ``windows`` windows) as a run; ``packed`` may be reused
        after."""
        self.windows += windows
        if packed.size == 0:
            return
        if self.folder is None:
            self._keep(packed.copy())
            return
        path = self.folder / f"run-{self.order}-{len(self.runs):05d}.lz4"
        offsets = [0]
        with open(path, "wb") as fh:  # read back once, after the pass: no reason to keep it in memory
            out = DropBehind(fh)
            for block in encode_blocks(packed):
                out.write(block)
                offsets.append(offsets[-1] + block.size)
            out.finish()
        self.bytes_written += offsets[-1]
        self.runs.append(Run(packed.size, packed[::SAMPLE].copy(), path=path,
                             offsets=np.array(offsets, dtype=np.int64)))

    def _keep(self, packed: np.ndarray) -> None:
        if self.runs:  # in memory, one run: merged with the new one
            merged = np.concatenate([self.runs[0].data, packed])
            merged.sort()
            packed = repack(*unpack(merged, self.bits), self.bits)
        self.runs = [Run(packed.size, packed[::SAMPLE].copy(), data=packed)]

    def release(self) -> None:
        """Free the buffer (after the last ``add``) and write what it holds."""
        self.flush()
        self._buffer = np.empty(0, dtype=np.uint64)

    # ---- merging ----------------------------------------------------------------------------------------------

    def bounds(self, max_entries: int) -> list[int]:
        """Packed-entry boundaries of ranges of whole contexts holding about ``max_entries`` entries or fewer
        (a context with more successors than that is one range of its own)."""
        if not self.runs:
            return [0, 1 << 64]
        # each sampled entry stands for the SAMPLE entries of its run that follow it: every (max_entries /
        # SAMPLE)-th of all runs' samples, in order, is about max_entries entries after the one before
        step = max(1, max_entries // SAMPLE)
        samples = np.sort(np.concatenate([r.sample for r in self.runs]))
        contexts = np.unique((samples[step::step] >> np.uint64(self.bits)) // np.uint64(self.vocab_size))
        inner = [(int(c) * self.vocab_size) << self.bits for c in contexts if c > 0]
        return [0, *inner, 1 << 64]

    def _read(self, edges: list[int]) -> Iterator[np.ndarray]:
        """The packed entries of each range ``edges[i]:edges[i+1]`` from every run, unsorted, in order."""
        cursors = [_Cursor(run) for run in self.runs]
        for hi in edges[1:]:
            need = [c.need(hi) for c in cursors]
            buf = np.empty(sum(need), dtype=np.uint64)
            at = 0
            for c, n in zip(cursors, need):
                at += c.take(hi, buf[at:at + n])
            yield buf[:at]

    def _sum(self, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        buf.sort()
        return unpack(buf, self.bits)

    def ranges(self, max_entries: int = RANGE_ENTRIES, workers: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The merged counts as (unique int64 keys, int64 counts), ascending, a range of contexts at a time.

        A thread reads the ranges ahead (disk reads wait without the GIL), while ``workers`` threads sort and sum
        the ranges read (NumPy's sort releases the GIL too)."""
        if self.removed:
            raise AssertionError(f"the order-{self.order} runs were merged and removed already")
        self.release()
        read = ahead(self._read(self.bounds(max_entries)), max(1, workers), "graphmax-runs")
        if workers <= 1:
            for buf in read:
                keys, counts = self._sum(buf)
                if keys.size:
                    yield keys, counts
            return
        with ThreadPoolExecutor(workers, thread_name_prefix="merge") as pool:
            pending: deque = deque()
            for buf in read:
                pending.append(pool.submit(self._sum, buf))
                if len(pending) > workers:
                    keys, counts = pending.popleft().result()
                    if keys.size:
                        yield keys, counts
            while pending:
                keys, counts = pending.popleft().result()
                if keys.size:
                    yield keys, counts

    def drain(self, workers: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``ranges``, the run files deleted once merged (or on failure): what is written from them takes their place
        on disk (the runs of every order beside the whole graph made a build's peak)."""
        try:
            yield from self.ranges(workers=workers)
        finally:
            self.remove()

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        """Every count at once (unique int64 keys, int64 counts)."""
        parts = list(self.ranges(1 << 62))
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate([k for k, _ in parts]), np.concatenate([c for _, c in parts])

    def remove(self) -> None:
        """Delete the run files (its counts are then gone: ``ranges`` refuses to run)."""
        for run in self.runs:
            if run.path is not None:
                run.path.unlink(missing_ok=True)
        self.runs = []
        self.removed = True


class NestedRuns(_WindowBuffer):
    """Feeds the :class:`SortedRuns` of consecutive orders n₀ < … < n (same inset) from one sort of the longest
    windows: the windows of order k − 1 are the first k − 1 tokens of those of order k, which a sort of the
    order-k keys leaves sorted, plus each document's last window of order k − 1. One sort and one pass over the
    tokens instead of one per order (and one buffer instead of one per order).

    Args:
        runs (sequence of :class:`SortedRuns`): one per order, consecutive orders, one vocabulary, one inset; the
            longest order's ``run_entries`` sets the buffer.
    """

    def __init__(self, runs: Sequence[SortedRuns]):
        self.runs = sorted(runs, key=lambda r: r.order)
        orders = [r.order for r in self.runs]
        if (len(orders) < 2 or orders != list(range(orders[0], orders[0] + len(orders)))
                or len({(r.vocab_size, r.inset) for r in self.runs}) != 1):
            raise ValueError(f"NestedRuns needs consecutive orders over one vocabulary and inset, got {orders}")
        self.top = self.runs[-1]
        self._buffer = np.empty(0, dtype=np.uint64)  # the longest windows' keys
        self._scratch = np.empty(0, dtype=np.uint64)  # a shorter order's entries while the next is derived
        self._fill = 0
        self._last: dict[int, list[np.ndarray]] = {r.order: [] for r in self.runs[:-1]}

    def add(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        """Count the windows of every order in documents ``ids[offsets[i]:offsets[i+1]]``."""
        top = self.top
        for order, parts in self._last.items():  # counted in whichever run the next flush writes
            out = np.empty(offsets.size - 1, dtype=np.uint64)
            parts.append(out[:last_keys(ids, offsets, top.vocab_size, order, top.inset, out, 0)])
        self._buffer_windows(ids, offsets, top)

    def flush(self) -> None:
        """Sort the buffered windows; pack them and each shorter order derived from them into a run."""
        if self._fill == 0 and not any(self._last.values()):
            return
        keys = self._buffer[:self._fill]
        keys.sort()
        packed = keys[:pack_sorted(keys, self._fill, self.top.bits)]
        windows = self._fill
        self.top.add_run(packed, windows)
        # each order from the one above it, into the other of two buffers (a run is written or copied when added)
        buffers, into = [self._buffer, self._scratch], 1
        for runs, above in zip(self.runs[-2::-1], self.runs[::-1]):
            last = np.sort(np.concatenate([np.empty(0, np.uint64), *self._last[runs.order]]))
            self._last[runs.order] = []
            if buffers[into].size < packed.size + last.size:
                buffers[into] = np.empty(packed.size + last.size, dtype=np.uint64)
            out = buffers[into]
            packed = out[:prefix_entries(packed, packed.size, above.bits, runs.vocab_size, last, runs.bits, out)]
            windows += last.size
            runs.add_run(packed, windows)
            into = 1 - into
        self._buffer, self._scratch = buffers
        self._fill = 0

    def release(self) -> None:
        """Free the buffer (after the last ``add``) and write what it holds."""
        self.flush()
        self._buffer = self._scratch = np.empty(0, dtype=np.uint64)


def feeders(counters: Iterable[SortedRuns]) -> list[SortedRuns | NestedRuns]:
    """What to feed each batch to: chains of consecutive orders with one inset as :class:`NestedRuns`, the other
    counters as they are."""
    chains: list[list[SortedRuns]] = []
    for runs in sorted(counters, key=lambda r: (r.inset, r.vocab_size, r.order)):
        chain = chains[-1] if chains else None
        if chain and (chain[-1].inset, chain[-1].vocab_size, chain[-1].order + 1) == (runs.inset, runs.vocab_size,
                                                                                     runs.order):
            chain.append(runs)
        else:
            chains.append([runs])
    return [NestedRuns(chain) if len(chain) > 1 else chain[0] for chain in chains]
