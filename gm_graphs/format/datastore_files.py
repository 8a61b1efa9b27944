"""The kNN datastore folder (its layout: docs/format.md): writing it, and opening it with every file checked.

A datastore (Khandelwal et al., "Generalization through Memorization: Nearest Neighbor Language Models", ICLR
2020) holds, for each position of a corpus, the LM's last hidden state there (the key) and the token that followed
(the value). ``gm_solver.datastore`` computes it with a model and searches it; this module only stores arrays.

The folder is written as a temporary sibling and renamed into place (``gm_graphs.store.folders.staged_folder``), so
a kill leaves the old datastore or the new one. Opening one follows no symlink, checks sizes, ``.npy`` headers,
dtypes, the values' range, the keys' finiteness and (``verify``) the SHA-256 of each file before handing out an
array. meta.json identifies the tokenizer (its vocabulary's SHA-256 and how it splits text, as a graph's manifest
does) and the model (a SHA-256 of all its weights), so that a datastore is never searched with another model's
states or another vocabulary's ids. The index's offsets are checked to cover the keys exactly once, in order, and
its centres to be finite; which list a key is in only affects what an approximate search finds, never what it reads.
The marginals are checked to be finite, non-negative and to sum to the number of keys (each position's softmax sums
to 1).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gm_graphs.errors import DatastoreError
from gm_graphs.format.graph_files import sha256_file
from gm_graphs.format.validate import is_sha256
from gm_graphs.store import npy
from gm_graphs.store.faults import fault_point
from gm_graphs.store.folders import check_replaceable, marked, staged_folder
from gm_graphs.store.reader import RecordedFile, open_inside

FORMAT = "graphmax-datastore"
VERSION = 2  # 2: model_sha256 covers every parameter, not the LM head alone
META = "meta.json"
KEYS, VALUES = "keys.npy", "values.npy"
CENTROIDS, LISTS = "ivf_centroids.npy", "ivf_lists.npy"
KEY_DTYPE, VALUE_DTYPE = np.dtype("<f2"), np.dtype("<i4")
CENTROID_DTYPE, LIST_DTYPE = np.dtype("<f4"), np.dtype("<i8")
MARGINALS, MARGINAL_DTYPE = "marginals.npy", np.dtype("<f8")
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what meta.json's model_dtype may name: the dtypes a model runs in
DATASTORE_MARKER = ".graphmax-datastore"
DATASTORE = marked("datastore", DATASTORE_MARKER, (META, KEYS, VALUES, MARGINALS, CENTROIDS, LISTS))
_MARGINAL_SUM = 1e-6  # relative: float64 sums of float32 softmax rows stay far within it
_MAX_LISTS = 1 << 20
_MAX_META = 1 << 20
_MAX_DIM = 1 << 16
_FIX = "write it again with `graphmax datastore` (or gm_solver.build_datastore)"


@dataclass(frozen=True)
class DatastoreArrays:
    """A checked datastore: ``keys`` (N, dim) float16 and ``values`` (N,) int32, read into memory, its metadata
    (``vocab_size``, ``tokenizer``, ``model``, ``model_sha256``, ``positions``, ``documents``), when it has an
    inverted-file index, ``ivf`` = (centroids (lists, dim) float32, offsets (lists + 1,) int64), and when it has
    them, ``marginals`` (vocab_size,) float64: the model's expected count of each token over the keys' positions."""

    keys: np.ndarray
    values: np.ndarray
    meta: dict
    ivf: tuple[np.ndarray, np.ndarray] | None = None
    marginals: np.ndarray | None = None


def write_datastore(path: str | os.PathLike, chunks: Iterable[tuple[np.ndarray, np.ndarray]], *, dim: int,
                    tokenizer: dict, model: str, model_sha256: str, positions: int, documents: int,
                    overwrite: bool = False, ivf: tuple[np.ndarray, np.ndarray] | None = None,
                    marginals: np.ndarray | None = None, buffers_sha256: str | None = None,
                    model_dtype: str | None = None) -> Path:
    """Write (keys (n, dim), values (n,)) chunks as a datastore folder at ``path``, atomically.

    Args:
        path (``str`` or ``os.PathLike``): the folder; an existing one is replaced only with ``overwrite`` and
            only if graphmax wrote it as a datastore.
        chunks (iterable of (``np.ndarray``, ``np.ndarray``)): keys (n, dim), finite, stored as float16, and the
            token ids that followed them (n,), in [0, ``vocab_size``).
        dim (``int``): the keys' width (the LM head's input width), in [1, 65536].
        tokenizer (``dict``): ``TokenizerIdentity.to_dict()`` of the tokenizer (name, vocab_size, vocab_sha256,
            and optionally split_sha256); every value is below its ``vocab_size``, and a reader checks its
            vocabulary against the graph's.
        model (``str``): the model's name, for messages.
        model_sha256 (``str``): a fingerprint of its weights (``gm_solver.datastore.model_fingerprint``), which a
            reader checks against the model that decodes.
        positions (``int``): the positions kept per document.
        documents (``int``): how many documents gave keys.
        overwrite (``bool``, defaults to ``False``): replace a datastore graphmax wrote at ``path``.
        ivf (``(np.ndarray, np.ndarray)`` or ``None``): an inverted-file index of the keys as given: centroids
            (lists, dim), finite, and offsets (lists + 1,) from 0 to the number of keys, non-decreasing (the chunks
            then come list after list).
        marginals (``np.ndarray`` (vocab_size,) or ``None``): the model's expected count of each token over the
            keys' positions (finite, >= 0, summing to the number of keys); read once the chunks are consumed, so a
            chunk generator may fill it as it goes.
        buffers_sha256 (``str`` or ``None``): a fingerprint of the model's buffers
            (``gm_solver.datastore.buffers_fingerprint``: its rotary frequencies, which the config sets and no
            parameter shows), checked like ``model_sha256`` when recorded.
        model_dtype (``str`` or ``None``): the dtype the model ran in (``"float32"``, ``"bfloat16"``,
            ``"float16"``), so that a reader whose model differs only by its dtype can say which one to pass.

    Returns:
        ``pathlib.Path``: ``path``.

    Raises:
        DatastoreError: a chunk of the wrong shape, with non-finite keys or out-of-range values, no keys at all, or
            an index that does not cover the keys; nothing is left at ``path`` (or the old datastore is).

    Example::

        >>> import tempfile, numpy as np; from pathlib import Path
        >>> tmp = Path(tempfile.mkdtemp())
        >>> keys, values = np.eye(3, 4, dtype=np.float32), np.array([2, 0, 1])
        >>> tok = {"name": "t", "vocab_size": 3, "vocab_sha256": "0" * 64}
        >>> _ = write_datastore(tmp / "ds", [(keys, values)], dim=4, tokenizer=tok, model="m", model_sha256="1" * 64,
        ...                     positions=8, documents=1)
        >>> store = open_datastore(tmp / "ds")
        >>> store.keys.shape, store.values.tolist()
        ((3, 4), [2, 0, 1])
    """
    tokenizer = _checked_tokenizer(tokenizer)
    if tokenizer is None or not (_int(dim) and 1 <= dim <= _MAX_DIM) or not is_sha256(model_sha256) \
            or not (_int(positions) and positions >= 0 and _int(documents) and documents >= 0) \
            or not (buffers_sha256 is None or is_sha256(buffers_sha256)) \
            or not (model_dtype is None or model_dtype in MODEL_DTYPES):
        raise DatastoreError(f"write_datastore needs dim in [1, {_MAX_DIM}], a tokenizer identity (name, vocab_size "
                             f"below 2**31, vocab_sha256, and split_sha256 if any), a model_sha256 (and "
                             f"buffers_sha256, if any), a model_dtype among {', '.join(MODEL_DTYPES)} (if any) "
                             f"and counts >= 0; got dim={dim!r}, model_dtype={model_dtype!r}, "
                             f"tokenizer={tokenizer!r}, positions={positions!r}, documents={documents!r}")
    vocab_size = tokenizer["vocab_size"]
    if ivf is not None:
        ivf = checked_ivf(ivf, dim)
    path = Path(path)
    with staged_folder(path, overwrite=overwrite, artefact=DATASTORE) as tmp:
        (tmp / DATASTORE_MARKER).write_text("a kNN datastore written by graphmax\n")
        n = 0
        with open(tmp / KEYS, "wb") as kf, open(tmp / VALUES, "wb") as vf:
            # headers of the widest length first, filled in at the end (numpy pads them to one size)
            kf.write(npy.write_header(KEY_DTYPE, npy.WIDEST))
            vf.write(npy.write_header(VALUE_DTYPE, npy.WIDEST))
            for keys, values in chunks:
                half, ids = checked_chunk(keys, values, dim, vocab_size)
                kf.write(half.tobytes())
                vf.write(ids.tobytes())
                n += ids.size
                fault_point("datastore.chunk")
            if n == 0:
                raise DatastoreError("no keys to store: every document was shorter than two tokens; give longer "
                                     "documents")
            kf.seek(0)
            kf.write(npy.write_header(KEY_DTYPE, n * dim))
            vf.seek(0)
            vf.write(npy.write_header(VALUE_DTYPE, n))
        names = [KEYS, VALUES]
        if ivf is not None:
            centroids, offsets = ivf
            checked_ivf(ivf, dim, n)
            for name, array, dtype in ((CENTROIDS, centroids, CENTROID_DTYPE), (LISTS, offsets, LIST_DTYPE)):
                with open(tmp / name, "wb") as fh:
                    fh.write(npy.write_header(dtype, array.size))
                    fh.write(np.ascontiguousarray(array, dtype=dtype).tobytes())
            names += [CENTROIDS, LISTS]
        if marginals is not None:
            with open(tmp / MARGINALS, "wb") as fh:
                fh.write(npy.write_header(MARGINAL_DTYPE, vocab_size))
                fh.write(checked_marginals(marginals, vocab_size, n).tobytes())
            names.append(MARGINALS)
        files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)} for name in names}
        meta = {"format": FORMAT, "version": VERSION, "keys": n, "dim": dim, "vocab_size": vocab_size,
                "tokenizer": tokenizer, "model": str(model), "model_sha256": model_sha256,
                "positions": positions, "documents": documents, "files": files}
        if ivf is not None:
            meta["ivf_lists"] = int(ivf[0].shape[0])
        if buffers_sha256 is not None:
            meta["buffers_sha256"] = buffers_sha256
        if model_dtype is not None:
            meta["model_dtype"] = model_dtype
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        fault_point("datastore.written")
    return path


def checked_chunk(keys: object, values: object, dim: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys (n, ``dim``) float16, values (n,) int32), contiguous, as a datastore stores them, if ``keys`` and
    ``values`` are a sound chunk of :func:`write_datastore` (finite in float16, token ids in [0, ``vocab_size``)),
    else a DatastoreError.

    Example::

        >>> half, ids = checked_chunk(np.ones((2, 3)), [4, 0], dim=3, vocab_size=5)
        >>> half.dtype, half.shape, ids.dtype, ids.tolist()
        (dtype('float16'), (2, 3), dtype('int32'), [4, 0])
    """
    keys, values = np.asarray(keys), np.asarray(values)
    if keys.ndim != 2 or keys.shape[1] != dim or values.shape != (keys.shape[0],):
        raise DatastoreError(f"a datastore chunk has keys {keys.shape} and values {values.shape}; expected (n, {dim}) "
                             f"and (n,)")
    if not (np.issubdtype(values.dtype, np.integer) or values.size == 0) or not np.issubdtype(keys.dtype, np.number):
        raise DatastoreError(f"a datastore chunk has {keys.dtype} keys and {values.dtype} values; keys are numbers and "
                             f"values token ids (integers)")
    half = np.ascontiguousarray(keys, dtype=KEY_DTYPE)
    if not np.isfinite(half).all():
        raise DatastoreError("a datastore chunk has keys that are not finite in float16 (NaN, inf, or beyond ±65504); "
                             "check the model's hidden states")
    if values.size and (values.min() < 0 or values.max() >= vocab_size):
        raise DatastoreError(f"a datastore chunk has token ids outside [0, {vocab_size}); use the tokenizer the "
                             f"datastore is for")
    return half, np.ascontiguousarray(values, dtype=VALUE_DTYPE)


