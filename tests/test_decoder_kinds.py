"""A decoder kind defined in this module alone and registered once (``gm_solver.decoders``) runs through every place
that names a decoder: ``graphmax generate --decoder`` and its options, the choice a graph stores, ``from_graph``,
decoding, and an eval row; no other file knows it. Also: the table's own rules, and kinds from entry points."""

from __future__ import annotations

import dataclasses
import math
from importlib import metadata

import numpy as np
import pytest
import torch

from gm_graphs import load_graph
from gm_graphs.errors import GraphFormatError
from gm_solver import ContextConfig, DecoderChoice, DecoderKind, GraphmaxLogitsProcessor, register_decoder
from gm_solver.arguments import option, real
from gm_solver.decoders import kinds, registry, unregister_decoder
from pipelines.cli import main


@dataclasses.dataclass(frozen=True)
class UnigramBias:
    """The toy's one setting: how far the scores lean toward the corpus' unigram."""

    weight: float = option(1.0, "w ≥ 0 of the unigram's log-probability added to the scores")

    def __post_init__(self):
        object.__setattr__(self, "weight", real("weight", self.weight, "a finite float >= 0",
                                                lambda v: 0 <= v < math.inf))


class UnigramBiasLogitsProcessor(GraphmaxLogitsProcessor):
    """log softmax(z + w·log p), p the corpus' unigram (how often each token follows another, add-½)."""

    def __init__(self, graph, settings: UnigramBias):
        counts = graph.counts if hasattr(graph, "counts") else graph
        unigram = np.asarray(counts.sum(axis=0), dtype=np.float64).ravel() + 0.5
        self.log_unigram = torch.from_numpy(np.log(unigram / unigram.sum()))
        self.config = settings

    @classmethod
    def from_choice(cls, graph, choice, *, overridden=()):
        return cls(graph, choice.settings)

    def __call__(self, input_ids, scores):
        n = self.log_unigram.shape[0]
        z = scores.clone()
        z[..., :n] += self.config.weight * self.log_unigram.to(scores)
        z[..., n:] = -math.inf
        return torch.log_softmax(z, dim=-1)

    def _shape(self):
        return self.log_unigram.shape[0], torch.device("cpu")

    def _compiled_parts(self, device):
        return []

    def _settings(self):
        return {"weight": self.config.weight}


KIND = DecoderKind("unigram-bias", UnigramBias, f"{__name__}:UnigramBiasLogitsProcessor", "unigram-bias toy")


@pytest.fixture()
def toy():
    register_decoder(KIND)
    yield KIND
    unregister_decoder(KIND.name)


def _decoder_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("decoder: "))


def test_generate_takes_the_kind_and_its_options_from_the_table(toy, graph_path, tiny_model, capsys):
    argv = ["generate", "--path", str(graph_path), "--model", str(tiny_model), "--prompt", "the movie",
            "--max-new-tokens", "3"]
    assert main([*argv, "--decoder", "unigram-bias", "--weight", "2"]) == 0
    out = capsys.readouterr().out
    assert _decoder_line(out) == "decoder: UnigramBiasLogitsProcessor(weight=2.0)"
    assert "  settings: defaults, with --weight 2" in out and "unigram-bias toy : " in out
    # its option is checked by its settings while parsing, and refused with another kind
    with pytest.raises(SystemExit):
        main([*argv, "--decoder", "unigram-bias", "--weight", "-1"])
    assert "argument --weight: must be a finite float >= 0, got -1.0" in capsys.readouterr().err
    assert main([*argv, "--weight", "2"]) == 2
    assert "--weight applies to --decoder unigram-bias (this graph's default decoder is context)" in \
        capsys.readouterr().err


