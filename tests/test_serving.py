"""gm_solver.serving.requests, the engine-neutral half of the serving plug-ins: a request's arguments checked in one
line, graphs served by name from an allow-list only, and an engine's batch (requests joining, leaving and moving
between steps) decoded row by row as each request decodes alone with the transformers processor. The vLLM half runs
in vLLM's own environment (tests/vllm/)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gm_graphs import build_graph, word_tokenizer
from gm_solver import ContextGraphmaxLogitsProcessor, GraphmaxLogitsProcessor
from gm_solver.serving.requests import GRAPHS_VARIABLE, Graphs, Request, Rows, parse, served_names

from .helpers import make_docs

WORDS = ("the movie was good bad great awful plot actor acting scene film story boring fun "
         "i loved hated it this that and but so very").split()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    root = tmp_path_factory.mktemp("home")
    corpus = root / "reviews.txt"
    corpus.write_text("\n".join(make_docs(300)) + "\n")
    tok = word_tokenizer(WORDS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPHMAX_HOME", str(root / "gm"))
        for name, ngrams in (("reviews", (3, 4)), ("plain", ())):
            build_graph(corpus, tok, name=name, ngrams=ngrams, progress=False)
    return root / "gm"


@pytest.fixture
def graphs(home, monkeypatch):
    monkeypatch.setenv("GRAPHMAX_HOME", str(home))
    monkeypatch.delenv(GRAPHS_VARIABLE, raising=False)
    return Graphs()


# ---- a request's arguments -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (3, "must be an object"),
    ({}, '"graph" must name a graph'),
    ({"graph": "../../etc/passwd"}, "must be the name of a graph"),
    ({"graph": "/etc"}, "must be the name of a graph"),
    ({"graph": ".hidden"}, "must be the name of a graph"),
    ({"graph": "reviews", "decoder": "knn"}, "hidden states"),
    ({"graph": "reviews", "decoder": "beam"}, '"decoder" must be one of context, paper'),
    ({"graph": "reviews", "datastore": "/tmp/ds"}, "'datastore' is not an argument of graphmax"),
    ({"graph": "reviews", "decoder": "paper", "kl_share": 0.1}, "'kl_share' is not an argument of the paper"),
    ({"graph": "reviews", "lam": -1}, '"lam" must be a finite number >= 0'),
    ({"graph": "reviews", "lam": "2"}, '"lam" must be a finite number >= 0'),
    ({"graph": "reviews", "lam": True}, '"lam" must be a finite number >= 0'),
    ({"graph": "reviews", "lam": float("nan")}, '"lam" must be a finite number >= 0'),
])
def test_a_bad_request_is_one_line(args, message):
    with pytest.raises(ValueError, match=message) as e:
        parse({"graphmax": args})
    assert "\n" not in str(e.value) and str(e.value).startswith("graphmax: ")


def test_the_flat_form_is_the_object_form():
    assert parse({"graphmax": "reviews", "graphmax_lam": 2, "graphmax_order_weights": [1.0, 0.5], "other": 1}) == \
        parse({"graphmax": {"graph": "reviews", "lam": 2.0, "order_weights": (1.0, 0.5)}, "other": 1})
    for extra, message in [({"graphmax": "reviews", "graphmax_beam": 2}, "'beam' is not an argument"),
                           ({"graphmax_lam": 2}, "'graphmax_lam' given without 'graphmax'"),
                           ({"graphmax": {"graph": "reviews"}, "graphmax_lam": 2}, "not both")]:
        with pytest.raises(ValueError, match=message):
            parse(extra)


def test_a_request_without_the_argument_asks_for_nothing():
    assert parse(None) is None and parse({}) is None and parse({"other": {"graph": "x"}}) is None


def test_settings_are_checked_against_the_graph_and_the_decoder(graphs):
    for args, message in [({"graph": "plain", "ngram_order": 3}, "ngram_order"),
                          ({"graph": "reviews", "divergence": "hellinger"}, "divergence"),
                          ({"graph": "reviews", "kl_share": 2.0}, "kl_share"),
                          ({"graph": "reviews", "decoder": "paper", "tol": 0}, "tol"),
                          ({"graph": "absent"}, "graph 'absent' is not served here")]:
        with pytest.raises(ValueError, match=message) as e:
            graphs.decoder(parse({"graphmax": args}))
        assert "\n" not in str(e.value)


def test_only_the_allowed_graphs_are_served_and_each_is_loaded_once(home, monkeypatch):
    monkeypatch.setenv("GRAPHMAX_HOME", str(home))
    assert served_names() == ("plain", "reviews")
    monkeypatch.setenv(GRAPHS_VARIABLE, "reviews")
    graphs = Graphs()
    assert graphs.names == ("reviews",)
    with pytest.raises(ValueError, match="'plain' is not served here; this server serves reviews"):
        graphs.decoder(Request("plain"))
    one = graphs.decoder(Request("reviews", settings=(("kl_share", 0.2),), lam=1.0))
    assert graphs.decoder(Request("reviews", settings=(("kl_share", 0.2),), lam=3.0)) is one  # λ is per row
    assert graphs.graph("reviews") is graphs.graph("reviews")
    assert graphs.decoder(Request("reviews", decoder="paper", lam=1.0)) is not \
        graphs.decoder(Request("reviews", decoder="paper", lam=2.0))
    monkeypatch.setenv(GRAPHS_VARIABLE, "reviews,../x")
    with pytest.raises(ValueError, match=f"{GRAPHS_VARIABLE} names '../x'"):
        Graphs()


def test_warming_up_loads_every_served_graph(graphs):
    assert graphs.warm() >= 0 and set(graphs._graphs) == {"plain", "reviews"}


# ---- an engine's batch ---------------------------------------------------------------------------------------------

REQUESTS = [None, {"graph": "reviews"}, {"graph": "reviews", "lam": 2.5}, {"graph": "plain", "lam": 0.7},
            {"graph": "reviews", "lam_decay": 0.4, "order_weights": [1.0, 0.3]},
            {"graph": "reviews", "decoder": "paper", "lam": 1.0}]


def _alone(graphs, args, tokens, scores):
    """What transformers' processor gives this request's row alone."""
    request = parse({"graphmax": args})
    graph = graphs.graph(request.graph)
    overrides = dict(request.settings) | ({} if request.lam is None else {"lam": request.lam})
    proc = GraphmaxLogitsProcessor.from_graph(graph, decoder=request.decoder, **overrides)
    return proc(torch.tensor([tokens]), scores[None])[0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # read-only
@given(seed=st.integers(0, 2**16), events=st.lists(st.tuples(st.sampled_from(["add", "remove", "move", "swap"]),
                                                             st.integers(0, 5), st.integers(0, 5),
                                                             st.integers(0, len(REQUESTS) - 1)),
                                                   min_size=4, max_size=14))
def test_an_engines_batch_decodes_each_request_as_alone(graphs, seed, events):
    rng = np.random.default_rng(seed)
    rows = Rows(graphs)
    batch: dict[int, tuple] = {}  # index -> (arguments, prompt, output): what the engine holds
    n = graphs.graph("reviews").counts.shape[0]
    for op, a, b, which in events:
        if op == "add":
            prompt = rng.integers(0, n, size=int(rng.integers(1, 6))).tolist()
            args = REQUESTS[which]
            batch[a] = (args, prompt, [])
            rows.add(a, None if args is None else parse({"graphmax": args}), prompt, batch[a][2])
        elif op == "remove":
            batch.pop(a, None)
            rows.remove(a)
        elif a != b:
            moving, there = batch.pop(a, None), batch.pop(b, None)
            if moving is not None:
                batch[b] = moving
            if op == "swap" and there is not None:
                batch[a] = there
            rows.move(a, b, swap=op == "swap")
        # a decoding step over the batch as it now is (indices 0 … 5; rows with no request are garbage)
        logits = torch.as_tensor(rng.normal(0, 3, size=(6, n + 2)), dtype=torch.float32)
        before = logits.clone()
        out = rows.apply(logits)
        for index in range(6):
            held = batch.get(index)
            if held is None or held[0] is None:
                assert torch.equal(out[index], before[index])  # untouched, bit for bit
            else:
                args, prompt, output = held
                assert torch.equal(out[index], _alone(graphs, args, prompt + output, before[index])), (index, args)
                output.append(int(out[index].argmax()))  # the engine appends the sampled token to the live list


def test_a_failing_step_leaves_its_rows_as_they_were_and_is_logged_once(graphs, caplog):
    rows = Rows(graphs)
    rows.add(0, parse({"graphmax": {"graph": "reviews"}}), [1, 2], [])
    rows.add(1, parse({"graphmax": {"graph": "plain"}}), [3], [])
    n = graphs.graph("reviews").counts.shape[0]
    logits = torch.zeros(2, n)
    logits[0, 3] = torch.nan  # the model's scores, broken: that step is refused, the other still decodes
    with caplog.at_level(logging.WARNING, logger="graphmax.serving"):
        for _ in range(3):
            out = rows.apply(logits.clone())
    assert torch.isnan(out[0, 3]) and torch.equal(out[0, :3], torch.zeros(3))
    assert round(float(out[1].exp().sum()), 5) == 1.0
    assert len([r for r in caplog.records if "failed and left them as plain decoding" in r.message]) == 1


def test_the_context_decoder_of_a_request_is_the_factorys(graphs):
    proc = graphs.decoder(parse({"graphmax": {"graph": "reviews", "kl_share": 0.3}}))
    assert isinstance(proc, ContextGraphmaxLogitsProcessor) and proc.config.kl_share == 0.3
