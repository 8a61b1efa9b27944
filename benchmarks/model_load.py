"""What loading the bundled SmolLM2 costs: its tokenizer converted from the GGUF file against read from graphmax's
tokenizer cache (``gm_graphs.tokenize.gguf``); the model read from its GGUF file by transformers, converted once into
graphmax's model cache, and loaded from that cache. Prints two tables; not a test.

    python3 benchmarks/model_load.py [--repeat 3]

Each run is a fresh process. The tokenizer rows time ``load_tokenizer("smollm2")`` from an empty ``$GRAPHMAX_HOME``
("converted") and from one holding the entry the first run wrote ("cached"). For the model rows the process first
builds a one-layer Llama from a config, which pays for the modules transformers imports on a process's first model
load (torch.distributed, the kernels hub, the loaders: several seconds, the same for every row, shown in the last
column); then it times ``pipelines.models.load_model`` (the tokenizer comes from graphmax's tokenizer cache in every
row). "GGUF, read by transformers" is ``AutoModelForCausalLM.from_pretrained(gguf_file=…)`` as ``load_model`` called
it before the model cache; "first conversion" starts from a ``$GRAPHMAX_HOME`` holding the tokenizer cache but no
model entry, and includes writing and syncing the entry (540 MB of float32) and loading the model from it; "cached"
from one holding the entry (:mod:`pipelines.model_cache`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _child(what: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from gm_graphs import bundled
    from pipelines.models import load_model

    t0 = time.perf_counter()
    if what == "tokenizer":
        from gm_graphs import load_tokenizer

        load_tokenizer("smollm2")
        return {"seconds": time.perf_counter() - t0, "imports": 0.0}
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                 num_attention_heads=1))
    imports = time.perf_counter() - t0
    t0 = time.perf_counter()
    if what == "gguf":
        path = bundled.smollm2_gguf()
        AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        load_model("smollm2", device="cpu", dtype="float32")
    return {"seconds": time.perf_counter() - t0, "imports": imports}


def _run(what: str, home: Path) -> dict:
    env = {**os.environ, "GRAPHMAX_HOME": str(home), "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", what], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="runs per row (default 3; the table shows each)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="graphmax-model-load-") as tmp:
        tokenizer = {"converted from the GGUF file": [_run("tokenizer", Path(tmp) / f"empty{i}")["seconds"]
                                                      for i in range(args.repeat)]}
        _run("tokenizer", Path(tmp) / "cached")  # writes the cache entry
        tokenizer["from the tokenizer cache"] = [_run("tokenizer", Path(tmp) / "cached")["seconds"]
                                                 for _ in range(args.repeat)]
        home = Path(tmp) / "home"
        from gm_graphs import load_tokenizer

        os.environ["GRAPHMAX_HOME"] = str(home)
        load_tokenizer("smollm2")  # the tokenizer cache, in every row
        rows: dict[str, list[dict]] = {"GGUF, read by transformers": [], "first conversion": [], "cached": []}
        for _ in range(args.repeat):
            rows["GGUF, read by transformers"].append(_run("gguf", home))
        for _ in range(args.repeat):
            shutil.rmtree(home / "models", ignore_errors=True)
            rows["first conversion"].append(_run("model", home))
        for _ in range(args.repeat):
            rows["cached"].append(_run("model", home))
    print(f"{'SmolLM2 tokenizer (fresh process each)':<48} {'load_tokenizer, s per run':>28}")
    for label, times in tokenizer.items():
        print(f"{label:<48} {'  '.join(f'{t:7.2f}' for t in times):>28}")
    print(f"{'SmolLM2-135M, float32, CPU (fresh process each)':<48} {'load_model, s per run':>28} {'imports, s':>12}")
    for label, runs in rows.items():
        loads = "  ".join(f"{r['seconds']:7.2f}" for r in runs)
        print(f"{label:<48} {loads:>28} {min(r['imports'] for r in runs):12.2f}")
    gguf, hit = (min(r["seconds"] for r in rows[k]) for k in ("GGUF, read by transformers", "cached"))
    print(f"the model cache: {gguf / hit:.0f}x faster than the GGUF file ({gguf:.2f} s -> {hit:.2f} s, best runs)")


if __name__ == "__main__":
    main()