def checked_marginals(marginals: object, vocab_size: int, keys: int) -> np.ndarray:
    """``marginals`` as float64 (vocab_size,) if they are a sound record of a model's expected token counts over
    ``keys`` positions (finite, >= 0, summing to ``keys``), else a DatastoreError.

    Example::

        >>> checked_marginals([0.5, 1.5, 0.0], vocab_size=3, keys=2).tolist()
        [0.5, 1.5, 0.0]
    """
    given = np.asarray(marginals) if not isinstance(marginals, np.ndarray) else marginals
    if given.dtype.kind not in "iuf":  # not strings, bools, complex or objects that numpy would convert
        raise DatastoreError(f"marginals must be {vocab_size} real numbers, got {given.dtype}")
    array = np.array(given, dtype=MARGINAL_DTYPE)  # a copy: the caller's array may change after the check
    if array.shape != (vocab_size,):
        raise DatastoreError(f"marginals must be {vocab_size} numbers (one per token), got shape {array.shape}")
    total = float(array.sum()) if np.isfinite(array).all() and (array >= 0).all() else float("nan")
    if not abs(total - keys) <= _MARGINAL_SUM * keys:
        raise DatastoreError(f"marginals must be finite, >= 0 and sum to the {keys} keys (a softmax per position), "
                             f"sum {total!r}")
    return array


