"""``graphmax datastore``: the LM's hidden states over a domain corpus, as a kNN datastore for ``generate
--datastore`` (``gm_solver.KnnContextGraphmaxLogitsProcessor``).

Each document gives its first ``--positions`` positions: the LM head's input there, and the token that followed;
the model's softmax summed over the same positions is recorded beside them (its marginals, for the marginal bias).
The folder is written atomically and only where graphmax may write (``gm_graphs.format.datastore_files``).
"""

from __future__ import annotations

from pathlib import Path

from .args import CLEAN_HELP, CorpusFiles, integer
from .devices import add_device_arguments, resolve_device, resolve_dtype
from .models import DEFAULT_MODEL, load_model


def register(sub) -> None:
    p = sub.add_parser("datastore", help="a kNN datastore of the LM's hidden states over a corpus, for generate "
                                         "--datastore")
    p.add_argument("--corpus", nargs="+", required=True, action=CorpusFiles,
                   help="the domain's training files (the graph's text; never held-out text)")
    p.add_argument("--out", type=Path, required=True, help="the datastore folder to write")
    p.add_argument("--text-column", default="text")
    p.add_argument("--clean", action="store_true", help=f"{CLEAN_HELP}, as the build did")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model that will decode (its hidden states are keys)")
    add_device_arguments(p)
    p.add_argument("--docs", type=integer(1), default=10_000,
                   help="documents read, from the first (default 10,000; ~700 positions/s on 2 CPU cores)")
    p.add_argument("--positions", type=integer(1), default=64, help="keys per document, its first (default 64)")
    p.add_argument("--ivf-lists", type=integer(0), default=0,
                   help="an inverted-file index of N lists (faiss): each search reads --knn-nprobe lists instead of "
                        "every key; worth it beyond ~100k keys, ~4·√keys lists; its k-means grows as lists × "
                        "keys, so fewer on a small machine (benchmarks/RESULTS.md) (default 0: none)")
    p.add_argument("--overwrite", action="store_true", help="replace a datastore graphmax wrote at --out")
    p.set_defaults(run=run, loads_model=True)


def run(args) -> int:
    # torch and transformers come with these: imported once the arguments have passed their checks
    from gm_graphs.format.datastore_files import check_datastore_target
    from gm_solver import build_datastore

    from .tune import read_texts

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    check_datastore_target(args.out, args.overwrite)  # before the model loads and the corpus is read
    model, tok = load_model(args.model, device=device, dtype=dtype)
    texts = read_texts(args.corpus, args.text_column, args.clean, args.docs)
    store = build_datastore(model, tok, texts, args.out, positions=args.positions, overwrite=args.overwrite,
                            model_name=str(args.model), ivf_lists=args.ivf_lists)
    index = f", an index of {store.meta['ivf_lists']:,} lists" if store.approximate else ""
    print(f"datastore: {len(store):,} keys of width {store.dim} from {store.meta['documents']:,} documents{index}, "
          f"written to {args.out} (model on {device}, {str(dtype).removeprefix('torch.')})")
    return 0
