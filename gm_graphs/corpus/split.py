"""A reproducible train / held-out split of a corpus, by document.

Each document goes to one side by a keyed hash of its text, so the split is
deterministic given the seed, needs one streaming pass, and puts duplicate
documents on the same side: a held-out text can never also be in the training
split that a graph is built from.
"""

from __future__ import annotations

import hashlib
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gm_graphs.corpus.read import CorpusSpec, ReadStats, expand_corpus, iter_documents
from gm_graphs.errors import CorpusError, OptionError
from gm_graphs.store.folders import marked, staged_folder

SIDES = ("train", "heldout")
SPLIT_MARKER = ".graphmax-split"
SPLIT = marked("split", SPLIT_MARKER, tuple(f"{side}.parquet" for side in SIDES))


@dataclass(frozen=True)
class CorpusSplit:
    """Two Parquet files (column ``text``) and how many documents each side got; :func:`split_corpus` writes it.

    Args:
        folder (``pathlib.Path``): the split's folder, holding ``train.parquet`` and ``heldout.parquet``.
        documents (``dict[str, int]``): the documents on each side, ``"train"`` and ``"heldout"``.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> _ = (folder / "reviews.txt").write_text("\\n".join(f"review number {i}" for i in range(20)))
        >>> split = split_corpus(folder / "reviews.txt", folder / "split", heldout_fraction=0.25, seed=0)
        >>> split.path("train").name, sum(split.documents.values())
        ('train.parquet', 20)
        >>> len(split.texts("heldout")) == split.documents["heldout"]
        True
    """

    folder: Path
    documents: dict[str, int]

    def path(self, side: str) -> Path:
        if side not in SIDES:
            raise ValueError(f"side must be one of {SIDES}, got {side!r}")
        return self.folder / f"{side}.parquet"

    def texts(self, side: str, limit: int | None = None) -> list[str]:
        """The documents of one side, in corpus order (the first ``limit`` of them)."""
        with pa.OSFile(os.fsencode(self.path(side))) as fh:  # by its bytes: the folder's name need not be UTF-8
            table = pq.read_table(fh, columns=["text"])
        texts = table.column("text").to_pylist()
        return texts if limit is None else texts[:limit]


def heldout_side(text: str, fraction: float, seed: int) -> bool:
    """True when ``text`` belongs to the held-out side for this ``fraction`` and ``seed``."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") < fraction * 2.0**64


def split_corpus(corpus: CorpusSpec, path: str | os.PathLike, *, heldout_fraction: float = 0.1, seed: int = 0,
                 text_column: str = "text", clean: bool = False, overwrite: bool = False,
                 batch_docs: int = 4096) -> CorpusSplit:
    """Split ``corpus`` by document into ``path/train.parquet`` and ``path/heldout.parquet``.

    Written to a temporary folder and committed atomically, so ``path`` is either complete or absent; with
    ``overwrite`` it replaces only a split folder graphmax wrote (it holds a marker file), never another folder.
    Build the graph from ``split.path("train")``: held-out text never enters it.

    Args:
        corpus (``str``, ``os.PathLike`` or an iterable of them): corpus files or globs (:func:`expand_corpus`).
        path (``str`` or ``os.PathLike``): the folder to write.
        heldout_fraction (``float``, defaults to 0.1): the expected share of documents held out, in (0, 1).
        seed (``int``, defaults to 0): the key of the hash that decides each document's side.
        text_column (``str``, defaults to ``"text"``): the column or JSONL key holding the text.
        clean (``bool``, defaults to ``False``): unescape HTML entities and drop ``<br />`` tags.
        overwrite (``bool``, defaults to ``False``): replace a split graphmax wrote at ``path``.
        batch_docs (``int``, defaults to 4096): documents read per batch.

    Returns:
        ``CorpusSplit``: the folder and the documents on each side.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> tmp = tempfile.TemporaryDirectory(); folder = Path(tmp.name)
        >>> docs = [f"review number {i}" for i in range(20)] + ["review number 0"]     # a duplicate
        >>> _ = (folder / "reviews.txt").write_text("\\n".join(docs))
        >>> split = split_corpus(folder / "reviews.txt", folder / "split", heldout_fraction=0.25, seed=0)
        >>> train, heldout = split.texts("train"), split.texts("heldout")
        >>> sorted(train + heldout) == sorted(docs), set(train).isdisjoint(heldout)
        (True, True)
    """
    if not (_is_number(heldout_fraction) and 0.0 < heldout_fraction < 1.0):
        raise OptionError(f"heldout_fraction must be a number strictly between 0 and 1, got {heldout_fraction!r}")
    if not (_is_int(seed) and 0 <= seed < 2**64):  # the key of the hash: at most 64 bytes of its digits
        raise OptionError(f"seed must be an integer from 0 to 2**64 - 1, got {seed!r}")
    if not (_is_int(batch_docs) and batch_docs >= 1):
        raise OptionError(f"batch_docs must be an integer >= 1 (documents read per batch), got {batch_docs!r}")
    files = expand_corpus(corpus)
    out = Path(path)
    counts = dict.fromkeys(SIDES, 0)
    schema = pa.schema([("text", pa.large_string())])
    with staged_folder(out, overwrite=overwrite, artefact=SPLIT) as tmp:
        (tmp / SPLIT_MARKER).write_text("a train / held-out split written by graphmax\n")
        sinks = {side: pa.OSFile(os.fsencode(tmp / f"{side}.parquet"), "wb") for side in SIDES}
        writers = {side: pq.ParquetWriter(sinks[side], schema, compression="zstd") for side in SIDES}
        try:
            for docs in iter_documents(files, text_column, clean=clean, batch_docs=batch_docs, stats=ReadStats()):
                sides: dict[str, list[str]] = {side: [] for side in SIDES}
                for doc in docs:
                    sides["heldout" if heldout_side(doc, heldout_fraction, seed) else "train"].append(doc)
                for side, texts in sides.items():
                    if texts:
                        writers[side].write_table(pa.table({"text": pa.array(texts, pa.large_string())}))
                        counts[side] += len(texts)
        finally:
            for side, w in writers.items():
                w.close()
                sinks[side].close()
        empty = [side for side, n in counts.items() if n == 0]
        if empty:
            raise CorpusError(f"the {empty[0]} split is empty ({counts}); the corpus is too small for "
                             f"heldout_fraction={heldout_fraction}: add documents or change the fraction")
    return CorpusSplit(out, counts)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
