"""``--device`` and ``--dtype``: resolved once (pipelines.devices), honoured by every command that loads a model, and
the work they name done on that device: the datastore's build, held-out scoring and decoding (CUDA tests join
where a GPU is at hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gm_graphs import GraphmaxError, add_ngrams, count_corpus, write_graph
from gm_solver import ContextGraphmaxLogitsProcessor, PaperGraphmaxLogitsProcessor, build_datastore
from pipelines import devices
from pipelines.cli import main
from pipelines.decoding import generate_texts
from pipelines.devices import resolve_device, resolve_dtype
from pipelines.heldout import perplexity, score_documents
from pipelines.models import load_model

from .helpers import make_docs
from .own_models import ARCHITECTURES, save_model

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")
COMMANDS = ("generate", "tune", "eval", "datastore", "demo")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer Llama with a Llama-3-style tokenizer, as a user's model folder."""
    return save_model(ARCHITECTURES[0], tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def corpus_graph(tmp_path_factory, tiny_llama):
    """(corpus file, graph folder with 3-gram tables) in the tiny Llama's tokens."""
    root = tmp_path_factory.mktemp("devices")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(make_docs(200, seed=7)) + "\n")
    graph = write_graph(count_corpus(corpus, tiny_llama, progress=False), root / "g", progress=False)
    add_ngrams(graph, corpus, tiny_llama, (3,), progress=False)
    (root / "valid.txt").write_text("\n".join(make_docs(20, seed=8)) + "\n")  # text tune may read
    return corpus, root / "g"


def test_devices_resolve_to_what_is_asked_and_default_to_what_is_here(monkeypatch):
    assert resolve_device("cpu") == resolve_device("cpu:0") == torch.device("cpu")
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == resolve_dtype(torch.bfloat16, torch.device("cpu")) \
        == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")


@pytest.mark.parametrize(("device", "dtype", "says"), [
    ("cuda", None, "CUDA is not available here"), ("cuda:1", None, "CUDA is not available here"),
    ("mps", None, "runs on 'cpu' or 'cuda'"), ("gpu0", None, "not a device torch knows"),
    ("cpu:1", None, "the CPU is one device, with no index 1"), ("cpu:7", "float32", "no index 7"),
    ("cpu", "float16", "float16 on the CPU"), ("cpu", "int8", "not one graphmax runs a model in")])
def test_a_device_or_dtype_this_machine_cannot_give_is_refused_in_one_line(monkeypatch, device, dtype, says):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(GraphmaxError, match=says) as raised:
        resolve_dtype(dtype, resolve_device(device))
    assert "\n" not in str(raised.value) and "; use" in str(raised.value)


def _argv(command: str, corpus, graph, out) -> list[str]:
    """The shortest valid command line of each command that loads a model."""
    return {"generate": ["generate", "--path", str(graph), "--prompt", "the"],
            "tune": ["tune", "--path", str(graph), "--corpus", str(corpus.with_name("valid.txt"))],
            "eval": ["eval", "--corpus", str(corpus), "--out", str(out)],
            "datastore": ["datastore", "--corpus", str(corpus), "--out", str(out)],
            "demo": ["demo"]}[command]


