"""A GGUF model converted once into a ``save_pretrained`` folder that later loads memory-map.

transformers reads a GGUF model anew on every load: it parses the file's metadata twice, builds gguf's tensor-name
map once per submodule (397 times for SmolLM2-135M) and dequantises every tensor, 15-40 s for the bundled SmolLM2
on two cores. The first load of a GGUF file converts it once into ``$GRAPHMAX_HOME/models/<key>/``; later loads
read that folder (``benchmarks/model_load.py``). The folder layout::

    $GRAPHMAX_HOME/models/
        <key>/                  one entry per GGUF content and transformers version
            config.json, generation_config.json, model.safetensors     the model, float32 (save_pretrained)
            tokenizer.json, tokenizer_config.json, chat_template.jinja  the tokenizer (save_pretrained)
            graphmax-model.json                                          the manifest, a sealed file
        .<key>.lock             held (flock) by the process converting into <key>
        .<key>.tmp-<hex>/       a conversion being written (a dead writer's is removed by the next writer)
        digests/<hash>.gmd      a GGUF file's SHA-256, remembered by the file's identity

**Key.** ``<key>`` hashes the GGUF file's SHA-256 and the transformers version, so a copy of a GGUF file shares
its entry and a new transformers converts again. The SHA-256 is computed once per file identity (real path,
device, inode, size, mtime and ctime in ns) and kept in a sealed file (:mod:`gm_graphs.store.sealed`).

**Exactness.** The weights are saved in float32, the dtype transformers dequantises GGUF tensors to before casting
them to the dtype asked for; loading the entry in any dtype makes the same cast, so the model is the one a direct
GGUF load gives, bit for bit.

**Writes.** A conversion fills ``.<key>.tmp-<hex>/``, fsyncs every file and the folder, then renames it to
``<key>`` (a damaged entry is first renamed aside and removed after), all under ``.<key>.lock``: a kill at any
point leaves no entry or the whole entry.

**Checks.** The entry is opened once as a folder, without following a symlink and without blocking, and must be a
folder of this user's (or root's) that no other user may write; its manifest, sealed with the key, must list
exactly the files in it, each a regular file of the same owner rule and of the recorded size and SHA-256 (hashed
once per file identity, then remembered by :mod:`gm_graphs.store.verified`, so a later check costs a few
``stat`` calls). Anything else is a miss: one warning, converted again and replaced. The model is then read
through the checked folder's descriptor (``/proc/self/fd/<n>``), so a folder put in its place after the check is
never read. A cache that cannot be written means the model loads from the GGUF file, with one warning per process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

from gm_graphs import graphmax_home
from gm_graphs.store.faults import fault_point
from gm_graphs.store.folders import fsync_dir, sync_tree
from gm_graphs.store.sealed import read_sealed, trusted, write_sealed
from gm_graphs.store.verified import FileIdentity, is_verified, remember
from gm_graphs.tokenize.gguf import read_once

FORMAT_VERSION = 1  # bump when the entry's layout or the conversion changes: older entries are then not read
MANIFEST = "graphmax-model.json"
_MAX_MANIFEST = 1 << 20
_MAX_FILES = 64
_CHUNK = 8 << 20
_FD_FOLDERS = os.path.isdir("/proc/self/fd")  # Linux: a folder is read through its descriptor


def models_root() -> Path:
    """``$GRAPHMAX_HOME/models``, where converted models are kept."""
    return graphmax_home() / "models"


def _sha256_of_fd(fd: int) -> str:
    digest = hashlib.sha256()
    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_digest(path: Path) -> str:
    """The SHA-256 of the GGUF file ``path``, hashed once per file identity and remembered in a sealed file."""
    real = os.path.realpath(path)
    fd = os.open(real, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        identity = ("gguf-sha256", real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        memo = models_root() / "digests" / (hashlib.sha256(repr(identity).encode()).hexdigest()[:32] + ".gmd")
        payload = read_sealed(memo, identity, 256)  # the seal's 48 bytes and the 64 hex digits
        if payload is not None and re.fullmatch(rb"[0-9a-f]{64}", payload):
            return payload.decode()
        digest = _sha256_of_fd(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):  # best effort: an unwritable home hashes again next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_sealed(memo, identity, digest.encode())
    return digest


def entry_key(digest: str) -> str:
    """The name of the cache entry of a GGUF file of SHA-256 ``digest``, for this transformers."""
    import transformers

    return hashlib.sha256(repr(("graphmax-model", FORMAT_VERSION, digest, transformers.__version__)).encode()
                          ).hexdigest()[:32]


# ---- reading an entry ---------------------------------------------------------------------------------------------

def _identity(key: str) -> tuple:
    return ("graphmax-model", FORMAT_VERSION, key)


def _fd_path(fd: int, folder: Path) -> str:
    return f"/proc/self/fd/{fd}" if _FD_FOLDERS else str(folder)


def _check_file(dirfd: int, folder: Path, name: str, size: int, sha256: str, key: str) -> str | None:
    """None when ``name`` in the open folder is a trusted regular file of ``size`` bytes and SHA-256 ``sha256``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError as e:
        return f"its file {name} cannot be opened ({e.strerror})"
    try:
        st = os.fstat(fd)
        if (why := trusted(st)) is not None:
            return f"its file {name} {why}"
        if st.st_size != size:
            return f"its file {name} has {st.st_size} bytes, not the {size} its manifest records"
        files = [FileIdentity.of(str(folder / name), st, sha256)]
        if not is_verified("model-file", {"key": key}, files):
            if _sha256_of_fd(fd) != sha256:
                return f"its file {name} does not match the SHA-256 its manifest records"
            remember("model-file", {"key": key}, files)
    except OSError as e:
        return f"its file {name} cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    return None