def test_the_stored_choice_names_the_kind_and_generate_decodes_with_it(toy, graph_path, tiny_model, capsys):
    from pipelines.decoding import generate_texts
    from pipelines.models import load_model

    stored = DecoderChoice(UnigramBias(weight=0.5)).to_json()
    assert stored == {"mode": "unigram-bias", "weight": 0.5}
    load_graph(graph_path).set_decoder(stored)
    proc = GraphmaxLogitsProcessor.from_graph(load_graph(graph_path))
    assert type(proc) is UnigramBiasLogitsProcessor and proc.config == UnigramBias(0.5) and proc.origin == "stored"
    assert GraphmaxLogitsProcessor.from_graph(load_graph(graph_path), weight=3.0).config.weight == 3.0
    with pytest.raises(ValueError, match="`lam` applies to the context or paper decoder"):
        GraphmaxLogitsProcessor.from_graph(load_graph(graph_path), lam=1.0)
    assert main(["generate", "--path", str(graph_path), "--model", str(tiny_model), "--prompt", "the movie",
                 "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert _decoder_line(out) == "decoder: UnigramBiasLogitsProcessor(weight=0.5)"
    assert "  settings: stored by graphmax tune" in out
    model, tok = load_model(str(tiny_model))
    texts, _ = generate_texts(model, tok, ["the movie"], proc, max_new_tokens=4)
    assert f"unigram-bias toy : {texts[0].strip()}" in out
    plain, _ = generate_texts(model, tok, ["the movie"], None, max_new_tokens=4)
    strong, _ = generate_texts(model, tok, ["the movie"], UnigramBiasLogitsProcessor(load_graph(graph_path),
                                                                                     UnigramBias(50.0)),
                               max_new_tokens=4)
    assert strong != plain  # the toy does move the LM's choices


def test_a_graph_storing_a_kind_not_registered_is_refused_in_one_line(graph_path, capsys):
    load_graph(graph_path).set_decoder({"mode": "unigram-bias", "weight": 0.5})
    with pytest.raises(GraphFormatError, match="`mode` must be one of \\('context', 'paper'\\), got 'unigram-bias'"):
        GraphmaxLogitsProcessor.from_graph(load_graph(graph_path))
    assert main(["generate", "--path", str(graph_path), "--prompt", "the movie"]) == 2
    err = capsys.readouterr().err
    assert "stores a decoder of a kind not registered here: no decoder kind is named 'unigram-bias'" in err
    assert err.count("\n") == 1


def test_an_eval_row_scores_the_registered_kind(toy, built, tiny_model):
    from pipelines.eval.data import Setup
    from pipelines.eval.roster import LM, Family, roster
    from pipelines.eval.scoring import perplexity_rows, score_decoders
    from pipelines.heldout import score_documents
    from pipelines.models import load_model

    from .helpers import make_docs

    setup = Setup(graph=load_graph(built), mixture=load_graph(built, mixture=2), test=make_docs(6, seed=9),
                  validation=[], split_docs={})
    decoders = roster(setup, ContextConfig(), [], [], positions=4)
    row = next(d for d in decoders if d.variant.kind == "unigram-bias")
    assert (row.family, row.lm, row.key, row.label) == (Family.REGISTERED, LM.BASE, "unigram-bias",
                                                         "unigram-bias toy (unigram-bias)")
    model, tok = load_model(str(tiny_model))
    held = score_documents(model, tok, setup.test, 4, progress=False)
    softmax = decoders[0]
    nll, ms = score_decoders([softmax, row], {LM.BASE: held}, [4])
    rows = perplexity_rows([softmax, row], nll, ms, [4])
    toy_row = rows[row.id]
    assert toy_row["key"] == "unigram-bias" and math.isfinite(toy_row["perplexity_4"])
    assert toy_row["perplexity_4"] != rows[softmax.id]["perplexity_4"]


def test_the_table_refuses_a_second_kind_of_a_name_and_keeps_graphmaxs_own():
    with pytest.raises(ValueError, match="a decoder kind named 'context' is registered already"):
        register_decoder(dataclasses.replace(KIND, name="context"))
    with pytest.raises(ValueError, match="'paper' is one of graphmax's own decoder kinds"):
        unregister_decoder("paper")
    with pytest.raises(ValueError, match="`name` must be lowercase letters"):
        DecoderKind("Toy Kind", UnigramBias, "m:C", "toy")
    with pytest.raises(ValueError, match="`step` of decoder 'toy' must be 'module:Class'"):
        DecoderKind("toy", UnigramBias, "not a path", "toy")
    assert list(kinds())[:2] == ["context", "paper"]


def test_kinds_from_entry_points_are_registered_and_a_broken_one_is_skipped(monkeypatch, capsys):
    good = metadata.EntryPoint("toy", f"{__name__}:KIND", registry.ENTRY_POINTS)
    broken = metadata.EntryPoint("broken", "no_such_module_anywhere:KIND", registry.ENTRY_POINTS)
    wrong = metadata.EntryPoint("wrong", f"{__name__}:UnigramBias", registry.ENTRY_POINTS)
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [broken, good, wrong])
    monkeypatch.setitem(registry._loaded, "entry points", False)
    try:
        assert "unigram-bias" in kinds()
        err = capsys.readouterr().err
        assert "skipped the decoder kind of entry point 'broken'" in err and "ModuleNotFoundError" in err
        assert "skipped the decoder kind of entry point 'wrong'" in err and "must be a DecoderKind" in err
    finally:
        unregister_decoder("unigram-bias")


def test_the_paper_kinds_order_limit_is_the_graphs():
    from gm_graphs.build.options import MAX_ORDER
    from gm_solver.decoders.paper import MAX_ORDER as PAPER_MAX_ORDER

    assert PAPER_MAX_ORDER == MAX_ORDER
