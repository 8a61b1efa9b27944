"""Shared pytest fixtures: a small BPE tokenizer trained here, tiny corpora, the real SmolLM2 tokenizer and model
(plain helpers, imported by the test files, are in helpers.py)."""

from __future__ import annotations

import copy
import importlib
import os
from pathlib import Path

import pytest
from hypothesis import settings

from .helpers import make_docs

# no resident process (pipelines/resident.py) outlives a test's command: tests/test_resident.py sets it on for its own
os.environ["GRAPHMAX_RESIDENT"] = "0"
settings.register_profile("ci", deadline=None, max_examples=30, derandomize=True)
settings.load_profile("ci")


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


_BUNDLED: dict = {}  # the bundled SmolLM2 and its tokenizer, loaded once per test session (per xdist worker)
_REAL_LOAD: dict = {}  # pipelines.models.load_model before the fixture below patches it
_HOME = os.environ.get("GRAPHMAX_HOME")  # the session's, before any test points it at a temporary folder


def _bundled_model():
    """The bundled SmolLM2 and its tokenizer as ``load_model`` returns them, loaded through the model cache of the
    session's ``$GRAPHMAX_HOME`` whichever test asks first: the first load on a machine converts the GGUF file
    once, the others (every later session, every other xdist worker) read the cached folder in about a second."""
    from pipelines import models

    load_model = _REAL_LOAD.setdefault("load_model", models.load_model)  # the real one, never the patched
    if not _BUNDLED:
        with pytest.MonkeyPatch.context() as mp:
            if _HOME is None:
                mp.delenv("GRAPHMAX_HOME", raising=False)
            else:
                mp.setenv("GRAPHMAX_HOME", _HOME)
            _BUNDLED["model"] = load_model(models.DEFAULT_MODEL)
    return _BUNDLED["model"]


@pytest.fixture(scope="session")
def smollm2():
    return _bundled_model()


def _imports_pipelines(module) -> bool:
    """Whether a test module imported anything from ``pipelines`` (a module, function or class of it)."""
    return any(str(getattr(value, "__module__", None) or getattr(value, "__name__", "")).startswith("pipelines")
               for value in vars(module).values())


@pytest.fixture(autouse=True)
def _bundled_model_loaded_once(request, monkeypatch):
    """The commands tests run in this process get a fresh copy of the bundled model (a command may change its
    model, as LoRA does) instead of loading it again; the ``smollm2`` fixture's one load goes through
    ``load_model`` itself (:func:`_bundled_model`), and the subprocess tests load it as users do. Only in the test
    modules that import ``pipelines``: the others (gm_graphs' and gm_solver's own, and the doctests) run no
    command, and would import the five command modules, and transformers with them, for nothing."""
    if request.module is None or not _imports_pipelines(request.module):
        return
    import torch

    from pipelines import models
    from pipelines.devices import resolve_device, resolve_dtype

    real = _REAL_LOAD.setdefault("load_model", models.load_model)

    def load_model(spec: str = models.DEFAULT_MODEL, *, device=None, dtype=None):
        device = resolve_device(device)
        if spec != models.DEFAULT_MODEL or resolve_dtype(dtype, device) != torch.float32 or device.type != "cpu":
            return real(spec, device=device, dtype=dtype)
        return copy.deepcopy(_bundled_model())

    monkeypatch.setattr(models, "load_model", load_model)  # for the commands that import it when they run
    for module in ("datastore_command", "demo", "eval.cli", "generate", "tune"):
        command = importlib.import_module(f"pipelines.{module}")
        if hasattr(command, "load_model"):
            monkeypatch.setattr(command, "load_model", load_model)


@pytest.fixture(scope="session")
def drug_graph(tmp_path_factory, smollm2_tokenizer):
    from gm_graphs import build_graph, bundled

    out = tmp_path_factory.mktemp("graphs") / "drugs"
    return build_graph(bundled.drug_reviews_zip(), smollm2_tokenizer, path=out, text_column="review",
                       clean=True, orders=(1, 2), progress=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, bpe_tokenizer):
    """A 2-layer Llama over the 300-token test tokenizer, saved as a local model folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(bpe_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=bpe_tokenizer.bos_token_id, eos_token_id=bpe_tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny-model")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def built(tmp_path_factory, bpe_tokenizer_file):
    """A graph folder (Ã, Ã², n-gram tables 3 and 4) built with the test tokenizer, never tuned."""
    from gm_graphs import add_ngrams, count_corpus, write_graph

    root = tmp_path_factory.mktemp("generate")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(make_docs(300, seed=4)) + "\n")
    graph = write_graph(count_corpus(corpus, bpe_tokenizer_file, progress=False), root / "g", orders=(1, 2),
                        progress=False)
    add_ngrams(graph, corpus, bpe_tokenizer_file, (3, 4), progress=False)
    return root / "g"


@pytest.fixture()
def graph_path(built, tmp_path):
    """A fresh copy of the graph, so that a test may store a decoder choice in it."""
    import shutil

    shutil.copytree(built, tmp_path / "g")
    return tmp_path / "g"
