"""The tokenizer inside a GGUF file, converted once and cached in a sealed file (gm_graphs/tokenize/gguf.py), on a
small GGUF file written here with the gguf package's own writer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gm_graphs import load_tokenizer
from gm_graphs.store.sealed import seal
from gm_graphs.tokenize import gguf

from .helpers import forked, write_tiny_gguf

TEXTS = ["the theme", "  the\n\nthe<|im_end|>x", "é 😀 中", "<|im_start|>user\nthe<|im_end|>", ""]


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "home"))
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def _converted(path: Path):
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _assert_same(tok, ref) -> None:
    assert tok.get_vocab() == ref.get_vocab() and len(tok) == len(ref)
    for text in TEXTS:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    assert tok.special_tokens_map == ref.special_tokens_map and tok.all_special_ids == ref.all_special_ids
    assert tok.chat_template == ref.chat_template and tok.chat_template
    assert tok.decode(list(range(len(ref)))) == ref.decode(list(range(len(ref))))


def _conversions(monkeypatch) -> list[str]:
    """Counts the GGUF conversions transformers runs from now on."""
    seen: list[str] = []
    real = AutoTokenizer.from_pretrained

    def from_pretrained(name, *args, **kwargs):
        if kwargs.get("gguf_file"):
            seen.append(kwargs["gguf_file"])
        return real(name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    return seen


def _entry(path: Path) -> Path:
    return gguf.cache_file(gguf._identity(path))


def test_the_cached_tokenizer_is_the_converted_one_and_converts_once(tiny, monkeypatch):
    ref = _converted(tiny)
    conversions = _conversions(monkeypatch)
    first, second = load_tokenizer(tiny), load_tokenizer(str(tiny))
    assert conversions == ["tiny.gguf"] and _entry(tiny).is_file()
    for tok in (first, second):
        _assert_same(tok, ref)
        assert tok.name_or_path == str(tiny)


DAMAGE = {
    "empty": lambda entry, identity: entry.write_bytes(b""),
    "truncated": lambda entry, identity: entry.write_bytes(entry.read_bytes()[:-100]),
    "one byte changed": lambda entry, identity: entry.write_bytes(
        (lambda b: b[:-10] + bytes([b[-10] ^ 1]) + b[-9:])(entry.read_bytes())),
    "sealed for another file": lambda entry, identity: entry.write_bytes(
        seal(identity[:-1] + (1,), entry.read_bytes()[len(seal((), b"")):])),
    "sealed junk": lambda entry, identity: entry.write_bytes(seal(identity, b"\xff not json")),
    "sealed, a name outside its folder": lambda entry, identity: entry.write_bytes(
        seal(identity, b'{"../tokenizer.json": "{}"}')),
    "sealed, files that do not load": lambda entry, identity: entry.write_bytes(
        seal(identity, b'{"tokenizer.json": "{\\"model\\": 3}"}')),
    "a symlink": lambda entry, identity: (entry.rename(entry.with_suffix(".real")),
                                          entry.symlink_to(entry.with_suffix(".real"))),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_or_foreign_entry_is_converted_again_and_replaced(damage, tiny, monkeypatch):
    ref = _converted(tiny)
    load_tokenizer(tiny)
    entry = _entry(tiny)
    DAMAGE[damage](entry, gguf._identity(tiny))
    conversions = _conversions(monkeypatch)
    _assert_same(load_tokenizer(tiny), ref)
    assert conversions == ["tiny.gguf"] and not entry.is_symlink()
    _assert_same(load_tokenizer(tiny), ref)  # the entry was replaced by a good one
    assert conversions == ["tiny.gguf"]


def test_a_changed_gguf_file_gets_its_own_entry(tiny, monkeypatch):
    before = load_tokenizer(tiny)
    write_tiny_gguf(tiny, extra=["Ġthem"])  # the same path, another vocabulary
    after = load_tokenizer(tiny)
    assert len(after) == len(before) + 1 and "Ġthem" in after.get_vocab()
    _assert_same(after, _converted(tiny))
    assert len(list(_entry(tiny).parent.glob("*" + gguf.SUFFIX))) == 2


def test_an_unwritable_cache_converts_every_time_without_an_error(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "file" / "home"))
    conversions = _conversions(monkeypatch)
    _assert_same(load_tokenizer(path), _converted(path))
    load_tokenizer(path)
    assert conversions == ["tiny.gguf"] * 3  # two loads and the reference


@pytest.mark.parametrize("action", ["", ":raise"])
def test_a_load_killed_while_caching_leaves_no_entry_and_the_next_load_caches(action, tiny, tmp_path, monkeypatch):
    code = forked(lambda: load_tokenizer(tiny), {"GRAPHMAX_FAULT": "sealed.written" + action}, tmp_path / "err")
    assert code == (137 if not action else 1), (tmp_path / "err").read_text()
    folder = _entry(tiny).parent
    assert not _entry(tiny).exists()
    assert [p.name for p in folder.iterdir() if not p.name.endswith(".tmp")] == []
    assert len(os.listdir(folder)) == (1 if not action else 0)  # a kill leaves its temporary file, a raise does not
    conversions = _conversions(monkeypatch)
    _assert_same(load_tokenizer(tiny), _converted(tiny))
    assert _entry(tiny).is_file() and conversions == ["tiny.gguf", "tiny.gguf"]


def test_in_a_read_once_block_a_gguf_file_is_parsed_once_into_the_same_fields(tiny):
    import gguf as gguf_package

    real = gguf_package.GGUFReader
    reference = real(tiny)
    with gguf.read_once():
        first = gguf_package.GGUFReader(tiny)
        assert gguf_package.GGUFReader(tiny) is first  # the config's, the tokenizer's and the weights' reads
        with gguf.read_once():  # nested (the model's load around the tokenizer's): the same reader
            assert gguf_package.GGUFReader(tiny) is first
        assert gguf_package.GGUFReader(tiny) is first
    assert gguf_package.GGUFReader is real  # set back after the block
    assert list(first.fields) == list(reference.fields)
    for name, field in reference.fields.items():
        assert first.fields[name].contents() == field.contents(), name
    assert [t.name for t in first.tensors] == [t.name for t in reference.tensors]
    assert all((a.data == b.data).all() for a, b in zip(first.tensors, reference.tensors))
