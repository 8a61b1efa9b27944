"""Dictionary-encoded Parquet (``gm_graphs/corpus/readers/parquet.py``): a value the footer counts once but every
row refers to is read in batches of bounded bytes, and an intact file is never called damaged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gm_graphs.corpus.read import iter_documents
from gm_graphs.corpus.source import MB

from .helpers import REPO

BUDGET = 1536 * MB  # address space a read may add; the batch bound is 64 MB of text (a reader of f16b6f9 took 6.8 GB)


def write_bomb(path: Path, value: str, rows: int, **write) -> Path:
    """``rows`` rows that each refer to the one dictionary value ``value``: the footer counts it once."""
    column = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([value]))
    pq.write_table(pa.table({"text": column}), path, use_dictionary=True, compression="zstd",
                   compression_level=22, **write)
    return path


_LIMITED = """
import json, re, resource, sys
import pyarrow as pa
pa.set_cpu_count(2)  # the limit is on this read, not on how many threads the machine's cores start
pa.set_io_thread_count(2)
from pathlib import Path
from gm_graphs.corpus.read import iter_documents
warm, bomb, value_bytes, budget = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for _ in iter_documents([warm]):  # the same code path once, small: its threads and pools exist before the limit
    pass
expected = "a" * value_bytes
size = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10
resource.setrlimit(resource.RLIMIT_AS, (size + budget, resource.RLIM_INFINITY))
documents = same = 0
try:
    for batch in iter_documents([bomb]):
        documents += len(batch)
        same += sum(d == expected for d in batch)
    print(json.dumps({"documents": documents, "same": same}))
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
"""


def _read_limited(warm: Path, bomb: Path, value_bytes: int, budget: int) -> dict:
    """Read ``bomb`` in a child whose address space may grow by ``budget`` bytes after a warm-up read."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "ARROW_DEFAULT_MEMORY_POOL": "system"}
    run = subprocess.run([sys.executable, "-c", _LIMITED, str(warm), str(bomb), str(value_bytes), str(budget)],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


# the bombs, with fewer rows: still more text than the budget (2.4 GB and 1.8 GB), in half the time
@pytest.mark.parametrize("value_mb,rows", [(16, 150), (1, 1800)], ids=["16MBx150", "1MBx1800"])
def test_a_dictionary_bomb_is_read_in_bounded_memory_and_whole(tmp_path, value_mb, rows):
    """Bombs of a few hundred bytes: 2.4 GB and 1.8 GB of text once decoded, read within 1.5 GB of address space,
    every document the value."""
    warm = write_bomb(tmp_path / "warm.parquet", "a" * 1000, 10)
    bomb = write_bomb(tmp_path / "bomb.parquet", "a" * (value_mb * MB), rows, store_schema=False)
    assert bomb.stat().st_size < 2400
    assert _read_limited(warm, bomb, value_mb * MB, BUDGET) == {"documents": rows, "same": rows}


def test_an_intact_file_that_does_not_fit_in_memory_is_not_called_damaged(tmp_path):
    warm = write_bomb(tmp_path / "warm.parquet", "a" * 1000, 10)
    bomb = write_bomb(tmp_path / "bomb.parquet", "a" * MB, 2500)
    result = _read_limited(warm, bomb, MB, 24 * MB)  # less than one batch of 64 MB
    assert "damaged" not in result["error"], result
    assert result["error"].startswith("CorpusError: ") and "too large to read here" in result["error"], result
    assert "\n" not in result["error"]


@pytest.mark.parametrize("store_schema", [True, False], ids=["dictionary-typed", "string-typed"])
def test_dictionary_encoded_columns_read_as_a_plain_read_in_bounded_batches(tmp_path, monkeypatch, store_schema):
    """Several row groups with their own dictionaries, a long value among short ones, nulls, empty values, and a
    dictionary that falls back to plain pages: the documents of a plain read, in batches of bounded bytes."""
    long = "b" * (300 << 10)
    values = [None if i % 97 == 0 else "" if i % 89 == 0 else long if i % 10 == 3 else f"review {i % 13}"
              for i in range(3000)]
    values += [f"unique review number {i} " * 50 for i in range(3000)]  # past the dictionary page's 1 MB: plain
    path = tmp_path / "mixed.parquet"
    text = pa.chunked_array([pa.array(values[i:i + 1000]).dictionary_encode() for i in range(0, len(values), 1000)])
    pq.write_table(pa.table({"n": list(range(len(values))), "text": text}), path, row_group_size=1000,
                   store_schema=store_schema)
    chunks = [pq.ParquetFile(path).metadata.row_group(i).column(1) for i in range(6)]
    assert all(c.has_dictionary_page for c in chunks) and chunks[0].total_uncompressed_size < MB  # 30 MB decoded
    monkeypatch.setattr("gm_graphs.corpus.readers.parquet.BATCH_BYTES", 4 * MB)
    batches = list(iter_documents([path]))
    plain = [v for v in pq.read_table(path).column("text").to_pylist() if v]
    assert [d for b in batches for d in b] == plain
    assert max(sum(map(len, b)) for b in batches) <= 4 * MB
