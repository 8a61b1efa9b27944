"""The vLLM plug-in: graphmax per request, inside vLLM's own batching.

Start vLLM with the class, then opt in per request::

    vllm serve MODEL --logits-processors gm_solver.serving.vllm:GraphmaxLogitsProcessor
    # or: LLM(MODEL, logits_processors=["gm_solver.serving.vllm:GraphmaxLogitsProcessor"])
    SamplingParams(extra_args={"graphmax": {"graph": "amazon", "lam": 2.0}})
    # over the OpenAI-compatible server: {"vllm_xargs": {"graphmax": {"graph": "amazon", "lam": 2.0}}}

The arguments are those of :func:`gm_solver.serving.requests.parse`; a bad one fails that request alone, in one line
(an HTTP 400 from the server), before it reaches the engine. The graphs served are an allow-list of names
(``$GRAPHMAX_SERVE_GRAPHS``, else every graph under ``$GRAPHMAX_HOME/graphs``), each loaded and warmed up when the
engine starts. Rows that do not ask for graphmax are left as they were, bit for bit.

One class implements both of vLLM's interfaces for custom logits processors: the V1 one
(``vllm.v1.sample.logits_processor.LogitsProcessor``: ``update_state`` then ``apply(logits)``; vLLM's CPU model
runner) and the V2 one (``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``: ``add_request`` and
``apply(logits, ctx)``; the GPU model runner's default). No ``vllm.logits_processors`` entry point is registered:
vLLM loads those into every engine, and the V2 runner refuses a class it finds there unless it is a V2 one, so an
installed graphmax must never touch a vLLM that does not name it. The kNN decoder is refused: a logits processor
sees logits, not the model's hidden states.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from ..processor import ContextGraphmaxLogitsProcessor
from .requests import Graphs, Row, Rows, parse

__all__ = ["GraphmaxLogitsProcessor"]

_SHARED: dict[str, Graphs] = {}  # the served graphs of this process, made once (the engine's and the frontend's)


def _graphs() -> Graphs:
    if "graphs" not in _SHARED:
        _SHARED["graphs"] = Graphs()
    return _SHARED["graphs"]


class GraphmaxLogitsProcessor(V1LogitsProcessor, V2LogitsProcessor):
    """graphmax for the requests that ask for it (``extra_args={"graphmax": {...}}``), in vLLM's V1 and V2 model
    runners alike (vLLM constructs it; see the module's documentation).

    Args (as vLLM passes them):
        vllm_config (``VllmConfig``): the engine's configuration.
        *runner: V1: ``(device, is_pin_memory)``; V2: ``(req_states,)``, the runner's per-slot token buffers.

    Example (vLLM's CPU build, with a graph ``amazon`` under ``$GRAPHMAX_HOME/graphs``)::

        from vllm import LLM, SamplingParams
        llm = LLM("folder-of-the-model", logits_processors=[GraphmaxLogitsProcessor])
        params = SamplingParams(max_tokens=32, temperature=0.0, extra_args={"graphmax": {"graph": "amazon"}})
        print(llm.generate(["This blender"], params)[0].outputs[0].text)
    """

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Refuse a request's bad graphmax arguments in one line (``ValueError``: vLLM fails that request alone)."""
        request = parse(getattr(sampling_params, "extra_args", None))
        if request is not None:
            _graphs().decoder(request)  # a graph not served, or settings its decoder refuses

    def __init__(self, vllm_config: Any, *runner: Any):
        if len(runner) == 1:  # V2: (req_states,)
            self.req_states = runner[0]
            device = torch.device(self.req_states.device)
        else:  # V1: (device, is_pin_memory)
            self.req_states = None
            device = torch.device(runner[0])
        self.rows = Rows(_graphs())
        self.rows.graphs.warm(device)  # every served graph loaded and its kernels ready before the first request
        self._requests: dict[int, Any] = {}  # V2: each slot's request

    def is_argmax_invariant(self) -> bool:
        """graphmax moves the argmax: greedy decoding must call it."""
        return False

    # ---- V1: the persistent batch's changes, then the whole batch's logits --------------------------------------

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.remove(index)
        for index, params, prompt, output in batch_update.added:
            self.rows.add(index, parse(getattr(params, "extra_args", None)), prompt, output)
        for source, target, direction in batch_update.moved:
            self.rows.move(source, target, swap=direction == MoveDirectionality.SWAP)

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if ctx is None:  # V1
            return self.rows.apply(logits) if self.rows.rows else logits
        return self._apply_v2(logits, ctx)

    # ---- V2: per-slot requests, and each step's layout -----------------------------------------------------------

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        request = parse(getattr(sampling_params, "extra_args", None))
        if request is None:
            self._requests.pop(req_idx, None)
            return False
        self._requests[req_idx] = (request, self.rows.graphs.decoder(request))
        return True

    def _apply_v2(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        # rows are requests here (a speculative draft's extra rows are refused by vLLM for custom processors); each
        # row's committed tokens are in the slot's buffer, and the token fed this step is ``ctx.input_ids``
        slots = [int(s) for s in ctx.idx_mapping_np]
        if len(slots) != logits.shape[0]:
            return logits
        rows = self.rows  # V2 keeps no batch between steps: this step's rows, in the one Rows (its warnings once)
        rows.rows.clear()
        tokens = self.req_states.all_token_ids.gpu
        for row, slot in enumerate(slots):
            held = self._requests.get(slot)
            if held is None:
                continue
            request, proc = held
            length = int(ctx.seq_lens_upper_bound_np[row])  # exact without speculative decoding
            tail = proc.reference.tail if isinstance(proc, ContextGraphmaxLogitsProcessor) else 0
            start = max(length - tail, 0)
            own = tokens[slot, start:length - 1].tolist() + [int(ctx.input_ids[row])] if tail else []
            rows.rows[row] = Row(proc, request.lam, (), own, length)
        if not rows.rows:
            return logits
        return rows.apply(logits)