def _patch_loader(monkeypatch, load_model) -> None:
    """``load_model`` wherever a command finds the model loader: pipelines.models, and the command modules that
    import it at their top."""
    import importlib

    monkeypatch.setattr("pipelines.models.load_model", load_model)
    for module in ("datastore_command", "demo", "eval.cli", "generate", "tune"):
        command = importlib.import_module(f"pipelines.{module}")
        if "load_model" in vars(command):
            monkeypatch.setattr(command, "load_model", load_model)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_says_in_one_line_that_cuda_is_absent_before_loading_anything(
        command, corpus_graph, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = []
    _patch_loader(monkeypatch, lambda *a, **k: loaded.append(a))
    out = tmp_path / "out"
    assert main([*_argv(command, *corpus_graph, out), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"graphmax {command}: error: --device 'cuda' but CUDA is not available" in err
    assert not loaded and not out.exists()  # nothing loaded, no report or datastore folder begun


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_refuses_a_cpu_index_in_one_line_before_loading_anything(
        command, corpus_graph, tmp_path, monkeypatch, capsys):
    loaded = []
    _patch_loader(monkeypatch, lambda *a, **k: loaded.append(a))
    out = tmp_path / "out"
    assert main([*_argv(command, *corpus_graph, out), "--device", "cpu:1"]) == 2
    assert capsys.readouterr().err == (f"graphmax {command}: error: --device 'cpu:1': the CPU is one device, with no "
                                       f"index 1 (torch uses every core on it); use --device cpu\n")
    assert not loaded and not out.exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_loads_the_model_on_the_device_and_in_the_dtype_asked(
        command, corpus_graph, tmp_path, monkeypatch, capsys):
    asked = []

    def load_model(spec="smollm2", *, device=None, dtype=None):
        asked.append((device, dtype))
        raise GraphmaxError("stopped where the model would load")

    _patch_loader(monkeypatch, load_model)
    assert main([*_argv(command, *corpus_graph, tmp_path / "out"), "--device", "cpu", "--dtype", "bfloat16"]) == 2
    assert "stopped where the model would load" in capsys.readouterr().err
    assert asked == [(torch.device("cpu"), torch.bfloat16)]


def test_load_model_puts_a_users_model_on_the_device_in_the_dtype(tiny_llama):
    model, tok = load_model(tiny_llama, device="cpu", dtype="bfloat16")
    assert model.device == torch.device("cpu") and model.dtype == torch.bfloat16 and not model.training
    assert tok.pad_token_id is not None


def test_generate_in_bfloat16_decodes_with_the_graphs_decoder(tiny_llama, corpus_graph, capsys):
    _, graph = corpus_graph
    assert main(["generate", "--path", str(graph), "--model", str(tiny_llama), "--prompt", "the movie",
                 "--max-new-tokens", "4", "--device", "cpu", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "model: " in out and "on cpu in bfloat16" in out and "context graphmax :" in out


def test_a_datastore_built_in_bfloat16_keeps_float32_keys_and_knows_its_model(tiny_llama, tmp_path):
    model, tok = load_model(tiny_llama, device="cpu", dtype="bfloat16")
    texts = make_docs(6, seed=3)
    store = build_datastore(model, tok, texts, tmp_path / "ds", positions=5, progress=False)
    expected = sum(min(len(tok(t, add_special_tokens=False)["input_ids"]), 6) - 1 for t in texts)
    assert len(store) == expected and np.isfinite(np.asarray(store.marginals)).all()
    assert abs(float(np.sum(store.marginals)) - expected) < 1e-6 * expected  # one softmax per kept position
    store.check_model(model)


@CUDA
def test_build_datastore_on_the_gpu_gives_the_cpus_keys(tiny_llama, tmp_path):
    texts = make_docs(12, seed=5)
    stores = {}
    for device in ("cpu", "cuda"):
        model, tok = load_model(tiny_llama, device=device, dtype="float32")
        stores[device] = build_datastore(model, tok, texts, tmp_path / device, positions=8, progress=False)
    cpu, gpu = stores["cpu"], stores["cuda"]
    assert torch.equal(cpu.values.cpu(), gpu.values.cpu())
    assert torch.allclose(cpu.keys.float().cpu(), gpu.keys.float().cpu(), atol=1e-2)
    assert np.allclose(cpu.marginals, gpu.marginals, rtol=1e-4)


@CUDA
def test_scoring_and_decoding_stay_on_the_gpu(tiny_llama, corpus_graph):
    from gm_graphs import load_graph

    _, folder = corpus_graph
    graph = load_graph(folder)
    texts = make_docs(6, seed=9)
    results = {}
    for device in ("cpu", "cuda"):
        model, tok = load_model(tiny_llama, device=device, dtype="float32")
        held = score_documents(model, tok, texts, positions=8, progress=False)
        assert all(x.device.type == device for x in held.logits + held.ids)
        context = ContextGraphmaxLogitsProcessor(graph).warmup(model.device)
        results[device] = perplexity(held), perplexity(held, context)
        for proc in (context, PaperGraphmaxLogitsProcessor(graph).warmup(model.device)):
            texts_out, _ = generate_texts(model, tok, ["the movie"], proc, max_new_tokens=3)
            assert len(texts_out) == 1 and proc.last_info.gap.device.type == device
    assert results["cuda"] == pytest.approx(results["cpu"], rel=1e-3)


def test_default_dtype_is_bfloat16_only_on_a_gpu_that_computes_in_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_dtype(None, torch.device("cuda", 0)) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype(None, torch.device("cuda", 0)) == torch.bfloat16
    assert set(devices.DTYPES) == {"float32", "bfloat16", "float16"}
