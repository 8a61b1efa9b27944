"""The plug-in's two faces, driven by hand as vLLM's runners drive them, without an engine: the V1 interface (the
CPU runner's: update_state with added, moved and removed requests) and the V2 one (the GPU runner's, which no GPU
here runs: add_request per slot, apply with the step's layout and the runner's token buffers, faked here with
the fields vLLM 0.32 documents). Each graphmax row equals the transformers processor on that request alone."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessor as V1  # noqa: E402
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2  # noqa: E402

from gm_graphs import build_graph, load_graph, word_tokenizer  # noqa: E402
from gm_solver import GraphmaxLogitsProcessor as Factory  # noqa: E402
from gm_solver.serving import vllm as plugin  # noqa: E402

WORDS = "the movie was good bad great plot actor scene film story fun i loved hated it this and but".split()


@pytest.fixture
def home(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    text = tmp_path / "docs.txt"
    text.write_text("\n".join(" ".join(rng.choice(WORDS, size=12)) for _ in range(300)) + "\n")
    monkeypatch.setenv("GRAPHMAX_HOME", str(tmp_path / "gm"))
    monkeypatch.setenv("GRAPHMAX_SERVE_GRAPHS", "g")
    build_graph(text, word_tokenizer(WORDS), name="g", ngrams=(3, 4), progress=False)
    plugin._SHARED.clear()
    yield
    plugin._SHARED.clear()


def _alone(tokens: list[int], scores: torch.Tensor, **settings) -> torch.Tensor:
    return Factory.from_graph(load_graph("g"), **settings)(torch.tensor([tokens]), scores[None])[0]


def test_the_class_is_both_interfaces():
    assert issubclass(plugin.GraphmaxLogitsProcessor, V1) and issubclass(plugin.GraphmaxLogitsProcessor, V2)


def test_v1_follows_the_persistent_batch(home):
    proc = plugin.GraphmaxLogitsProcessor(None, torch.device("cpu"), False)
    n = load_graph("g").counts.shape[0]
    a_out, b_out = [], []
    graphmax = SamplingParams(extra_args={"graphmax": {"graph": "g", "lam": 2.0}})
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                  added=[(0, SamplingParams(), [1, 2], a_out), (1, graphmax, [3, 4, 5], b_out)]))
    logits = torch.randn(2, n + 3)
    before = logits.clone()
    out = proc.apply(logits)
    assert torch.equal(out[0], before[0]) and torch.equal(out[1], _alone([3, 4, 5], before[1], lam=2.0))
    b_out.append(7)  # the engine appends to the live list; then swaps the two rows
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    logits = torch.randn(2, n + 3)
    before = logits.clone()
    out = proc.apply(logits)
    assert torch.equal(out[1], before[1]) and torch.equal(out[0], _alone([3, 4, 5, 7], before[0], lam=2.0))
    proc.update_state(BatchUpdate(batch_size=1, removed=[0], added=[], moved=[]))
    logits = torch.randn(1, n + 3)
    assert torch.equal(proc.apply(logits.clone()), logits)


def test_validate_params_refuses_in_one_line(home):
    with pytest.raises(ValueError, match="graph 'other' is not served here"):
        plugin.GraphmaxLogitsProcessor.validate_params(SamplingParams(extra_args={"graphmax": "other"}))
    plugin.GraphmaxLogitsProcessor.validate_params(SamplingParams(extra_args={"graphmax": "g"}))
    plugin.GraphmaxLogitsProcessor.validate_params(SamplingParams())


def test_v2_reads_each_slots_tokens_from_the_runners_buffers(home):
    n = load_graph("g").counts.shape[0]
    slots, width = 4, 32
    tokens = torch.zeros(slots, width, dtype=torch.int64)
    histories = {2: [1, 5, 6, 2, 9], 0: [4], 3: [8, 8, 1]}
    for slot, h in histories.items():
        tokens[slot, :len(h)] = torch.tensor(h)
    req_states = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=slots, vocab_size=n,
                                 all_token_ids=SimpleNamespace(gpu=tokens))
    proc = plugin.GraphmaxLogitsProcessor(None, req_states)
    assert proc.add_request(2, SamplingParams(extra_args={"graphmax": {"graph": "g", "lam": 1.5}}))
    assert proc.add_request(0, SamplingParams(extra_args={"graphmax": "g", "graphmax_lam_decay": 0.5}))
    assert not proc.add_request(3, SamplingParams())
    # this step's batch: positions 0, 1, 2 hold slots 3, 2, 0; the token fed this step is the history's last, which
    # the buffer may not hold yet (the step's input_ids do)
    order = [3, 2, 0]
    tokens[2, len(histories[2]) - 1] = 0
    ctx = SimpleNamespace(idx_mapping_np=np.array(order), seq_lens_upper_bound_np=np.array([len(histories[s])
                                                                                              for s in order]),
                          input_ids=torch.tensor([histories[s][-1] for s in order]))
    logits = torch.randn(3, n)
    before = logits.clone()
    out = proc.apply(logits, ctx)
    assert torch.equal(out[0], before[0])
    assert torch.equal(out[1], _alone(histories[2], before[1], lam=1.5))
    assert torch.equal(out[2], _alone(histories[0], before[2], lam_decay=0.5))
