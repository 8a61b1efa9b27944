"""Plain helpers shared by the test files (pytest fixtures live in conftest.py): the repository's root, tiny
corpora, seeded random graphs and count matrices, the small ``COUNTS`` matrix, the dtype × device grid the
functions that promise any device and dtype are checked on, and the datastore and operator builders.

A test file imports from here or from conftest.py, never from another test file."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import strategies as st

from gm_graphs.count.ngram_counts import NgramCounts
from gm_graphs.format.datastore_files import META as DATASTORE_META
from gm_graphs.format.datastore_files import write_datastore
from gm_solver.datastore import index_datastore

REPO = Path(__file__).resolve().parents[1]


def forked(run, env: dict[str, str] | None = None, stderr: Path | None = None) -> int:
    """Run ``run()`` in a forked child with ``env`` set: its exit code (0 when ``run`` returns, 1 for a GraphmaxError,
    3 for anything else, or the code of a fault point's kill). A fork inherits the imported modules and compiled
    kernels, so a kill test pays for them once, not once per fault point; the child never returns into the caller."""
    return os.waitstatus_to_exitcode(os.waitpid(fork_child(run, env, stderr), 0)[1])


def fork_child(run, env: dict[str, str] | None = None, stderr: Path | None = None) -> int:
    """:func:`forked`'s child, not waited for: its pid, for a test that signals it while it runs. ``run`` may end
    the child with an exit code of its own (``os._exit``)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            fd = os.open(stderr or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            sys.stderr = open(2, "w", closefd=False)  # under pytest, sys.stderr is its capture, not fd 2
            os.environ.update(env or {})
            run()
            code = 0
        except BaseException as e:  # reported on the child's stderr, as the CLI would
            from gm_graphs import GraphmaxError

            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            code = 1 if isinstance(e, GraphmaxError) else 3
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


def processes_with_env(name: str, value: str) -> list[str]:
    """The running processes (not zombies) whose environment holds ``name=value``, as "pid command" lines: what a
    subprocess started with that variable left behind, its children's children included, wherever they were
    reparented."""
    mark = f"{name}={value}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:  # gone, or another user's
            continue
        if mark in environ:
            found.append(f"{pid} {command}")
    return found


def graph_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_same_graph(local, distributed) -> None:
    """Every array and table byte for byte; the manifests equal but for the name and the build section."""
    a, b = graph_files(local.path), graph_files(distributed.path)
    a.pop("manifest.json"), b.pop("manifest.json")
    assert sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    ma, mb = (json.loads((g.path / "manifest.json").read_text()) for g in (local, distributed))
    assert (ma.pop("build"), mb.pop("build")) == ({"engine": "local"}, {"engine": "ray"})
    ma.pop("name"), mb.pop("name")
    assert ma == mb

# ---- the dtype × device grid --------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64]
DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
GRID = list(itertools.product(DTYPES, DEVICES))

# ---- tiny corpora -------------------------------------------------------------------------------------------------

WORDS = ("the movie was good bad great awful plot actor acting scene film story boring fun "
         "I loved hated it this that and but so very not really").split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))) for _ in range(n)]


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> None:
    path.write_text("".join(json.dumps({key: d}) + "\n" for d in docs))


# documents of token ids, 0..11, for the counters
docs_strategy = st.lists(st.lists(st.integers(0, 11), min_size=0, max_size=12), min_size=1, max_size=12)


def encode_docs(docs):
    """Token ids of ``docs`` concatenated, and each document's offset, as a tokenizer's batch gives them."""
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return np.array([t for d in docs for t in d], dtype=np.int32), offsets


# ---- graphs and counts --------------------------------------------------------------------------------------------

# 5 tokens of bigram counts (token 4 is never followed): the context reference's and the processors' small graph
COUNTS = sp.csr_matrix(np.array([[0, 5, 1, 0, 0],
                                 [2, 0, 0, 3, 0],
                                 [0, 0, 0, 0, 4],
                                 [1, 1, 1, 1, 0],
                                 [0, 0, 0, 0, 0]], dtype=float))


def random_graph(n: int, density: float, seed: int) -> sp.csr_matrix:
    """A seeded random Ã: counts 1..20 at ``density``, each row divided by its sum (rows without edges stay empty)."""
    a = sp.random(n, n, density=density, format="csr", random_state=seed, dtype=np.float64)
    a.data = np.ceil(a.data * 20)  # counts
    d = np.asarray(a.sum(axis=1)).ravel()
    return sp.diags(np.where(d > 0, 1.0 / (d + 1e-8), 0.0)) @ a


