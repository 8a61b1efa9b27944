"""What a command pays for the LM before its first step: the bundled SmolLM2's tokenizer converted from the GGUF
file against loaded from graphmax's tokenizer cache, and the whole model. Prints a table; not a test.

    python3 benchmarks/startup.py [--repeat 3]

Each run is a fresh process (imports not counted): "converted" starts from an empty ``$GRAPHMAX_HOME`` (transformers
reads the GGUF file's metadata and builds the tokenizer), "cached" from one holding the cache entry the first run
wrote (``gm_graphs.tokenize.gguf``). The model row is ``pipelines.models.load_model`` with the tokenizer cached:
the weights are still read and dequantised from the GGUF file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _child(what: str) -> dict:
    from gm_graphs import load_tokenizer
    from pipelines.models import load_model

    t0 = time.perf_counter()
    tok = load_tokenizer("smollm2") if what == "tokenizer" else load_model()[1]
    return {"seconds": time.perf_counter() - t0, "vocab": len(tok)}


def _run(what: str, home: Path) -> dict:
    env = {**os.environ, "GRAPHMAX_HOME": str(home), "PYTHONPATH": str(REPO)}
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
    with tempfile.TemporaryDirectory(prefix="graphmax-startup-") as tmp:
        cached = Path(tmp) / "cached"
        _run("tokenizer", cached)  # writes the cache entry
        rows = {"tokenizer, converted from GGUF": [_run("tokenizer", Path(tmp) / f"empty{i}")["seconds"]
                                                   for i in range(args.repeat)],
                "tokenizer, from the cache": [_run("tokenizer", cached)["seconds"] for _ in range(args.repeat)],
                "model + tokenizer (cached)": [_run("model", cached)["seconds"] for _ in range(args.repeat)]}
    print(f"{'load (fresh process each)':<32} {'seconds per run':>28}")
    for label, times in rows.items():
        print(f"{label:<32} {'  '.join(f'{t:7.2f}' for t in times):>28}")
    converted, hit = (min(rows[k]) for k in ("tokenizer, converted from GGUF", "tokenizer, from the cache"))
    print(f"the cache: {converted / hit:.0f}x faster ({converted:.2f} s -> {hit:.2f} s, best runs)")


if __name__ == "__main__":
    main()
