"""The model cache (pipelines/model_cache.py): a GGUF model converted once into a checked ``save_pretrained`` folder,
on a two-layer Llama GGUF file written here with the gguf package's own writer (Q8_0 weights, as a quantised file
has them), and once on the bundled SmolLM2 (slow)."""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gm_graphs import GraphmaxError, load_tokenizer
from gm_graphs.store.sealed import seal
from pipelines import model_cache, models
from pipelines.models import load_model, model_folder

from .helpers import finishes_within, forked, tokenizer_gguf

INPUT = torch.tensor([[5, 60, 7, 98, 99, 100, 3, 40]])


def write_tiny_model_gguf(path: Path, seed: int = 0) -> Path:
    """A Llama GGUF file (hidden size 32, two layers, grouped-query attention, tied embeddings) around a byte-level
    BPE tokenizer of the printable ASCII characters, ChatML's special tokens and "the"; its matrices are Q8_0."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    hidden, ff, heads, kv = 32, 64, 4, 2
    rng = np.random.default_rng(seed)
    w, tokens = tokenizer_gguf(path)
    for key, value in (("context_length", 64), ("embedding_length", hidden), ("block_count", 2),
                       ("feed_forward_length", ff), ("head_count", heads), ("head_count_kv", kv),
                       ("layer_norm_rms_eps", 1e-5), ("rope_freq_base", 10000.0)):
        getattr(w, f"add_{key}")(value)

    def tensor(name: str, shape: tuple[int, ...]) -> None:
        values = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, quantize(values, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)

    tensor("token_embd.weight", (len(tokens), hidden))
    for b in range(2):
        for name, shape in (("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv * 8, hidden)),
                            ("attn_v", (kv * 8, hidden)), ("attn_output", (hidden, hidden)), ("ffn_norm", (hidden,)),
                            ("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden)), ("ffn_down", (hidden, ff))):
            tensor(f"blk.{b}.{name}.weight", shape)
    tensor("output_norm.weight", (hidden,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture()
def fresh(monkeypatch):
    """The once-per-process warning, as a new process has it."""
    monkeypatch.setattr(models, "_warned", False)


@pytest.fixture()
def tiny(tmp_path, monkeypatch, fresh):
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "home"))
    (tmp_path / "gguf").mkdir()
    return write_tiny_model_gguf(tmp_path / "gguf" / "tiny.gguf")


def _direct(path: Path, dtype=torch.float32):
    """The model as transformers reads the GGUF file itself, without graphmax. Only gguf's tensor-name map, which
    transformers makes again for each submodule (397 times for SmolLM2: 5–8 s of the 16), is made once: a function
    of the architecture and the number of layers alone, of which transformers only looks names up."""
    import gguf

    with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)


def _conversions(monkeypatch) -> list[str]:
    """The GGUF files transformers reads models from, from now on."""
    seen: list[str] = []
    real = AutoModelForCausalLM.from_pretrained

    def from_pretrained(name, *args, **kwargs):
        if kwargs.get("gguf_file"):
            seen.append(kwargs["gguf_file"])
        return real(name, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    return seen


def _entry(path: Path) -> Path:
    return model_cache.models_root() / model_cache.entry_key(model_cache.gguf_digest(path))


def _sound(entry: Path) -> bool:
    fd, why = model_cache._open_entry(entry, entry.name)
    if fd is not None:
        os.close(fd)
    return fd is not None and why is None


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model(INPUT).logits


def _load(path, dtype="float32"):
    """``load_model``'s model, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _tok = load_model(path, device="cpu", dtype=dtype)
    return model, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cached_model_is_the_gguf_model_bit_for_bit_and_converts_once(dtype, tiny, monkeypatch, capfd):
    direct = _direct(tiny, dtype)
    ref = _logits(direct)
    conversions = _conversions(monkeypatch)
    first, w1 = _load(tiny, dtype)
    second, w2 = _load(tiny, dtype)
    assert conversions == ["tiny.gguf"] and w1 == w2 == []
    for model in (first, second):
        logits = _logits(model)
        assert logits.dtype == dtype and torch.equal(logits, ref)
        assert model.name_or_path == str(tiny) and model.config.name_or_path == str(tiny)
        assert model.generation_config.to_dict() == direct.generation_config.to_dict()
        a, b = direct.config.to_dict(), model.config.to_dict()
        # what differs: the GGUF quantizer's record (removed before saving), the class saved, the path
        assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {"quantization_config", "architectures",
                                                                            "_name_or_path"}
    announced = [line for line in capfd.readouterr().err.splitlines() if line.startswith("graphmax: converting")]
    assert announced == [f"graphmax: converting {tiny} once into {_entry(tiny)}; later loads take about a second"]


