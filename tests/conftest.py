"""Shared fixtures: a small BPE tokenizer trained here, tiny corpora, the real SmolLM2 tokenizer and model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", deadline=None, max_examples=30, derandomize=True)
settings.load_profile("ci")

WORDS = ("the movie was good bad great awful plot actor acting scene film story boring fun "
         "I loved hated it this that and but so very not really").split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))) for _ in range(n)]


@pytest.fixture(scope="session")
def bpe_tokenizer_file(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(make_docs(400, seed=1), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def bpe_tokenizer(bpe_tokenizer_file):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(bpe_tokenizer_file), bos_token="<s>", eos_token="</s>")


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture()
def csv_corpus(tmp_path) -> tuple[Path, list[str]]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    docs = make_docs(120, seed=2)
    path = tmp_path / "corpus.csv"
    pacsv.write_csv(pa.table({"id": list(range(len(docs))), "text": docs}), path)
    return path, docs


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from gm_graphs import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def smollm2():
    from pipelines.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def drug_graph(tmp_path_factory, smollm2_tokenizer):
    from gm_graphs import build_graph, bundled

    out = tmp_path_factory.mktemp("graphs") / "drugs"
    return build_graph(bundled.drug_reviews_zip(), smollm2_tokenizer, path=out, text_column="review",
                       clean=True, orders=(1, 2), progress=False)


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> None:
    path.write_text("".join(json.dumps({key: d}) + "\n" for d in docs))
