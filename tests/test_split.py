"""The train / held-out split: deterministic, by document, and no held-out text ever reaches the graph."""

from __future__ import annotations

import pytest

from gm_graphs import count_corpus, split_corpus
from gm_graphs.errors import GraphExistsError, OptionError


def test_split_is_deterministic_disjoint_and_complete(csv_corpus, tmp_path):
    path, docs = csv_corpus
    a = split_corpus(path, tmp_path / "a", heldout_fraction=0.3, seed=1)
    b = split_corpus(path, tmp_path / "b", heldout_fraction=0.3, seed=1)
    c = split_corpus(path, tmp_path / "c", heldout_fraction=0.3, seed=2)
    train, held = a.texts("train"), a.texts("heldout")
    assert sorted(train + held) == sorted(docs)
    assert not set(train) & set(held)  # duplicates of a text always land on the same side
    assert (train, held) == (b.texts("train"), b.texts("heldout"))
    assert held != c.texts("heldout")
    assert a.documents == {"train": len(train), "heldout": len(held)} and 0 < len(held) < len(docs)


def test_graph_from_the_training_side_counts_no_heldout_bigram(csv_corpus, tmp_path, bpe_tokenizer):
    path, _ = csv_corpus
    split = split_corpus(path, tmp_path / "s", heldout_fraction=0.3, seed=0)
    train_counts = count_corpus(split.path("train"), bpe_tokenizer, progress=False).counts
    full = count_corpus(path, bpe_tokenizer, progress=False).counts
    held = count_corpus(split.path("heldout"), bpe_tokenizer, progress=False).counts
    assert train_counts.total + held.total == full.total
    assert train_counts.documents == split.documents["train"]
    assert (train_counts.merge(held).to_csr() != full.to_csr()).nnz == 0


def test_bad_arguments_and_existing_folders(csv_corpus, tmp_path):
    path, _ = csv_corpus
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_corpus(path, tmp_path / "x", heldout_fraction=1.0)
    split_corpus(path, tmp_path / "y")
    with pytest.raises(GraphExistsError):
        split_corpus(path, tmp_path / "y")
    with pytest.raises(ValueError, match="split is empty"):
        split_corpus(path, tmp_path / "z", heldout_fraction=1e-9)
    assert not (tmp_path / "z").exists()


def test_a_split_is_never_written_over_a_file_a_user_put_into_it(csv_corpus, tmp_path):
    from gm_graphs.errors import NotOwnedError

    path, _ = csv_corpus
    a = split_corpus(path, tmp_path / "a", heldout_fraction=0.3, seed=1)
    (tmp_path / "a" / "notes.txt").write_text("the user's")
    with pytest.raises(NotOwnedError, match="holds 'notes.txt', which graphmax did not write"):
        split_corpus(path, tmp_path / "a", heldout_fraction=0.3, seed=2, overwrite=True)
    assert (tmp_path / "a" / "notes.txt").read_text() == "the user's" and a.texts("heldout") == split_corpus(
        path, tmp_path / "b", heldout_fraction=0.3, seed=1).texts("heldout")


@pytest.mark.parametrize("options, message", [
    ({"seed": 10**70}, r"seed must be an integer from 0 to 2\*\*64 - 1, got 1000"),
    ({"seed": -1}, r"seed must be an integer from 0 to 2\*\*64 - 1, got -1"),
    ({"seed": "1"}, r"seed must be an integer .* got '1'"),
    ({"batch_docs": 0}, r"batch_docs must be an integer >= 1 \(documents read per batch\), got 0"),
    ({"batch_docs": -5}, r"batch_docs must be an integer >= 1 .* got -5"),
    ({"heldout_fraction": "0.1"}, r"heldout_fraction must be a number strictly between 0 and 1, got '0.1'"),
    ({"heldout_fraction": float("nan")}, r"heldout_fraction must be a number strictly between 0 and 1, got nan"),
])
def test_each_bad_option_is_refused_in_one_line_naming_it_before_anything_is_written(csv_corpus, tmp_path, options,
                                                                                      message):
    with pytest.raises(OptionError, match=message):
        split_corpus(csv_corpus[0], tmp_path / "s", **options)
    assert not (tmp_path / "s").exists()

