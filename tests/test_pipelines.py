"""The command-line jobs end to end with the real SmolLM2 model and real corpora."""

from __future__ import annotations

import pytest

from pipelines.cli import main


@pytest.mark.slow
def test_generate_cli_with_a_real_graph(home, drug_graph, capsys):
    assert main(["generate", "--path", str(drug_graph.path), "--prompt", "This medication", "--lam", "1",
                 "--max-new-tokens", "3", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "softmax" in out and "graphmax λ=1" in out and "time per token" in out


@pytest.mark.slow
def test_demo_builds_the_imdb_graph_then_reuses_it(home, capsys):
    assert main(["demo", "--max-new-tokens", "2"]) == 0
    first = capsys.readouterr().out
    assert "building graph 'imdb'" in first and "graphmax λ=1" in first and "context graphmax" in first
    assert (home / "graphs" / "imdb" / "manifest.json").is_file()
    assert main(["demo", "--max-new-tokens", "2"]) == 0
    assert "building graph" not in capsys.readouterr().out


def test_timed_processor_passes_scores_through_and_times_every_call():
    import torch

    from pipelines.generate import TimedLogitsProcessor

    timed = TimedLogitsProcessor(lambda ids, scores: scores * 2)
    scores = torch.randn(2, 5)
    for _ in range(3):
        out = timed(torch.zeros(2, 1, dtype=torch.long), scores)
    assert torch.equal(out, scores * 2) and len(timed.calls) == 3 and all(t >= 0 for t in timed.calls)