def test_model_folder_is_a_save_pretrained_folder_of_the_model_and_its_tokenizer(tiny, monkeypatch):
    ref = _logits(_direct(tiny))
    conversions = _conversions(monkeypatch)
    folder = model_folder(tiny)
    assert folder == _entry(tiny) and conversions == ["tiny.gguf"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert torch.equal(_logits(model), ref)
    tok, ref = AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(tiny)
    assert tok.get_vocab() == ref.get_vocab() and tok("the theme<|im_end|>")["input_ids"] == ref(
        "the theme<|im_end|>")["input_ids"] and tok.chat_template == ref.chat_template
    assert model_folder(folder) == folder and conversions == ["tiny.gguf"]
    with pytest.raises(GraphmaxError, match="no model folder at .*; pass 'smollm2', a .gguf file or a folder"):
        model_folder(folder / "missing")
    with pytest.raises(GraphmaxError, match=r"cannot load the model '.*missing.gguf' \(FileNotFoundError: .*; pass"):
        model_folder(tiny.parent / "missing.gguf")


def test_the_entry_is_keyed_by_content_a_copy_shares_it_and_a_rewrite_gets_its_own(tiny, monkeypatch):
    _load(tiny)
    copy = tiny.parent / "copy.gguf"
    shutil.copyfile(tiny, copy)
    conversions = _conversions(monkeypatch)
    assert torch.equal(_logits(_load(copy)[0]), _logits(_direct(tiny))) and conversions == ["tiny.gguf"]
    write_tiny_model_gguf(tiny, seed=1)  # the same path, other weights
    model, _ = _load(tiny)
    assert torch.equal(_logits(model), _logits(_direct(tiny)))
    assert conversions == ["tiny.gguf", "tiny.gguf", "tiny.gguf"]  # the reference, the conversion, the reference
    assert len([p for p in model_cache.models_root().iterdir() if p.is_dir() and p.name != "digests"]) == 2


def _replace_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))  # in place: the same inode, a new ctime


def _foreign(entry: Path, tmp: Path) -> None:
    """Put another GGUF file's entry (another model, a sound entry of its own key) in place of ``entry``."""
    other = write_tiny_model_gguf(tmp / "other.gguf", seed=2)
    model_folder(other)
    shutil.rmtree(entry)
    os.rename(_entry(other), entry)


def _symlink(entry: Path, tmp: Path) -> None:
    real = tmp / "elsewhere"
    os.rename(entry, real)
    entry.symlink_to(real)


def _fifo(entry: Path, tmp: Path) -> None:
    shutil.rmtree(entry)
    os.mkfifo(entry)


