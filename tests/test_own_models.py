"""The user's own causal LM, end to end: `graphmax build --tokenizer DIR` → `tune` → `generate --model DIR` →
`datastore --model DIR` (and `eval --model DIR` on one of them) with random-weight Llama, Qwen2 (a head padded past
its tokenizer), Mistral, Gemma 2 (final-logit soft-capping) and GPT-2 (a tied head) folders made offline
(tests/own_models.py), each with a tokenizer of its family."""

from __future__ import annotations

import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from gm_graphs import load_graph, load_tokenizer
from gm_graphs.errors import TokenizerError
from gm_graphs.tokenize.encoder import TokenizerIdentity
from gm_solver import (
    ContextGraphmaxLogitsProcessor,
    GraphmaxLogitsProcessor,
    PaperAlgorithm1LogitsProcessor,
    PaperGraphmaxLogitsProcessor,
)
from pipelines.cli import main

from .helpers import write_jsonl
from .own_models import ARCHITECTURES, LLAMA3_SPLIT, save_model, sentences

ARCH = {a.name: a for a in ARCHITECTURES}
DOCS = sentences(40, seed=1)  # the training corpus: documents with newlines, digits, accents, CJK and emoji inside
VALID = sentences(6, seed=2)
STORE_DOCS, STORE_POSITIONS = 5, 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(root / "train.jsonl", DOCS)
    write_jsonl(root / "valid.jsonl", VALID)
    return root / "train.jsonl", root / "valid.jsonl"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each architecture's model folder, by name."""
    root = tmp_path_factory.mktemp("models")
    return {a.name: save_model(a, root / a.name) for a in ARCHITECTURES}


@pytest.fixture(scope="module", params=[a.name for a in ARCHITECTURES])
def built(request, folders, corpus, tmp_path_factory):
    """(name, model folder, graph folder): the graph built by the CLI with the model folder's tokenizer."""
    graph = tmp_path_factory.mktemp("graphs") / request.param
    assert main(["build", str(corpus[0]), "--tokenizer", str(folders[request.param]), "--path", str(graph),
                 "--ngrams", "3"]) == 0
    return request.param, folders[request.param], graph


@pytest.fixture(scope="module")
def qwen2_graph(folders, corpus, tmp_path_factory):
    """A graph of the Qwen2 folder's tokenizer (400 tokens; the head scores 413)."""
    graph = tmp_path_factory.mktemp("graphs") / "qwen2"
    assert main(["build", str(corpus[0]), "--tokenizer", str(folders["qwen2"]), "--path", str(graph)]) == 0
    return graph


def test_the_folders_are_what_users_bring(folders):
    """Each folder has the head and tokenizer family it stands for, as transformers loads them."""
    import json

    from transformers import AutoModelForCausalLM

    pre = {}
    for arch in ARCHITECTURES:
        model = AutoModelForCausalLM.from_pretrained(folders[arch.name], local_files_only=True)
        tok = load_tokenizer(folders[arch.name])
        head = model.get_output_embeddings().weight
        assert head.shape[0] == model.config.vocab_size == len(tok) + arch.padding and head.shape[1] == 32
        tied = head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        assert tied == (arch.name in ("gpt2", "gemma2"))
        pre[arch.name] = json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"]
        if arch.name == "gemma2":
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([[1, 5, 9, 300]])).logits
            assert model.config.final_logit_softcapping == 0.5 and float(logits.abs().max()) < 0.5
    assert pre["gpt2"]["type"] == "ByteLevel" and pre["gpt2"]["use_regex"]
    assert pre["llama"]["pretokenizers"][0]["pattern"]["Regex"] == LLAMA3_SPLIT
    assert r"\p{N}|" in pre["qwen2"]["pretokenizers"][0]["pattern"]["Regex"]  # Qwen2Tokenizer's, digit by digit
    assert pre["mistral"]["type"] == pre["gemma2"]["type"] == "Metaspace"
    assert "<0xE2>" in load_tokenizer(folders["mistral"]).get_vocab()  # byte fallback