def random_ngram_graph(seed: int, n: int = 40):
    """(bigram counts, 3- and 4-gram tables) drawn at random, a row with no successor among them."""
    rng = np.random.default_rng(seed)
    dense = rng.integers(0, 6, size=(n, n)) * (rng.random((n, n)) < 0.3)
    dense[3] = 0
    tables = {}
    for order in (3, 4):
        keys = np.unique(rng.integers(0, n ** order, size=200))
        tables[order] = NgramCounts.from_keys(order, keys, rng.integers(1, 5, size=keys.size), n)
    graph = type("Graph", (), {})()
    graph.counts, graph.ngrams = sp.csr_matrix(dense), tables
    return graph


def as_format_1(folder: Path) -> None:
    """Rewrite a graph's n-gram tables as format 1 stored them (flat contexts, indptr, next, counts), as a graph
    built before format 2 has them."""
    from gm_graphs.format.graph_files import sha256_file

    m = json.loads((folder / "manifest.json").read_text())
    from gm_graphs import load_graph

    tables = load_graph(folder).ngrams
    out = folder / "ngrams-00000000000f"
    orders = {}
    for order, t in tables.items():
        contexts, indptr, nxt, counts = t.dense()
        arrays = {"contexts": contexts, "indptr": indptr.astype(np.int32), "next": nxt.astype(np.int32),
                  "counts": counts.astype(np.int32)}
        files = {}
        for part, a in arrays.items():
            (out / str(order)).mkdir(parents=True, exist_ok=True)
            np.save(out / str(order) / f"{part}.npy", a)
            p = out / str(order) / f"{part}.npy"
            files[part] = {"file": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size,
                           "sha256": sha256_file(p)}
        orders[str(order)] = {"contexts": int(contexts.size), "entries": int(nxt.size), "files": files}
    shutil.rmtree(folder / m["ngrams"]["levels"]["2"]["files"]["next"]["file"].split("/")[0])
    m["ngrams"] = {"corpus": m["ngrams"]["corpus"], "clean": m["ngrams"]["clean"],
                   "text_column": m["ngrams"]["text_column"], "orders": orders}
    m["format_version"] = 1
    (folder / "manifest.json").write_text(json.dumps(m))


def finishes_within(seconds: float, run, fifos: list[Path] = ()):
    """``run()``'s result, failing the test (not hanging it) if it takes over ``seconds``: a reader or writer blocked
    on one of ``fifos`` is then let go (again and again, as a regression may open it more than once) so that the
    thread ends and releases what it holds (numba's compiler lock)."""
    result: dict = {}

    def target():
        try:
            result["value"] = run()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for _ in range(600):
            for fifo, flags in ((f, fl) for f in fifos for fl in (os.O_WRONLY, os.O_RDONLY)):
                try:
                    os.close(os.open(fifo, flags | os.O_NONBLOCK))  # the blocked open returns (then reads EOF)
                except OSError:
                    pass
            thread.join(0.05)
            if not thread.is_alive():
                break
        pytest.fail(f"still blocked after {seconds} s (on a FIFO)")
    if "error" in result:
        raise result["error"]
    return result.get("value")


def tokenizer_gguf(path: Path, extra: list[str] = ()):
    """A ``gguf.GGUFWriter`` for ``path`` holding a byte-level BPE tokenizer of the printable ASCII characters,
    ChatML's special tokens and "the" (plus ``extra`` tokens); the model's keys and tensors are the caller's."""
    from gguf import GGUFWriter

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *(chr(c) for c in range(33, 127)), "Ġ", "Ġt", "he",
              "Ġthe", *extra]
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    return w, tokens