def _manifest(dirfd: int, folder: Path, key: str) -> dict | str:
    payload = read_sealed(os.path.join(_fd_path(dirfd, folder), MANIFEST), _identity(key), _MAX_MANIFEST)
    if payload is None:
        return f"its manifest {MANIFEST} is missing, damaged or another entry's"
    try:
        files = json.loads(payload)["files"]
        if (isinstance(files, dict) and 0 < len(files) <= _MAX_FILES
                and all(isinstance(k, str) and os.path.basename(k) == k and k not in ("", ".", "..", MANIFEST)
                        and isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
                        and isinstance(v[1], str) for k, v in files.items())):
            return files
    except (ValueError, KeyError, TypeError):
        pass
    return f"its manifest {MANIFEST} is not one graphmax writes"


def _open_entry(folder: Path, key: str) -> tuple[int | None, str | None]:
    """``(descriptor, None)`` for a sound entry at ``folder``; ``(None, None)`` where there is none; ``(None, why)``
    for anything else there, ``why`` saying what is wrong in a few words."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        try:
            st = os.lstat(folder)
        except OSError:
            return None, None  # nothing there (or no folder it could be in)
        return None, "is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a folder"
    why = None
    try:
        st = os.fstat(fd)
        if st.st_uid not in (os.getuid(), 0):
            why = f"belongs to another user (uid {st.st_uid})"
        elif st.st_mode & 0o022:
            why = f"may be written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
        else:
            files = _manifest(fd, folder, key)
            if isinstance(files, str):
                why = files
            else:
                extra = sorted(set(os.listdir(fd)) - set(files) - {MANIFEST})
                if extra:
                    why = f"holds {extra[0]!r}, which graphmax did not write"
                for name, (size, sha256) in files.items():
                    why = why or _check_file(fd, folder, name, size, sha256, key)
    except OSError as e:
        why = f"cannot be read ({e.strerror})"
    if why is not None:
        os.close(fd)
        return None, why
    return fd, None


# ---- writing an entry ---------------------------------------------------------------------------------------------

class CacheUnwritable(Exception):
    """The cache could not be written in ``where`` for ``why``; ``model`` is the converted float32 model, if any."""

    def __init__(self, where: str, why: str, ignored: str | None = None, model=None):
        super().__init__(why)
        self.where, self.why, self.ignored, self.model = where, why, ignored, model


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def load_gguf(path: Path, dtype):
    """The model in the GGUF file ``path``, read by transformers (no cache), in ``dtype``."""
    from transformers import AutoModelForCausalLM

    with read_once():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)


def _save(model, tok, folder: Path, key: str) -> dict:
    """Write the converted model, its tokenizer and the manifest into the empty ``folder``, and sync them; returns
    the manifest's files (name: [size, SHA-256])."""
    model.hf_quantizer = None  # save_pretrained refuses a model whose quantizer cannot serialise (GGUF's)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    fault_point("model_cache.saved")
    files = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        os.chmod(entry.path, 0o644)  # whatever the umask: a group-writable entry would be refused
        fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            files[entry.name] = [os.fstat(fd).st_size, _sha256_of_fd(fd)]
        finally:
            os.close(fd)
    write_sealed(folder / MANIFEST, _identity(key), json.dumps({"files": files}, sort_keys=True).encode())
    sync_tree(folder)
    fault_point("model_cache.synced")
    return files


