"""Each decoder's output on one fixed batch on the CPU, saved, so that two checkouts can be compared bit for bit
(a refactor that must leave the CPU's numbers as they were). Not a test: the other checkout is yours to give.

    python3 benchmarks/decoder_bits.py --root OLD_CHECKOUT --out old.pt
    python3 benchmarks/decoder_bits.py --root . --out new.pt
    python3 benchmarks/decoder_bits.py --compare old.pt new.pt

The batch: the context decoder in three configurations (its default, L2 with a KL share and a second order, KL),
each by the numba kernel and by the torch backend, and its reference rows; the paper decoder; the context, paper and
Algorithm 1 decoders as ``from_graph`` builds them; graphmax by the torch backend; ``solve_toward`` for each
divergence in float64 and float32, on seeded random graphs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def outputs(root: Path) -> dict:
    sys.path.insert(0, str(root.resolve()))
    import numpy as np
    import scipy.sparse as sp
    import torch

    from gm_graphs.count.ngram_counts import NgramCounts
    from gm_solver import (
        ContextConfig,
        ContextReference,
        GraphmaxLogitsProcessor,
        PaperGraphmaxLogitsProcessor,
        graphmax,
        solve_toward,
    )

    rng = np.random.default_rng(3)
    n = 60
    graph = type("Graph", (), {})()  # bigram counts and 3- and 4-gram tables, as a Graph holds them
    graph.counts = sp.csr_matrix(rng.integers(0, 6, size=(n, n)) * (rng.random((n, n)) < 0.3))
    keys = {order: np.unique(rng.integers(0, n ** order, size=200)) for order in (3, 4)}
    graph.ngrams = {order: NgramCounts.from_keys(order, k, rng.integers(1, 5, size=k.size), n)
                    for order, k in keys.items()}
    out = {}
    ids = torch.randint(0, 60, (4, 7), generator=torch.Generator().manual_seed(0))
    scores = 3 * torch.randn(4, 63, generator=torch.Generator().manual_seed(1))
    configs = [ContextConfig(), ContextConfig(divergence="l2", lam=0.7, kl_share=0.3, order_weights=(1.0, 0.4)),
               ContextConfig(divergence="kl")]
    for i, cfg in enumerate(configs):
        ref = ContextReference(graph, cfg)
        out[f"context {i}, numba"] = ref.step(ids, scores)[0]
        out[f"context {i}, torch"] = ref.step(ids, scores, backend="torch")[0]
        out[f"context {i}, reference rows"] = ref(ids, width=63)
    m = sp.random(n, n, density=0.1, random_state=np.random.default_rng(2), format="csr")
    m = sp.csr_matrix(m.multiply(1.0 / np.maximum(m.sum(1), 1e-12)))
    out["paper"] = PaperGraphmaxLogitsProcessor(m, lam=1.0)(ids, scores.clone())
    # through the factory (gm_solver.decoders' table since 2026-11-29; the same calls before it)
    out["from_graph context"] = GraphmaxLogitsProcessor.from_graph(graph.counts, lam=2.0, kl_share=0.3)(ids, scores)
    out["from_graph paper"] = GraphmaxLogitsProcessor.from_graph(m, decoder="paper", lam=1.5)(ids, scores.clone())
    out["from_graph algorithm 1"] = GraphmaxLogitsProcessor.from_graph(m, decoder="paper", solver="paper",
                                                                       lam=1.5)(ids, scores.clone())
    out["graphmax, torch"] = graphmax(scores[:, :60].double(), m, 2.0, backend="torch")
    z = scores.double()
    q = torch.rand(4, 63, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for d in ("rkl", "l2", "kl"):
        out[f"solve_toward {d}"] = solve_toward(z, q, 1.3, d, kl_share=0.1)[0]
        out[f"solve_toward {d}, float32"] = solve_toward(z.float(), q.float(), 1.3, d, kl_share=0.1)[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("."), help="the checkout whose decoders run (default: .)")
    ap.add_argument("--out", type=Path, help="where to save the outputs (torch.save)")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="two saved outputs to compare")
    args = ap.parse_args()
    import torch

    if args.compare:
        a, b = (torch.load(p) for p in args.compare)
        print("| output | bit for bit |\n|---|---|")
        for key in a:
            print(f"| {key} | {'yes' if key in b and torch.equal(a[key], b[key]) else 'NO'} |")
        return
    if args.out is None:
        ap.error("give --out FILE or --compare A B")
    torch.save(outputs(args.root), args.out)


if __name__ == "__main__":
    main()