def write_tiny_gguf(path: Path, extra: list[str] = ()) -> Path:
    """A GGUF file holding :func:`tokenizer_gguf`'s tokenizer and a one-tensor model around it: what the GGUF
    tokenizer loader reads."""
    w, tokens = tokenizer_gguf(path, extra)
    for key, value in (("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("head_count", 2)):
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_counts(n: int, seed: int) -> sp.csr_matrix:
    """A seeded random n×n matrix of bigram counts 1..8 at density 0.2."""
    rng = np.random.default_rng(seed)
    return sp.random(n, n, density=0.2, random_state=seed, data_rvs=lambda m: rng.integers(1, 9, m)).tocsr()


def dense_l(a: sp.csr_matrix, width: int) -> np.ndarray:
    """L = I − Ã as a dense ``width``×``width`` matrix; ids beyond the graph are isolated nodes."""
    m = np.zeros((width, width))
    m[: a.shape[0], : a.shape[0]] = a.toarray()
    return np.eye(width) - m


# ---- Ã² pruned ----------------------------------------------------------------------------------------------------

# A bounded row that skipped columns reports its total as Σ_k Ã_ik·Σ_j Ã_kj instead of scipy's sum of the row in
# column order: the same sum of the same products, rounded differently, so the mass kept agrees to float64 rounding.
FRAC_RTOL = 1e-12


def assert_same_blocks(fast: list, slow: list, *, exact_frac: bool = False) -> None:
    assert len(fast) == len(slow)
    for (r0, block, kept), (s0, blocks) in zip(fast, slow):
        expected, expected_kept = blocks["order2"]
        assert r0 == s0
        assert np.array_equal(block.indptr, expected.indptr) and np.array_equal(block.indices, expected.indices)
        assert block.data.tobytes() == expected.data.tobytes()
        if exact_frac:
            assert kept.tobytes() == expected_kept.tobytes()
        else:
            np.testing.assert_allclose(kept, expected_kept, rtol=FRAC_RTOL, atol=0)


# ---- the kNN datastore --------------------------------------------------------------------------------------------

def tokenizer_record(vocab: int) -> dict:
    """The tokenizer a datastore's meta.json names, for a vocabulary of ``vocab`` tokens."""
    return {"name": "t", "vocab_size": vocab, "vocab_sha256": "ab" * 32}


def write_store(path: Path, keys: np.ndarray, values: np.ndarray, vocab: int = 50, **kw) -> Path:
    """A datastore folder of ``keys`` and ``values`` written in one chunk."""
    return write_datastore(path, [(keys, values)], dim=keys.shape[1], tokenizer=tokenizer_record(vocab), model="m",
                           model_sha256="cd" * 32, positions=8, documents=1, **kw)


def random_keys(rng: np.random.Generator, n: int = 40, dim: int = 6, vocab: int = 50):
    """``n`` random float32 keys of ``dim`` and their tokens below ``vocab``."""
    return rng.normal(size=(n, dim)).astype(np.float32), rng.integers(0, vocab, n)


def random_marginals(vocab: int, n: int, seed: int = 0) -> np.ndarray:
    """Expected counts of ``n`` positions over ``vocab`` tokens, as a model's softmax sums would be."""
    p = np.random.default_rng(seed).dirichlet(np.ones(vocab), size=n)
    return p.sum(0)


def rewrite_meta(path: Path, **changes) -> None:
    """Change ``changes`` in a datastore's meta.json, leaving its checksums as they were."""
    meta = json.loads((path / DATASTORE_META).read_text())
    meta.update(changes)
    (path / DATASTORE_META).write_text(json.dumps(meta))


def resign(path: Path, name: str) -> None:
    """Record ``name``'s current size and checksum, as a forger would."""
    import hashlib

    data = (path / name).read_bytes()
    meta = json.loads((path / DATASTORE_META).read_text())
    meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / DATASTORE_META).write_text(json.dumps(meta))


def indexed_store(path: Path, seed: int = 0, n: int = 40, lists: int = 4) -> Path:
    """A datastore of ``n`` random keys at ``path``, indexed in ``lists`` inverted lists."""
    keys, values = random_keys(np.random.default_rng(seed), n)
    write_store(path, keys, values)
    index_datastore(path, lists, seed=seed)
    return path


# a word-level language model for build_datastore
LM_WORDS = "[UNK] the cat sat on mat a dog ran".split()
# 8 documents of 8 words (6 keys each at positions=6) and one of a single token, which gives none
TEXTS = [" ".join(np.random.default_rng(i).choice(LM_WORDS[1:], 8)) for i in range(8)] + ["cat"]


def tiny_lm(seed: int = 0, hidden: int = 8):
    """A 1-layer Llama and a word-level tokenizer over ``LM_WORDS``, as build_datastore's example makes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(LM_WORDS)}, "[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(seed)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=len(LM_WORDS), hidden_size=hidden, intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    return lm.eval(), PreTrainedTokenizerFast(tokenizer_object=raw)