def _remember(folder: Path, key: str, files: dict) -> None:
    """Record the files of the entry just committed as checked (``_save`` hashed them right after writing them, in a
    folder no other user may write), so that the check after the commit hashes nothing."""
    for name, (_size, sha256) in files.items():
        st = os.stat(folder / name, follow_symlinks=False)
        remember("model-file", {"key": key}, [FileIdentity.of(str(folder / name), st, sha256)])


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _commit(staged: Path, target: Path) -> None:
    """Rename ``staged`` to ``target``; whatever is at ``target`` (a damaged entry) is renamed aside first and
    removed after."""
    aside = None
    if os.path.lexists(target):
        aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(target, aside)
        fault_point("model_cache.moved_aside")
    os.rename(staged, target)
    fsync_dir(target.parent)
    fault_point("model_cache.renamed")
    if aside is not None:
        _remove(aside)


def _clean_stale(root: Path, key: str) -> None:
    """Remove the folders dead writers of ``key`` left (call with its lock held: no live writer has any)."""
    pattern = re.compile(rf"\.{key}\.(tmp|old)-[0-9a-f]{{12}}")
    for entry in os.scandir(root):
        if pattern.fullmatch(entry.name):
            st = entry.stat(follow_symlinks=False)
            if st.st_uid == os.getuid():
                _remove(Path(entry.path))


@contextlib.contextmanager
def _locked(root: Path, key: str):
    """Hold ``root/.<key>.lock`` (flock; waits while another process converts the same file)."""
    fd = os.open(root / f".{key}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        if (why := trusted(os.fstat(fd))) is not None:
            raise OSError(f"its lock file {root / f'.{key}.lock'} {why}")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _convert(path: Path, key: str, ignored: str | None):
    """Convert the GGUF file ``path`` into the entry ``key``; returns the converted float32 model. Raises
    :class:`CacheUnwritable`."""
    import torch

    from gm_graphs import load_tokenizer

    root = models_root()
    target = root / key
    staged = root / f".{key}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        os.mkdir(staged, 0o755)
        os.chmod(staged, 0o755)
    except OSError as e:
        raise CacheUnwritable(str(root), _reason(e), ignored) from e
    print(f"graphmax: converting {path} once into {target}; later loads take about a second", file=sys.stderr,
          flush=True)
    model = None
    try:
        fault_point("model_cache.staged")
        model = load_gguf(path, torch.float32)
        files = _save(model, load_tokenizer(path), staged, key)
        _commit(staged, target)
        _remember(target, key, files)
    except BaseException as e:
        with contextlib.suppress(OSError):
            _remove(staged)
        if isinstance(e, Exception) and model is not None:  # tokenizers' writer raises a plain Exception
            raise CacheUnwritable(str(root), _reason(e), ignored, model) from e
        raise
    return model


@dataclass(frozen=True)
class Entry:
    """A checked cache entry: ``path``, where it is; ``read_path``, a path that reads the checked folder (through its
    descriptor) while :func:`cached_entry`'s context lasts; ``converted``, the float32 model when this load
    converted it, else None."""

    path: Path
    read_path: Path
    converted: object = None


@contextlib.contextmanager
def cached_entry(path: Path):
    """The checked cache entry (:class:`Entry`) of the GGUF file ``path``, converted first where there is none or it
    is unsound; an unsound one gets one warning that names it and says what is wrong. Raises
    :class:`CacheUnwritable` where the entry cannot be written, and what transformers raises for a GGUF file it
    cannot read."""
    key = entry_key(gguf_digest(path))
    root, target = models_root(), models_root() / key
    fd, why = _open_entry(target, key)
    model = None
    if fd is None:
        with contextlib.ExitStack() as stack:
            try:
                root.mkdir(parents=True, exist_ok=True)
                stack.enter_context(_locked(root, key))
            except OSError as e:
                raise CacheUnwritable(str(root), _reason(e), why) from e
            fd, why_now = _open_entry(target, key)  # another process may have written it while this one waited
            if fd is None:
                why = why_now or why
                _clean_stale(root, key)
                model = _convert(path, key, why)
                fd, broken = _open_entry(target, key)
                if fd is None:
                    raise CacheUnwritable(str(target), f"the entry just written {broken}", why, model)
                if why is not None:
                    warnings.warn(f"graphmax ignores the cached model {target}: it {why}; it was converted again "
                                  f"from {path} and replaced", RuntimeWarning, stacklevel=3)
    try:
        yield Entry(target, Path(_fd_path(fd, target)), model)
    finally:
        os.close(fd)