DAMAGE = {
    "weights truncated": (lambda e, t: os.truncate(e / "model.safetensors", 1000), "has 1000 bytes"),
    "one byte of the weights changed": (lambda e, t: _replace_byte(e / "model.safetensors"),
                                        "does not match the SHA-256"),
    "config missing": (lambda e, t: (e / "config.json").unlink(), "config.json cannot be opened"),
    "junk added": (lambda e, t: (e / "adapter_config.json").write_text("{}"), "holds 'adapter_config.json'"),
    "manifest garbled": (lambda e, t: (e / model_cache.MANIFEST).write_bytes(b"junk"), "manifest"),
    "manifest sealed junk": (lambda e, t: (e / model_cache.MANIFEST).write_bytes(
        seal(model_cache._identity(e.name), b'{"files": {"../x": [1, "a"]}}')), "not one graphmax writes"),
    "another entry's": (_foreign, "manifest"),
    "a symlink": (_symlink, "is a symlink"),
    "a FIFO": (_fifo, "is not a folder"),
    "a FIFO in place of a file": (lambda e, t: ((e / "config.json").unlink(), os.mkfifo(e / "config.json")),
                                  "config.json is not a regular file"),
    "folder writable by others": (lambda e, t: e.chmod(0o777), "may be written by other users (mode 0777)"),
    "file writable by the group": (lambda e, t: (e / "model.safetensors").chmod(0o664),
                                   "model.safetensors may be written by other users"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_foreign_or_untrusted_entry_is_a_miss_with_one_warning_and_replaced(damage, tiny, tmp_path,
                                                                                       monkeypatch):
    ref = _logits(_direct(tiny))
    _load(tiny)
    entry = _entry(tiny)
    harm, why = DAMAGE[damage]
    harm(entry, tmp_path)
    conversions = _conversions(monkeypatch)
    model, caught = finishes_within(60, lambda: _load(tiny), [entry, entry / "config.json"])
    assert torch.equal(_logits(model), ref) and conversions == ["tiny.gguf"]
    assert len(caught) == 1 and caught[0].startswith(f"graphmax ignores the cached model {entry}: it ") \
        and why in caught[0] and caught[0].endswith(f"converted again from {tiny} and replaced"), caught
    assert _sound(entry) and not entry.is_symlink()
    model, caught = _load(tiny)  # replaced by a sound entry: no conversion, no warning
    assert torch.equal(_logits(model), ref) and conversions == ["tiny.gguf"] and caught == []
    assert [p.name for p in entry.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a file to another user")
def test_an_entry_another_user_owns_is_a_miss_with_one_warning(tiny, monkeypatch):
    _load(tiny)
    entry = _entry(tiny)
    os.chown(entry / "config.json", 4321, 4321)
    conversions = _conversions(monkeypatch)
    _model, caught = _load(tiny)
    assert conversions == ["tiny.gguf"] and len(caught) == 1 and "belongs to another user (uid 4321)" in caught[0]
    assert _sound(entry)


def test_an_unwritable_cache_loads_from_the_gguf_file_with_one_warning(tiny, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "file" / "home"))
    ref = _logits(_direct(tiny))
    conversions = _conversions(monkeypatch)
    (first, w1), (second, w2) = _load(tiny), _load(tiny, "bfloat16")
    assert torch.equal(_logits(first), ref) and torch.equal(_logits(second), _logits(_direct(tiny, torch.bfloat16)))
    assert conversions[:2] == ["tiny.gguf", "tiny.gguf"]
    assert len(w1) == 1 and w2 == [], (w1, w2)  # the tokenizer cache's own warning is folded into this one
    assert w1[0].startswith(f"graphmax cannot cache the model {tiny}: writing in {tmp_path}/file/home/models failed "
                            f"(Not a directory); it is read from the GGUF file at each load")
    assert w1[0].endswith("set GRAPHMAX_HOME to a writable folder")
    with pytest.raises(GraphmaxError, match="cannot write the model cache in .*Not a directory.*GRAPHMAX_HOME"):
        model_folder(tiny)


@pytest.fixture()
def homes(tiny, tmp_path, monkeypatch):
    """A function making a home that holds the tiny file's tokenizer cache and SHA-256 (so that the first sealed
    write of a load is the entry's manifest), and, with ``damaged``, an entry to replace."""
    base = tmp_path / "base"
    monkeypatch.setenv("GRAPHMAX_HOME", str(base))
    load_tokenizer(tiny)
    model_cache.gguf_digest(tiny)
    count = iter(range(1000))

    def make(damaged: bool) -> Path:
        home = tmp_path / f"home{next(count)}"
        shutil.copytree(base, home)
        if damaged:
            entry = home / "models" / _entry(tiny).name
            entry.mkdir()
            (entry / "config.json").write_text("{}")
        return home

    return make


@pytest.mark.parametrize("damaged", [False, True], ids=["empty cache", "damaged entry"])
def test_a_kill_at_any_point_of_the_conversion_leaves_no_entry_or_the_whole_entry(damaged, tiny, homes, tmp_path,
                                                                                   monkeypatch):
    ref = _logits(_direct(tiny))
    log = tmp_path / "points"
    assert forked(lambda: load_model(tiny), {"GRAPHMAX_HOME": str(homes(damaged)), "GRAPHMAX_FAULT_LOG": str(log)},
                  tmp_path / "err") == 0, (tmp_path / "err").read_text()
    points = list(dict.fromkeys(log.read_text().split()))
    expected = ["model_cache.staged", "model_cache.saved", "sealed.written", "model_cache.synced",
                "model_cache.renamed"]
    assert points == (expected[:4] + ["model_cache.moved_aside"] + expected[4:] if damaged else expected)
    for point in points:
        home = homes(damaged)
        code = forked(lambda: load_model(tiny), {"GRAPHMAX_HOME": str(home), "GRAPHMAX_FAULT": point},
                      tmp_path / "err")
        assert code == 137, (point, (tmp_path / "err").read_text())
        monkeypatch.setenv("GRAPHMAX_HOME", str(home))
        entry = _entry(tiny)
        whole = point == "model_cache.renamed"  # killed after the rename: the entry is there, whole
        assert _sound(entry) == whole, point
        if not whole:  # nothing there, or the damaged entry as it was
            gone = not damaged or point == "model_cache.moved_aside"
            assert (not os.path.lexists(entry)) if gone else os.listdir(entry) == ["config.json"], point
        conversions = _conversions(monkeypatch)
        model, caught = _load(tiny)
        assert torch.equal(_logits(model), ref) and conversions == ([] if whole else ["tiny.gguf"]), point
        assert len(caught) == (1 if damaged and point != "model_cache.moved_aside" and not whole else 0), caught
        leftovers = [p.name for p in entry.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]
        assert _sound(entry) and (leftovers == [] or whole), (point, leftovers)  # removed by the next writer
        monkeypatch.setattr(models, "_warned", False)


@pytest.mark.parametrize("point", ["model_cache.saved", "sealed.written", "model_cache.synced"])
def test_a_failed_write_loads_the_model_with_one_warning_and_leaves_nothing(point, tiny, homes, monkeypatch):
    monkeypatch.setenv("GRAPHMAX_HOME", str(homes(False)))
    monkeypatch.setenv("GRAPHMAX_FAULT", f"{point}:enospc")
    model, caught = _load(tiny)
    assert torch.equal(_logits(model), _logits(_direct(tiny)))
    assert len(caught) == 1 and f"writing in {model_cache.models_root()} failed (No space left on device)" in \
        caught[0], caught
    assert sorted(p.name for p in model_cache.models_root().iterdir()) == [f".{_entry(tiny).name}.lock", "digests"]


# ---- the bundled SmolLM2 ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_twice(tmp_path_factory):
    """The bundled SmolLM2 read by transformers from its GGUF file, then loaded twice through an empty model cache
    (converted, then cached), in float32 on the CPU."""
    from gm_graphs import bundled

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPHMAX_HOME", str(tmp_path_factory.mktemp("home")))
        path = bundled.smollm2_gguf()
        direct = _direct(path)
        seen = _conversions(mp)
        converted = load_model("smollm2", device="cpu", dtype="float32")[0]
        cached = load_model("smollm2", device="cpu", dtype="float32")[0]
        return direct, converted, cached, seen


@pytest.mark.slow
def test_smollm2_from_the_cache_is_the_gguf_model_bit_for_bit(smollm2_twice):
    direct, converted, cached, conversions = smollm2_twice
    assert conversions == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 1004, 17, 2]])
    with torch.no_grad():
        ref = direct(ids).logits
        assert ref.shape[-1] == 49152
        assert torch.equal(converted(ids).logits, ref) and torch.equal(cached(ids).logits, ref)
    assert all(torch.equal(a, b) for a, b in zip(direct.state_dict().values(), cached.state_dict().values()))