def grams(tok, n: int) -> Counter:
    """The corpus' within-document n-grams of the tokenizer's own ids."""
    out: Counter = Counter()
    for doc in DOCS:
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        out.update(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
    return out


def test_the_graph_counts_the_tokenizers_own_ids_and_records_how_it_splits(built):
    name, folder, path = built
    tok = load_tokenizer(folder)
    graph = load_graph(path, tokenizer=tok)
    assert graph.manifest["tokenizer"] == TokenizerIdentity.of(tok).to_dict()
    assert len(graph.manifest["tokenizer"]["split_sha256"]) == 64 and graph.vocab_size == len(tok)
    counts = graph.counts.tocoo()
    assert dict(zip(zip(counts.row.tolist(), counts.col.tolist()), counts.data.tolist())) == grams(tok, 2)
    table, n = graph.ngrams[3], graph.vocab_size
    keys = [((a * n + b) * n + c) for a, b, c in sorted(grams(tok, 3))]
    assert table.keys().tolist() == keys
    assert table.count_values().tolist() == [grams(tok, 3)[g] for g in sorted(grams(tok, 3))]


def test_tune_generate_and_a_datastore_run_on_the_users_model(built, corpus, tmp_path, capsys):
    name, folder, path = built
    assert main(["tune", "--path", str(path), "--corpus", str(corpus[1]), "--model", str(folder), "--docs", "2",
                 "--positions", "6"]) == 0
    stored = load_graph(path).decoder
    assert stored["mode"] == "context" and stored["source"]["tuned"]
    capsys.readouterr()
    assert main(["generate", "--model", str(folder), "--path", str(path), "--prompt", "The patient",
                 "--max-new-tokens", "6", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "settings: stored by graphmax tune" in out and "prompt: The patient\n" in out
    assert out.split("prompt: The patient\n")[1].count(" : ") == 2  # softmax's line and the decoder's
    store = tmp_path / "ds"
    assert main(["datastore", "--corpus", str(corpus[0]), "--out", str(store), "--model", str(folder), "--docs",
                 str(STORE_DOCS), "--positions", str(STORE_POSITIONS)]) == 0
    tok = load_tokenizer(folder)
    keys = sum(min(STORE_POSITIONS, len(tok(d, add_special_tokens=False)["input_ids"]) - 1)
               for d in DOCS[:STORE_DOCS])
    assert f"datastore: {keys:,} keys of width 32 from {STORE_DOCS} documents" in capsys.readouterr().out
    from gm_solver import load_datastore

    assert load_datastore(store).meta["tokenizer"] == load_graph(path).manifest["tokenizer"]


def test_generate_with_the_stored_decoder_emits_only_the_tokenizers_ids_and_decodes(built):
    from pipelines.models import load_model

    name, folder, path = built
    model, tok = load_model(folder, device="cpu", dtype="float32")  # the Python API beside --model DIR
    graph = load_graph(path)
    width = model.get_output_embeddings().weight.shape[0]
    graph.check_output_width(width)
    assert width == len(tok) + ARCH[name].padding
    proc = GraphmaxLogitsProcessor.from_graph(graph, tokenizer=tok)
    tok.padding_side = "left"
    prompt = tok(["The patient", "I"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(**prompt, logits_processor=[proc], do_sample=True, top_k=0, max_new_tokens=12,
                         pad_token_id=tok.pad_token_id)
    new = out[:, prompt["input_ids"].shape[1]:]
    assert int(new.max()) < len(tok)  # sampled from every column: a padded one has probability 0
    texts = tok.batch_decode(new, skip_special_tokens=True)
    assert all(isinstance(t, str) for t in texts) and any(t.strip() for t in texts)


@pytest.mark.parametrize("decoder", [ContextGraphmaxLogitsProcessor, PaperGraphmaxLogitsProcessor,
                                     PaperAlgorithm1LogitsProcessor])
@pytest.mark.parametrize("lam", [0.0, 1.5])
def test_a_head_padded_past_the_tokenizer_gives_its_extra_columns_probability_zero(folders, qwen2_graph, decoder,
                                                                                  lam):
    from transformers import AutoModelForCausalLM

    folder = folders["qwen2"]
    graph, tok = load_graph(qwen2_graph), load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    ids = tok(["The patient took", "She said 1999"], return_tensors="pt", padding=True)["input_ids"]
    with torch.no_grad():
        scores = model(input_ids=ids).logits[:, -1] * 40  # spread as a trained model's are
    n = graph.vocab_size
    assert scores.shape[-1] == n + ARCH["qwen2"].padding
    kept = scores.clone()
    logp = decoder(graph, lam=lam, tokenizer=tok)(ids, scores)
    assert torch.equal(scores, kept)  # the caller's scores stay as they were
    assert logp.shape == scores.shape and bool(torch.isneginf(logp[:, n:]).all())
    assert torch.allclose(logp[:, :n].exp().sum(-1), torch.ones(2, dtype=logp.dtype), atol=1e-5)
    if lam == 0:  # the softmax over the tokenizer's ids
        assert torch.allclose(logp[:, :n], torch.log_softmax(scores[:, :n], -1), atol=1e-5)


def test_a_head_narrower_than_the_graph_is_refused_in_one_line(folders, corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    # a SentencePiece vocabulary (with its 256 byte tokens) is wider than the byte-level ones' heads
    assert main(["build", str(corpus[0]), "--tokenizer", str(folders["mistral"]), "--path", str(tmp_path / "g")]) == 0
    graph = load_graph(tmp_path / "g")
    model = AutoModelForCausalLM.from_pretrained(folders["llama"], local_files_only=True)
    width = model.get_output_embeddings().weight.shape[0]
    assert width < graph.vocab_size
    with pytest.raises(TokenizerError) as e:
        graph.check_output_width(width)
    message = str(e.value)
    assert "\n" not in message and f"has {graph.vocab_size} tokens but the model scores {width}" in message


def test_the_same_folder_without_its_config_splits_differently_and_is_refused(folders, qwen2_graph, tmp_path):
    # the Qwen2 folder's config.json makes transformers build a Qwen2Tokenizer (whatever tokenizer_config.json
    # names), which splits digits one by one; its tokenizer.json alone cuts runs of three (Llama 3's expression)
    folder, path = folders["qwen2"], qwen2_graph
    alone = tmp_path / "tokenizer-alone"
    alone.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / f, alone / f)
    with_config, without = load_tokenizer(folder), load_tokenizer(alone)
    assert with_config.get_vocab() == without.get_vocab()
    assert with_config("1999")["input_ids"] != without("1999")["input_ids"]
    load_graph(path, tokenizer=with_config)
    with pytest.raises(TokenizerError, match="splits text differently") as e:
        load_graph(path, tokenizer=without)
    assert "\n" not in str(e.value)


def test_eval_runs_on_a_padded_head(folders, corpus, tmp_path, monkeypatch):
    """eval on one architecture: a run costs seconds more than the other commands together, and Qwen2's padded
    head and tokenizer class are what they cover least."""
    import csv

    from pipelines.eval import experiment, roster

    folder = folders["qwen2"]
    monkeypatch.setattr(experiment, "SHORT_WINDOW", 2)
    monkeypatch.setattr(roster, "PAPER_POSITIONS", 2)
    out = tmp_path / "report"
    assert main(["eval", "--corpus", str(corpus[0]), "--model", str(folder), "--out", str(out),
                 "--heldout-fraction", "0.3", "--lams", "0,1", "--mixture-lams", "1", "--ppl-docs", "2",
                 "--positions", "4", "--tune-docs", "2", "--prompts", "2", "--new-tokens", "3", "--references", "40",
                 "--finetune-budget-s", "0", "--datastore-docs", "0", "--shots", "0"]) == 0
    with open(out / "perplexity.csv") as fh:
        rows = {r["key"]: r for r in csv.DictReader(fh)}
    assert float(rows["softmax"]["ratio_4"]) == 1.0 and np.isfinite(float(rows["ours"]["perplexity_4"]))
