"""A model folder checked against its weights before the model is built (issue 57, item 4): a config.json that
claims more layers than the weights hold, another architecture's model_type, a missing or reshaped weight, or 10⁹
layers is refused in one line naming the fix, where transformers filled the gaps with random weights (or grew
without end); every architecture a user brings still loads."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from gm_graphs import GraphmaxError
from pipelines.model_check import check_model_folder
from pipelines.models import load_model

from .own_models import ARCHITECTURES, save_model

ARCH = {a.name: a for a in ARCHITECTURES}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {a.name: save_model(a, root / a.name) for a in ARCHITECTURES}


def _copy(folders, name: str, tmp_path, **config) -> object:
    folder = shutil.copytree(folders[name], tmp_path / name)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def _refused(folder) -> str:
    with pytest.raises(GraphmaxError) as refused:
        load_model(folder, device="cpu", dtype="float32")
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"the model folder {folder}: "), message
    return message


@pytest.mark.parametrize("name", [a.name for a in ARCHITECTURES])
def test_a_good_folder_of_each_architecture_still_loads(folders, name):
    check_model_folder(folders[name])
    model, tok = load_model(folders[name], device="cpu", dtype="float32")
    assert model.config.model_type == json.loads((folders[name] / "config.json").read_text())["model_type"]
    assert len(tok) > 0


@pytest.mark.parametrize("name, key", [("llama", "num_hidden_layers"), ("gpt2", "n_layer")])
def test_a_config_with_more_layers_than_the_weights_is_refused(folders, tmp_path, name, key):
    # transformers built 4 layers, filled 2 of them with random weights, and graphmax decoded with them (exit 0)
    message = _refused(_copy(folders, name, tmp_path, **{key: 4}))
    assert "config.json names 4 layers but model.safetensors holds weights for 2" in message
    assert "put the config.json saved with these weights beside them" in message and "to 2" in message


def test_another_architectures_model_type_over_the_weights_is_refused(folders, tmp_path):
    # model_type bert over Llama weights: a BERT with every weight random
    message = _refused(_copy(folders, "llama", tmp_path, model_type="bert"))
    assert "config.json's model_type 'bert'" in message and "the config is another architecture's" in message
    assert "'model.layers.0." in message or "'model.embed_tokens" in message or "'lm_head" in message


def test_a_config_claiming_a_billion_layers_is_refused_at_once(folders, tmp_path):
    # transformers built the layers one by one: 3.4 GB after 150 s, and growing
    folder = _copy(folders, "qwen2", tmp_path, num_hidden_layers=10**9)
    start = time.monotonic()
    message = _refused(folder)
    assert time.monotonic() - start < 10
    assert "config.json claims 1,000,000,000 layers (num_hidden_layers)" in message


def test_a_weight_missing_from_the_file_or_of_another_shape_is_refused(folders, tmp_path):
    folder = _copy(folders, "mistral", tmp_path)
    weights = load_file(folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    message = _refused(folder)
    assert "model.safetensors lacks 1 weight(s)" in message and "'model.norm.weight'" in message
    shutil.rmtree(folder)
    folder = _copy(folders, "llama", tmp_path, intermediate_size=128)
    assert "is (64, 32) in model.safetensors, but config.json makes it (128, 32)" in _refused(folder)


def test_a_tied_head_need_not_be_in_the_file(folders):
    weights = load_file(folders["gpt2"] / "model.safetensors")
    assert "lm_head.weight" not in weights  # GPT-2's head is its input embeddings
    check_model_folder(folders["gpt2"])


def test_load_model_refuses_a_folder_without_a_tokenizer_as_the_cli_does(folders, tmp_path):
    folder = shutil.copytree(folders["llama"], tmp_path / "llama")
    for path in folder.glob("tokenizer*"):
        path.unlink()
    with pytest.raises(GraphmaxError, match=r"^the model folder .* has no tokenizer .*tokenizer.save_pretrained"):
        load_model(folder, device="cpu", dtype=torch.float32)