def checked_ivf(ivf: object, dim: int, keys: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(centroids (lists, dim) float32, offsets (lists + 1,) int64) if ``ivf`` is a sound inverted-file index of
    ``keys`` keys (``None``: not known yet, the caller checks the last offset), else a DatastoreError.

    Example::

        >>> centroids, offsets = checked_ivf((np.zeros((2, 3)), [0, 4, 9]), dim=3, keys=9)
        >>> centroids.dtype, offsets.tolist()
        (dtype('float32'), [0, 4, 9])
    """
    if not (isinstance(ivf, tuple) and len(ivf) == 2):
        raise DatastoreError("ivf must be (centroids (lists, dim), offsets (lists + 1,))")
    centroids, offsets = np.asarray(ivf[0]), np.asarray(ivf[1])
    if centroids.ndim != 2 or centroids.shape[1] != dim or not 1 <= centroids.shape[0] <= _MAX_LISTS \
            or offsets.shape != (centroids.shape[0] + 1,) or not np.issubdtype(offsets.dtype, np.integer) \
            or not np.issubdtype(centroids.dtype, np.number):
        raise DatastoreError(f"the index must be centroids (lists, {dim}) with 1 to {_MAX_LISTS} lists and integer "
                             f"offsets (lists + 1,); got {centroids.shape} and {offsets.shape}")
    centroids = centroids.astype(CENTROID_DTYPE)
    # a centre is a mean of float16 keys: beyond float16's range its squared distances overflow float32 in faiss
    if not (np.abs(centroids) <= np.finfo(np.float16).max).all():
        raise DatastoreError("the index's centroids are not finite numbers within float16's range (the keys')")
    # compared, not differenced: a difference of int64 offsets can wrap around (and uint64 ones never go negative)
    if offsets.min() < 0 or offsets.max() > 2**40:
        raise DatastoreError("the index's offsets must lie in [0, 2**40]")
    offsets = offsets.astype(LIST_DTYPE)
    if offsets[0] != 0 or (offsets[1:] < offsets[:-1]).any():
        raise DatastoreError("the index's offsets must start at 0 and never decrease (lists stored one after another)")
    if keys is not None and offsets[-1] != keys:
        raise DatastoreError(f"the index's offsets end at {offsets[-1]}, but there are {keys} keys; index the keys "
                             f"that are stored")
    return centroids, offsets


def check_datastore_target(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse, before any work, a datastore target graphmax may not write: a missing parent folder, a file or folder
    graphmax did not write as a datastore, or a datastore without ``overwrite``.

    Args:
        path (``str`` or ``os.PathLike``): the folder to write.
        overwrite (``bool``, defaults to ``False``): whether a datastore graphmax wrote there may be replaced.

    Returns:
        ``pathlib.Path``: ``path``.

    Raises:
        DatastoreError, NotOwnedError, GraphExistsError: one line naming the problem and the fix.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> tmp = Path(tempfile.mkdtemp())
        >>> check_datastore_target(tmp / "ds") == tmp / "ds"
        True
        >>> check_datastore_target(tmp / "nowhere" / "ds")
        Traceback (most recent call last):
        ...
        gm_graphs.errors.DatastoreError: ...nowhere is not a folder; choose a path in an existing folder
    """
    path = Path(path)
    parent = path.absolute().parent
    if not parent.is_dir():
        raise DatastoreError(f"cannot write the datastore {path}: {parent} is not a folder; choose a path in an "
                             f"existing folder")
    check_replaceable(path, overwrite, DATASTORE)
    return path


def open_datastore(path: str | os.PathLike, verify: bool = True) -> DatastoreArrays:
    """The checked arrays of the datastore folder ``path`` (see the module's docstring for the checks).

    Args:
        path (``str`` or ``os.PathLike``): a folder written by :func:`write_datastore`.
        verify (``bool``, defaults to ``True``): also check each file's SHA-256.

    Returns:
        ``DatastoreArrays``: keys, values and metadata, in memory.

    Raises:
        DatastoreError: one line naming what is wrong with the folder and how to get a good one.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> open_datastore(Path(tempfile.mkdtemp()))
        Traceback (most recent call last):
        ...
        gm_graphs.errors.DatastoreError: ... is not a datastore folder (no .graphmax-datastore in it); ...
    """
    root = Path(path)
    try:
        st = os.lstat(root)
    except OSError as e:
        raise DatastoreError(f"datastore {root}: cannot open it ({e.strerror}); give a folder written by "
                             f"`graphmax datastore`") from None
    if stat.S_ISLNK(st.st_mode):
        raise DatastoreError(f"{root} is a symlink; give the datastore folder itself ({os.path.realpath(root)!r})")
    if not stat.S_ISDIR(st.st_mode) or not stat.S_ISREG(_lstat_mode(root / DATASTORE_MARKER)):
        raise DatastoreError(f"{root} is not a datastore folder (no {DATASTORE_MARKER} in it); give a folder written "
                             f"by `graphmax datastore`")
    meta = _read_meta(root)
    arrays = {}
    for name, dtype, length in ((KEYS, KEY_DTYPE, meta["keys"] * meta["dim"]), (VALUES, VALUE_DTYPE, meta["keys"])):
        arrays[name] = _open_array(root, name, dtype, length, meta["files"][name], verify)
    keys = arrays[KEYS].reshape(meta["keys"], meta["dim"])
    values = arrays[VALUES]
    if values.min() < 0 or values.max() >= meta["vocab_size"]:
        raise _bad(root, f"{VALUES} holds token ids outside [0, {meta['vocab_size']})")
    for lo in range(0, keys.shape[0], 1 << 16):  # in blocks: a float32 copy of a large datastore is not needed
        if not np.isfinite(keys[lo:lo + (1 << 16)]).all():
            raise _bad(root, f"{KEYS} holds keys that are not finite")
    ivf = None
    if "ivf_lists" in meta:
        lists = meta["ivf_lists"]
        centroids = _open_array(root, CENTROIDS, CENTROID_DTYPE, lists * meta["dim"], meta["files"][CENTROIDS], verify)
        offsets = _open_array(root, LISTS, LIST_DTYPE, lists + 1, meta["files"][LISTS], verify)
        try:
            ivf = checked_ivf((centroids.reshape(lists, meta["dim"]), offsets), meta["dim"], meta["keys"])
        except DatastoreError as e:
            raise _bad(root, str(e)) from None
    marginals = None
    if MARGINALS in meta["files"]:
        marginals = _open_array(root, MARGINALS, MARGINAL_DTYPE, meta["vocab_size"], meta["files"][MARGINALS], verify)
        try:
            marginals = checked_marginals(marginals, meta["vocab_size"], meta["keys"])
        except DatastoreError as e:
            raise _bad(root, str(e)) from None
    return DatastoreArrays(keys, values, meta, ivf, marginals)


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def _bad(root: Path, what: str) -> DatastoreError:
    return DatastoreError(f"datastore {root}: {what}; {_FIX}")


def _int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _positive_int(meta: dict, key: str) -> bool:
    v = meta.get(key)
    return _int(v) and 1 <= v < 2**40


def _checked_tokenizer(t: object) -> dict | None:
    """A tokenizer identity (``TokenizerIdentity.to_dict()``) as plain values, or None if it is not one; its
    ``split_sha256`` is optional, as in a graph's manifest."""
    if not isinstance(t, dict) or not _int(t.get("vocab_size")) or not 1 <= t["vocab_size"] < 2**31 \
            or not is_sha256(t.get("vocab_sha256")) or not ("split_sha256" not in t or is_sha256(t["split_sha256"])):
        return None
    return {"name": str(t.get("name", "")), "vocab_size": int(t["vocab_size"]), "vocab_sha256": t["vocab_sha256"],
            **({"split_sha256": t["split_sha256"]} if "split_sha256" in t else {})}


def _read_meta(root: Path) -> dict:
    with os.fdopen(open_inside(root, META, lambda what: _bad(root, what)), "rb") as fh:
        if os.fstat(fh.fileno()).st_size > _MAX_META:
            raise _bad(root, f"{META} is larger than {_MAX_META} bytes")
        try:
            meta = json.loads(fh.read(_MAX_META + 1).decode("utf-8"))
        except (ValueError, RecursionError):
            raise _bad(root, f"{META} is not JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(root, f"{META} is not a graphmax datastore's (format {FORMAT!r})")
    version = meta.get("version")
    if not _int(version):  # '2', 2.0 or true would read as a mismatch of equal versions, or pass as 2
        got = "but it is missing (or null)" if version is None else \
            f"got {repr(version)[:60]} (a {type(version).__name__})"
        raise _bad(root, f"{META} field version should be an integer, {got}; this graphmax reads version {VERSION}")
    if version != VERSION:
        raise _bad(root, f"it is of format version {version!r}; this graphmax reads version {VERSION}")
    if not all(_positive_int(meta, k) for k in ("keys", "dim", "vocab_size")) or meta["dim"] > _MAX_DIM \
            or meta["vocab_size"] >= 2**31:
        raise _bad(root, f"{META} has no valid keys, dim and vocab_size (ints >= 1)")
    if "ivf_lists" in meta and not (_positive_int(meta, "ivf_lists") and meta["ivf_lists"] <= _MAX_LISTS):
        raise _bad(root, f"{META} has an ivf_lists that is not an int in [1, {_MAX_LISTS}]")
    files = meta.get("files")
    names = (KEYS, VALUES, *((CENTROIDS, LISTS) if "ivf_lists" in meta else ()),
             *((MARGINALS,) if isinstance(files, dict) and MARGINALS in files else ()))
    if not isinstance(files, dict) or not all(
            isinstance(files.get(n), dict) and isinstance(files[n].get("bytes"), int)
            and isinstance(files[n].get("sha256"), str) for n in names):
        raise _bad(root, f"{META} does not record {', '.join(names)} (bytes and sha256)")
    tokenizer = _checked_tokenizer(meta.get("tokenizer"))
    if tokenizer is None or tokenizer["vocab_size"] != meta["vocab_size"] or not is_sha256(meta.get("model_sha256")):
        raise _bad(root, f"{META} does not identify its tokenizer (name, vocab_size, vocab_sha256) and model "
                         f"(model_sha256)")
    if "buffers_sha256" in meta and not is_sha256(meta["buffers_sha256"]):
        raise _bad(root, f"{META} has a buffers_sha256 that is not 64 lowercase hex digits")
    if "model_dtype" in meta and meta["model_dtype"] not in MODEL_DTYPES:  # absent in datastores written before it
        raise _bad(root, f"{META} has a model_dtype that is none of {', '.join(MODEL_DTYPES)}: "
                         f"{repr(meta['model_dtype'])[:40]}")
    meta["tokenizer"], meta["model"] = tokenizer, str(meta.get("model", ""))
    for key in ("positions", "documents"):
        meta[key] = meta[key] if _int(meta.get(key)) and meta[key] >= 0 else 0
    return meta


def _open_array(root: Path, name: str, dtype: np.dtype, length: int, entry: dict, verify: bool) -> np.ndarray:
    # read into memory through the checked descriptor: see RecordedFile.read
    with RecordedFile(root, name, entry["bytes"], lambda what: _bad(root, what), META) as f:
        f.read_header((dtype,), length)
        return f.read(entry["sha256"] if verify else None)
