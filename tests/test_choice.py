"""The stored decoder choice (gm_solver.choice): one record, every key checked once when read, and the one factory
(``GraphmaxLogitsProcessor.from_graph``) that builds the decoder it names, bit for bit the decoders' own outputs."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from transformers import LogitsProcessorList

from gm_graphs import count_corpus, load_graph, write_graph
from gm_graphs.errors import GraphFormatError
from gm_graphs.format.datastore_files import write_datastore
from gm_solver import (
    ContextConfig,
    ContextGraphmaxLogitsProcessor,
    ContextReference,
    DecoderChoice,
    GraphmaxLogitsProcessor,
    HiddenStateTap,
    KnnContextGraphmaxLogitsProcessor,
    MarginalBiasLogitsProcessor,
    PaperAlgorithm1LogitsProcessor,
    PaperGraphmaxLogitsProcessor,
    load_datastore,
    log_graphmax,
)
from gm_solver.datastore import Datastore
from gm_solver.decoders.choice import KnnChoice
from gm_solver.decoders.context import KnnConfig
from gm_solver.decoders.paper import PaperConfig

from .helpers import make_docs


def _batch(seed: int = 7, vocab: int = 30):
    """A seeded random bigram graph, a batch of contexts and of scores."""
    rng = np.random.default_rng(seed)
    counts = sp.csr_matrix(rng.poisson(0.6, size=(vocab, vocab)).astype(float))
    return rng, counts, torch.tensor(rng.integers(0, vocab, size=(3, 5))), torch.tensor(rng.normal(size=(3, vocab)))


def test_each_decoder_equals_the_solve_it_is_built_on_to_1e12():
    rng, counts, ids, z = _batch()
    # the default decoder: the reference's own step with the default settings
    expected, _ = ContextReference(counts, ContextConfig()).step(ids, z)
    for proc in (ContextGraphmaxLogitsProcessor(counts), GraphmaxLogitsProcessor.from_graph(counts)):
        torch.testing.assert_close(proc(ids, z), expected, rtol=0, atol=1e-12)
    # the paper's decoders: log_graphmax with the certified solver, and with Algorithm 1
    torch.testing.assert_close(PaperGraphmaxLogitsProcessor(counts, lam=1.5)(ids, z),
                               log_graphmax(z, counts, 1.5), rtol=0, atol=1e-12)
    torch.testing.assert_close(PaperAlgorithm1LogitsProcessor(counts, lam=1.5)(ids, z),
                               log_graphmax(z, counts, 1.5, solver="paper"), rtol=0, atol=1e-12)
    # the kNN decoder: the bias on the scores, then the step toward the mixture with the neighbours
    marginals = rng.uniform(0.5, 3, 30)
    store = Datastore(rng.normal(size=(40, 4)), rng.integers(0, 30, 40), vocab_size=30,
                      marginals=40 * marginals / marginals.sum(), precision="float32")
    tap = HiddenStateTap()
    tap.states = torch.tensor(rng.normal(size=(3, 4)))
    proc = KnnContextGraphmaxLogitsProcessor(counts, store, tap, knn_k=5, knn_temperature=3.0, marginal_weight=0.7,
                                             lam=2.0)
    biased = z + store.marginal_bias(0.7).double()
    tokens, weights = store.distribution(tap.last, 5, 3.0)
    want, _ = ContextReference(counts, ContextConfig(lam=2.0)).step(ids, biased, knn=(tokens, weights, 0.5))
    torch.testing.assert_close(proc(ids, z), want, rtol=0, atol=1e-12)
    # the bias alone, before the context decoder
    alone = LogitsProcessorList([MarginalBiasLogitsProcessor(store, 0.7), ContextGraphmaxLogitsProcessor(counts)])
    torch.testing.assert_close(alone(ids, z), ContextReference(counts, ContextConfig()).step(ids, biased)[0],
                               rtol=0, atol=1e-12)


def test_the_record_round_trips_and_keeps_the_keys_tune_wrote():
    knn = KnnChoice(KnnConfig(knn_weight=0.35, knn_k=2, knn_temperature=100.0, marginal_weight=0.75), 0.9,
                    "ab" * 32, 3, 40.5)
    choice = DecoderChoice(ContextConfig(divergence="l2", lam=0.7, source={"tuned": True}), knn=knn)
    stored = choice.to_json()
    assert set(stored) == {"mode", *ContextConfig().to_dict(), "knn"}
    assert set(stored["knn"]) == {"knn_weight", "knn_k", "knn_temperature", "marginal_weight", "lam",
                                  "datastore_sha256", "datastore_keys", "perplexity"}
    assert DecoderChoice.from_json(stored) == choice
    paper = DecoderChoice(PaperConfig(lam=0.3, solver="paper"))
    assert paper.to_json() == {"mode": "paper", "lam": 0.3, "tol": 1e-6, "max_iter": 200, "solver": "paper"}
    assert DecoderChoice.from_json(paper.to_json()) == paper
    # a record missing a field (an older graphmax's) is refused, never read with today's defaults
    with pytest.raises(GraphFormatError, match="no \\['marginal_weight'\\]; store it again"):
        DecoderChoice.from_json({**stored, "knn": {k: v for k, v in stored["knn"].items() if k != "marginal_weight"}})
    with pytest.raises(GraphFormatError, match="no \\['kl_share'\\]; store it again"):
        DecoderChoice.from_json({k: v for k, v in stored.items() if k != "kl_share"})


CONTEXT = {"mode": "context", **ContextConfig().to_dict()}
KNN = {"knn_weight": 0.5, "knn_k": 1, "knn_temperature": 1.0, "marginal_weight": 0.0, "lam": 1.0,
       "datastore_sha256": "ab" * 32}


@pytest.mark.parametrize("stored, error", [
    ([], "it must be an object"),
    ({"mode": "beam"}, "`mode` must be one of"),
    ({**CONTEXT, "lam": -1.0}, "`lam` must be a finite float >= 0"),
    ({**CONTEXT, "lam": "1"}, "`lam`.*got '1'"),
    ({**CONTEXT, "divergence": "js"}, "`divergence` must be one of"),
    ({**CONTEXT, "order_weights": "1"}, "`order_weights` must be a list"),
    ({**CONTEXT, "source": 3}, "`source` must be a dict"),
    ({**CONTEXT, "extra": 1}, "keys no decoder reads: \\['extra'\\]"),
    ({"mode": "paper", "solver": "auto"}, "`solver` must be one of \\('mirror', 'paper'\\)"),
    ({"mode": "paper", "solver": "paper", "max_iter": 5}, "`max_iter`=5 has no effect with the paper's Algorithm 1"),
    ({"mode": "paper", "knn": {}}, "keys no decoder reads"),
    ({**CONTEXT, "knn": {**KNN, "knn_weight": -0.1}}, "`knn_weight` must be a float in \\[0, 1\\]"),
    ({**CONTEXT, "knn": {k: v for k, v in KNN.items() if k != "datastore_sha256"}},
     "`knn` has no \\['datastore_sha256'\\]"),
    ({**CONTEXT, "knn": {**KNN, "datastore_sha256": "zz" * 32}}, "`datastore_sha256` must be 64 lowercase hex digits"),
    ({**CONTEXT, "knn": {**KNN, "marginal_weight": 11.0}}, "`marginal_weight` must be a float in \\[0, 10\\]"),
])
def test_every_stored_key_is_checked_in_one_line(stored, error):
    with pytest.raises(GraphFormatError, match="the graph's stored decoder: .*" + error) as err:
        DecoderChoice.from_json(stored)
    assert "\n" not in str(err.value)


def test_the_factory_returns_the_decoder_the_choice_names(bpe_tokenizer_file, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(make_docs(60, seed=3)) + "\n")
    path = tmp_path / "g"
    write_graph(count_corpus(corpus, bpe_tokenizer_file, progress=False), path, progress=False)
    graph = load_graph(path)
    graph.set_decoder(DecoderChoice(PaperConfig(lam=0.4, solver="paper")).to_json())
    proc = GraphmaxLogitsProcessor.from_graph(load_graph(path))
    assert type(proc) is PaperAlgorithm1LogitsProcessor and proc.lam == 0.4
    with pytest.raises(GraphFormatError, match="`tol`=0.001 has no effect with the paper's Algorithm 1"):
        GraphmaxLogitsProcessor.from_graph(load_graph(path), tol=1e-3)
    with pytest.raises(TypeError, match="`check_every` is not an argument of PaperAlgorithm1LogitsProcessor"):
        GraphmaxLogitsProcessor.from_graph(load_graph(path), check_every=2)
    with pytest.raises(ValueError, match="`datastore` and `tap` apply to the context decoder"):
        GraphmaxLogitsProcessor.from_graph(load_graph(path), tap=HiddenStateTap())
    # the kNN settings stored with one datastore, for that datastore only
    tokenizer = graph.manifest["tokenizer"]
    stores = {}
    for name, seed in (("ds", 0), ("other", 1)):
        write_datastore(tmp_path / name, [(np.random.default_rng(seed).normal(size=(3, 4)), np.array([1, 2, 3]))],
                        dim=4, tokenizer=tokenizer, model="m", model_sha256="cd" * 32, positions=2, documents=1)
        stores[name] = load_datastore(tmp_path / name)
    tuned = ContextConfig(lam=0.7, source={"tuned": True})
    graph.set_decoder(DecoderChoice.with_knn(tuned, {"knn_weight": 0.35, "knn_k": 2}, 0.9, stores["ds"]).to_json())
    plain = GraphmaxLogitsProcessor.from_graph(load_graph(path))
    assert type(plain) is ContextGraphmaxLogitsProcessor and plain.config.lam == 0.7
    knn = GraphmaxLogitsProcessor.from_graph(load_graph(path), datastore=stores["ds"])
    assert type(knn) is KnnContextGraphmaxLogitsProcessor and isinstance(knn.tap, HiddenStateTap)
    assert (knn.knn.knn_weight, knn.knn.knn_k, knn.config.lam, knn.config.source["knn"]) == (0.35, 2, 0.9, "stored")
    louder = GraphmaxLogitsProcessor.from_graph(load_graph(path), datastore=stores["ds"], lam=2.0, knn_k=1)
    assert (louder.config.lam, louder.knn.knn_k, louder.config.source["overridden"]) == (2.0, 1, ["lam"])
    other = GraphmaxLogitsProcessor.from_graph(load_graph(path), datastore=stores["other"])
    assert (other.knn, other.config.lam) == (KnnConfig(), 0.7)
    assert other.config.source["knn"] == "stored for another datastore"
    with pytest.raises(TypeError, match="`knn_k` is not an argument of ContextGraphmaxLogitsProcessor"):
        GraphmaxLogitsProcessor.from_graph(load_graph(path), knn_k=3)
    with pytest.raises(ValueError, match="`tap` applies with a `datastore` only"):
        GraphmaxLogitsProcessor.from_graph(load_graph(path), tap=HiddenStateTap())


# records as main 22feb71 wrote them (its DecoderChoice.to_json), before the table of decoder kinds
WRITTEN_BEFORE = [
    {"mode": "context", "divergence": "l2", "lam": 0.7, "kl_share": 0.2, "order_weights": [0.8, 0.2],
     "smoothing": "kneser-ney", "discount": 0.75, "ngram_order": 4, "kappa": 3.0, "alpha": 0.5, "lam_decay": 0.3,
     "source": {"tuned": True, "perplexity": 31.5},
     "knn": {"knn_weight": 0.35, "knn_k": 64, "knn_temperature": 100.0, "marginal_weight": 0.75, "lam": 0.9,
             "datastore_sha256": "ab" * 32, "datastore_keys": 1200, "perplexity": 30.1}},
    {"mode": "paper", "lam": 2.0, "tol": 1e-05, "max_iter": 50, "solver": "mirror"},
    {"mode": "paper", "lam": 0.5, "tol": 1e-06, "max_iter": 200, "solver": "paper"},
]


@pytest.mark.parametrize("stored", WRITTEN_BEFORE, ids=["context with knn", "paper", "algorithm 1"])
def test_choices_stored_before_the_table_of_kinds_load_and_are_written_back_the_same(stored):
    choice = DecoderChoice.from_json(stored)
    assert choice.to_json() == stored
    assert choice.kind.name == stored["mode"]
    if stored["mode"] == "paper":
        assert choice.settings == PaperConfig(lam=stored["lam"], tol=stored["tol"], max_iter=stored["max_iter"],
                                              solver=stored["solver"])
    else:
        assert choice.settings.order_weights == (0.8, 0.2) and choice.knn.config.knn_k == 64


def test_the_marginal_bias_alone_is_the_knn_decoder_at_weight_zero_bit_for_bit():
    rng, counts, ids, z = _batch(seed=11)
    marginals = rng.uniform(0.5, 3, 30)
    store = Datastore(rng.normal(size=(40, 4)), rng.integers(0, 30, 40), vocab_size=30,
                      marginals=40 * marginals / marginals.sum(), precision="float32")
    alone = GraphmaxLogitsProcessor.from_graph(counts, settings=ContextConfig(lam=1.5), datastore=store,
                                               knn_weight=0.0, marginal_weight=0.7)
    assert alone.tap is None  # no search: no hidden states are read
    listed = LogitsProcessorList([MarginalBiasLogitsProcessor(store, 0.7),
                                  ContextGraphmaxLogitsProcessor(counts, lam=1.5)])
    assert torch.equal(alone(ids, z), listed(ids, z))
