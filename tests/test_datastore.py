"""The kNN datastore (gm_solver.datastore): its exact and bfloat16 search, build_datastore and the tap on the real
model's head, the model fingerprint, the inverted-file index and indexed builds, and the model's marginals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gm_solver.datastore as dsmod
from gm_graphs.errors import DatastoreError
from gm_graphs.format.datastore_files import META, open_datastore, write_datastore
from gm_solver import ContextConfig, Datastore, HiddenStateTap, KnnContextGraphmaxLogitsProcessor

from .helpers import (
    LM_WORDS,
    REPO,
    TEXTS,
    indexed_store,
    random_keys,
    random_marginals,
    rewrite_meta,
    tiny_lm,
    write_store,
)

# ---- the search ---------------------------------------------------------------------------------------------------

@given(n=st.integers(1, 200), dim=st.integers(1, 12), rows=st.integers(1, 5), k=st.integers(1, 250),
       block=st.sampled_from([1, 7, 64, 1 << 24]), seed=st.integers(0, 2**16))
def test_the_search_finds_the_exact_nearest_keys_whatever_the_blocks(n, dim, rows, k, block, seed):
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(n, dim))
    h = torch.tensor(rng.normal(size=(rows, dim)), dtype=torch.float32)
    with mock.patch.object(dsmod, "_BLOCK", block):  # the keys are converted by blocks too
        store = Datastore(keys.astype(np.float16), np.arange(n), vocab_size=n, precision="float32")  # own tokens
        dist, tokens = store.neighbours(h, k)
        tok, w = store.distribution(h, k, 2.0)
    kk = min(k, n)
    assert torch.equal(store.keys, torch.from_numpy(keys.astype(np.float16)).float())
    assert torch.allclose(store.norms, (store.keys.double() ** 2).sum(1).float())
    exact = ((h.double().numpy()[:, None, :] - store.keys.double().numpy()[None]) ** 2).sum(-1)
    tolerance = 1e-3 * (1 + exact.max())
    assert dist.shape == (rows, kk) and tokens.shape == (rows, kk)
    assert np.allclose(dist.numpy(), np.sort(exact, 1)[:, :kk], atol=tolerance)
    assert (np.diff(dist.numpy(), axis=1) >= 0).all()
    # each returned key is distinct and lies at the distance returned beside it
    assert all(len(set(r)) == kk for r in tokens.tolist())
    assert np.allclose(np.take_along_axis(exact, tokens.numpy(), 1), dist.numpy(), atol=tolerance)
    assert torch.allclose(w.sum(1), torch.ones(rows, dtype=torch.float64)) and torch.equal(tok, tokens)


@given(n=st.integers(1, 300), rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_the_bfloat16_search_returns_keys_at_their_distances_up_to_its_rounding(n, rows, seed):
    rng = np.random.default_rng(seed)
    keys = rng.normal(scale=3.0, size=(n, 32))
    store = Datastore(keys, np.arange(n), vocab_size=n)
    h = torch.tensor(rng.normal(scale=3.0, size=(rows, 32)), dtype=torch.float32)
    dist, tokens = store.neighbours(h, 10)
    exact = ((h.double().numpy()[:, None, :] - keys[None]) ** 2).sum(-1)
    # each product is of bfloat16-rounded inputs (8 significant bits): off by at most ~2⁻⁷·‖h‖·‖k‖
    scale = 2.0 ** -6 * np.linalg.norm(h.numpy(), axis=1)[:, None] * np.linalg.norm(keys, axis=1).max()
    assert (np.abs(np.take_along_axis(exact, tokens.numpy(), 1) - dist.numpy()) <= scale + 1e-3).all()
    assert (np.sort(exact, 1)[:, :min(10, n)] >= dist.numpy() - scale - 1e-3).all()


def test_a_datastore_refuses_bad_arrays_and_hidden_states_of_another_width():
    with pytest.raises(DatastoreError):
        Datastore(np.zeros((3, 2)), np.array([0, 1]), vocab_size=3)
    with pytest.raises(DatastoreError):
        Datastore(np.full((2, 2), np.inf), np.array([0, 1]), vocab_size=3)
    late = np.zeros((9, 2))
    late[8, 1] = np.nan
    with mock.patch.object(dsmod, "_BLOCK", 4), pytest.raises(DatastoreError, match="finite"):
        Datastore(late, np.zeros(9, dtype=int), vocab_size=3)  # in the last block of the conversion
    with pytest.raises(DatastoreError, match="floats"):
        Datastore(np.zeros((2, 2), dtype=np.int64), np.array([0, 1]), vocab_size=3)
    with pytest.raises(DatastoreError):
        Datastore(np.zeros((2, 2)), np.array([0, 3]), vocab_size=3)
    with pytest.raises(ValueError, match="precision"):
        Datastore(np.zeros((2, 2)), np.array([0, 1]), vocab_size=3, precision="float16")
    store = Datastore(np.zeros((2, 2)), np.array([0, 1]), vocab_size=3)
    with pytest.raises(ValueError, match="build the datastore with this model"):
        store.neighbours(torch.zeros(1, 3), 1)


# ---- the real model -----------------------------------------------------------------------------------------------

def test_build_datastore_keys_are_the_models_final_hidden_states(smollm2, tmp_path):
    model, tok = smollm2
    texts = ["The film was great and I loved it.", "x", "Terrible acting and a boring, long plot."]
    store = dsmod.build_datastore(model, tok, texts, tmp_path / "ds", positions=6, batch_docs=2, progress=False)
    assert store.meta["documents"] == 2 and len(store) == 12 and store.dim == model.config.hidden_size
    for i, text in enumerate((texts[0], texts[2])):
        ids = tok(text, add_special_tokens=False)["input_ids"][:7]
        with torch.no_grad():
            h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
        # float16 keys of a padded batch: equal to a lone forward pass to float16's rounding (and batch numerics)
        stored = torch.from_numpy(open_datastore(tmp_path / "ds").keys[6 * i:6 * i + 6].astype(np.float32))
        assert torch.allclose(stored, h, atol=1e-2, rtol=2e-3)
        assert store.values[6 * i:6 * i + 6].tolist() == ids[1:]


def test_inside_generate_the_tap_holds_each_rows_newest_hidden_state(smollm2, drug_graph):
    model, tok = smollm2
    batch = tok(["The pill", "I took it for"], return_tensors="pt", padding=True, padding_side="left")
    seen = []

    class Spy(KnnContextGraphmaxLogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append((input_ids.clone(), self.tap.last.clone()))
            return super().__call__(input_ids, scores)

    keys = np.random.default_rng(0).normal(size=(50, model.config.hidden_size))
    store = Datastore(keys, np.arange(50), vocab_size=len(tok))
    with HiddenStateTap(model) as tap:
        out = model.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id,
                             logits_processor=[Spy(drug_graph, store, tap, knn_weight=0.5)])
    assert len(seen) == 3 and out.shape[1] == batch["input_ids"].shape[1] + 3
    for input_ids, hidden in seen:
        mask = (input_ids != tok.pad_token_id).long()
        with torch.no_grad():
            full = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state[:, -1]
        assert torch.allclose(hidden, full, atol=1e-3)


def test_the_datastore_checks_its_model_and_vocabulary(smollm2, drug_graph, tmp_path):
    model, tok = smollm2
    store = dsmod.build_datastore(model, tok, ["The pill worked well for me."], tmp_path / "ds", positions=4,
                                  progress=False)
    store.check_model(model)  # its own model passes
    forged = Datastore(store.keys, store.values, store.vocab_size, meta={**store.meta, "model_sha256": "0" * 64})
    with pytest.raises(DatastoreError, match="other weights"):
        forged.check_model(model)
    # fine-tuning below the head (LoRA on the attention, merged) changes the states and not the head: refused too
    weight = model.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        weight[0, 0] += 1e-3
    try:
        with pytest.raises(DatastoreError, match="other weights"):
            store.check_model(model)
    finally:
        with torch.no_grad():
            weight[0, 0] -= 1e-3
    store.check_model(model)
    KnnContextGraphmaxLogitsProcessor(drug_graph, store, HiddenStateTap())  # the graph's vocabulary: accepted
    other = {**store.meta["tokenizer"], "vocab_sha256": "0" * 64}
    foreign = Datastore(store.keys, store.values, store.vocab_size, meta={**store.meta, "tokenizer": other})
    with pytest.raises(DatastoreError, match="another vocabulary"):
        KnnContextGraphmaxLogitsProcessor(drug_graph, foreign, HiddenStateTap())


def test_hidden_states_that_are_not_finite_and_extreme_temperatures():
    store = Datastore(np.eye(3, 4), np.array([2, 2, 1]), vocab_size=3)
    with pytest.raises(DatastoreError, match="not finite"):
        store.neighbours(torch.full((1, 4), torch.nan), 2)
    with pytest.raises(DatastoreError, match="overflow"):
        store.neighbours(torch.full((1, 4), 1e30), 2)
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="temperature"):
            store.distribution(torch.zeros(1, 4), 2, bad)
    for t in (1e-300, 1e300):
        tokens, w = store.distribution(torch.tensor([[0.0, 0.9, 0.0, 0.0]]), 3, t)
        assert torch.isfinite(w).all() and torch.allclose(w.sum(1), torch.ones(1, dtype=torch.float64))
    assert store.distribution(torch.tensor([[0.0, 0.9, 0.0, 0.0]]), 3, 1e-300)[1][0].tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="k must be"):
        store.neighbours(torch.zeros(1, 4), 0)


def test_the_tap_reads_a_head_called_with_keywords_and_refuses_odd_states():
    head = torch.nn.Linear(4, 3)

    class LM(torch.nn.Module):
        def get_output_embeddings(self):
            return head

    with HiddenStateTap(LM()) as tap:
        head(input=torch.ones(2, 5, 4))
        assert tap.last.shape == (2, 4)
        tap.states = torch.tensor(1.0)
        with pytest.raises(ValueError, match="shape"):
            _ = tap.last
    with pytest.raises(ValueError, match="LM head"):
        HiddenStateTap(torch.nn.Linear(2, 2))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_the_model_fingerprint_changes_with_any_parameter(which, where):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1))
    before = dsmod.model_fingerprint(lm)
    assert before == dsmod.model_fingerprint(lm)
    params = list(lm.parameters())
    param = params[which % len(params)]
    with torch.no_grad():
        param.view(-1)[where % param.numel()] += 0.5
    assert dsmod.model_fingerprint(lm) != before


def test_the_same_weights_under_another_rotary_base_are_another_model(tmp_path):
    """The rotary frequencies are buffers, set by the config: same parameters, other hidden states."""
    from transformers import LlamaConfig, LlamaForCausalLM

    lm, tok = tiny_lm()
    store = dsmod.build_datastore(lm, tok, TEXTS, tmp_path / "ds", positions=6, progress=False)
    config = LlamaConfig(**{**lm.config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10.0}})
    other = LlamaForCausalLM(config).eval()
    other.load_state_dict(lm.state_dict())
    assert dsmod.model_fingerprint(other) == dsmod.model_fingerprint(lm)  # what the weights alone cannot tell
    with torch.no_grad():
        ids = torch.tensor([tok(TEXTS[0], add_special_tokens=False)["input_ids"][:6]])
        states = [m.model(input_ids=ids).last_hidden_state for m in (lm, other)]
        assert not torch.allclose(*states)
    store.check_model(lm)
    with pytest.raises(DatastoreError, match="other buffers: the same weights under another configuration"):
        store.check_model(other)
    assert dsmod.index_datastore(tmp_path / "ds", 2).meta["buffers_sha256"] == store.meta["buffers_sha256"]
    # a datastore written before graphmax recorded the buffers: checked by its weights alone
    meta = json.loads((tmp_path / "ds" / META).read_text())
    del meta["buffers_sha256"]
    (tmp_path / "ds" / META).write_text(json.dumps(meta))
    dsmod.load_datastore(tmp_path / "ds").check_model(other)
    rewrite_meta(tmp_path / "ds", buffers_sha256="XY" * 32)
    with pytest.raises(DatastoreError, match="buffers_sha256 that is not 64 lowercase hex digits"):
        dsmod.load_datastore(tmp_path / "ds")


def test_a_datastore_of_the_same_model_in_another_dtype_names_the_dtype_to_pass(tmp_path):
    """A datastore built in bfloat16 and a decoder in float32 (the defaults of a GPU and of a CPU): refused as
    "other weights" before the datastore recorded its dtype; now the message names the dtype to pass."""
    import copy

    lm, tok = tiny_lm()
    half = copy.deepcopy(lm).to(torch.bfloat16)
    store = dsmod.build_datastore(half, tok, TEXTS, tmp_path / "ds", positions=6, progress=False)
    assert store.meta["model_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "ds" / META).read_text())["model_dtype"] == "bfloat16"
    store.check_model(half)
    with pytest.raises(DatastoreError, match=r"in bfloat16, and this model runs in float32 \(its weights in "
                                             r"bfloat16 are the datastore's\); pass --dtype bfloat16") as refused:
        store.check_model(lm)
    assert "\n" not in str(refused.value) and "other weights" not in str(refused.value)
    # the other way round: a float32 datastore cannot be told from a bfloat16 model's weights; the dtype is named
    full = dsmod.build_datastore(lm, tok, TEXTS, tmp_path / "full", positions=6, progress=False)
    assert full.meta["model_dtype"] == "float32"
    with pytest.raises(DatastoreError, match=r"in float32, and this model runs in bfloat16; pass --dtype float32"):
        full.check_model(half)
    # the index keeps the record; another model in another dtype is named by its dtype too
    assert dsmod.index_datastore(tmp_path / "ds", 2).meta["model_dtype"] == "bfloat16"
    other = tiny_lm(seed=1)[0]
    with pytest.raises(DatastoreError, match=r"pass --dtype bfloat16") as refused:
        store.check_model(other)
    assert "its weights in" not in str(refused.value)
    # a datastore written before graphmax recorded the dtype still loads, and says "other weights" as before
    meta = json.loads((tmp_path / "ds" / META).read_text())
    del meta["model_dtype"]
    (tmp_path / "ds" / META).write_text(json.dumps(meta))
    old = dsmod.load_datastore(tmp_path / "ds")
    old.check_model(half)
    with pytest.raises(DatastoreError, match="other weights"):
        old.check_model(lm)
    rewrite_meta(tmp_path / "ds", model_dtype="float64")
    with pytest.raises(DatastoreError, match="model_dtype that is none of float32, bfloat16, float16"):
        dsmod.load_datastore(tmp_path / "ds")


def test_a_remembered_datastore_searches_each_state_once_and_answers_the_same():

    from pipelines.heldout import HeldOut
    from pipelines.tune import tune_knn

    rng = np.random.default_rng(3)
    store = Datastore(rng.normal(size=(60, 4)), rng.integers(0, 6, 60), vocab_size=6)
    h = torch.tensor(rng.normal(size=(3, 4)), dtype=torch.float32)
    plain = store.neighbours(h, 5)
    searches = []
    real = store._search
    with mock.patch.object(store, "_search", side_effect=lambda *a: searches.append(1) or real(*a)):
        with store.remembered():
            for _ in range(3):
                again = store.neighbours(h.clone(), 5)
                assert torch.equal(again[0], plain[0]) and torch.equal(again[1], plain[1])
            store.neighbours(h, 6)  # another k: another search
            store.neighbours(h[:2], 5)  # other states: another search
        assert len(searches) == 3
        store.neighbours(h, 5)  # outside the block: searched every time
        assert len(searches) == 4 and store._memo is None
        # tuning decodes each held-out step with 20 settings and searches it once
        ids = [torch.tensor(rng.integers(0, 6, n + 1)) for n in (4, 3)]
        held = HeldOut(ids, [torch.randn(len(i) - 1, 6) for i in ids],
                       [torch.tensor(rng.normal(size=(len(i) - 1, 4)), dtype=torch.float32) for i in ids])
        counts = sp.csr_matrix(rng.integers(0, 3, (6, 6)).astype(float))
        searches.clear()
        _, _, table = tune_knn(counts, held, ContextConfig(lam=1.0), store, k=8, progress=False)
        assert len(table) >= 16 and len(searches) == 4  # 4 steps: positions 1–4, rows of both documents


@settings(max_examples=30, deadline=None)
@given(n=st.integers(8, 300), dim=st.integers(1, 10), lists=st.integers(1, 8), rows=st.integers(1, 4),
       k=st.integers(1, 40), nprobe=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_an_indexed_datastore_keeps_its_keys_and_searches_within_its_lists(tmp_path_factory, n, dim, lists, rows, k,
                                                                            nprobe, seed):
    rng = np.random.default_rng(seed)
    keys, values = rng.normal(size=(n, dim)), rng.integers(0, 50, n)
    path = write_store(tmp_path_factory.mktemp("ds") / "ds", keys, values)
    lists = min(lists, n)
    store = dsmod.index_datastore(path, lists, seed=seed)
    arrays = open_datastore(path)
    centroids, offsets = arrays.ivf
    # the same (key, value) pairs, stored list after list, each key in the list of its nearest centroid
    before = sorted(zip(map(bytes, keys.astype(np.float16)), values.tolist()))
    assert sorted(zip(map(bytes, arrays.keys), arrays.values.tolist())) == before
    near = ((arrays.keys.astype(np.float64)[:, None] - centroids.astype(np.float64)[None]) ** 2).sum(-1)
    lists_of = np.repeat(np.arange(lists), np.diff(offsets))
    assert np.allclose(near[np.arange(n), lists_of], near.min(1), rtol=1e-4, atol=1e-4)
    h = torch.tensor(rng.normal(size=(rows, dim)), dtype=torch.float32)
    exact = ((h.double().numpy()[:, None] - arrays.keys.astype(np.float64)[None]) ** 2).sum(-1)
    # all the lists read: the exact search
    full = dsmod.load_datastore(path, precision="float32", nprobe=lists)
    dist, tokens = full.neighbours(h, k)
    kk = min(k, n)
    assert np.allclose(dist.numpy(), np.sort(exact, 1)[:, :kk], rtol=1e-4, atol=1e-4)
    brute = Datastore(arrays.keys, arrays.values, 50, precision="float32").neighbours(h, k)
    assert np.allclose(dist.numpy(), brute[0].numpy(), rtol=1e-4, atol=1e-4)
    # fewer lists: the keys of the lists nearest each state, at their true distances; places left: +inf, weight 0
    store = dsmod.load_datastore(path, nprobe=nprobe)
    probed = np.argsort(((h.double().numpy()[:, None] - centroids.astype(np.float64)[None]) ** 2).sum(-1), 1)
    for r in range(rows):
        inside = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in probed[r, :min(nprobe, lists)]])
        if len(inside) == 0:
            continue
        d, t = store.neighbours(h[r:r + 1], k)
        found = torch.isfinite(d[0])
        want = np.sort(exact[r, inside])[:kk]
        assert int(found.sum()) == min(kk, len(inside))
        assert np.allclose(d[0, found].numpy(), want[:int(found.sum())], rtol=1e-3, atol=1e-3)
        tok, w = store.distribution(h[r:r + 1], k, 2.0)
        assert torch.allclose(w.sum(1), torch.ones(1, dtype=torch.float64)) and (w[0, ~found] == 0).all()


def test_an_index_that_finds_nothing_is_a_one_line_error_and_the_options_are_checked(tmp_path):
    keys = np.concatenate([np.zeros((5, 2)), np.full((5, 2), 10.0)])
    path = write_store(tmp_path / "ds", keys, np.arange(10))
    centroids = np.array([[0.0, 0.0], [10.0, 10.0], [-50.0, -50.0]])  # the third list is empty
    write_store(path, keys, np.arange(10), ivf=(centroids, np.array([0, 5, 10, 10])), overwrite=True)
    store = dsmod.load_datastore(path, nprobe=1)
    assert store.approximate and store.neighbours(torch.zeros(1, 2), 3)[1].tolist() == [[0, 1, 2]]
    with pytest.raises(DatastoreError, match="raise nprobe"):
        store.neighbours(torch.full((1, 2), -49.0), 3)
    for bad in (0, -1, 11, 2.5, True):
        with pytest.raises(ValueError, match="lists must be"):
            dsmod.index_datastore(path, bad)
    with pytest.raises(ValueError, match="nprobe"):
        dsmod.load_datastore(path, nprobe=0)
    for ivf, match in [((centroids, np.array([0, 5, 9, 9])), "end at 9, but there are 10 keys"),
                       ((centroids[:, :1], np.array([0, 5, 10, 10])), "centroids"),
                       ((centroids, np.array([0, 6, 5, 10])), "never decrease")]:
        with pytest.raises(DatastoreError, match=match):
            write_store(path, keys, np.arange(10), ivf=ivf, overwrite=True)
    assert dsmod.load_datastore(path).approximate  # the failed writes left the indexed datastore


_INDEXER = """
import json, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, "tests")
import faiss  # imported once, not in each forked child
from gm_graphs.format.datastore_files import open_datastore
from gm_solver.datastore import index_datastore
from helpers import forked, random_keys, write_store
path, log = Path(sys.argv[1]), Path(sys.argv[2])

def plain():
    write_store(path, *random_keys(np.random.default_rng(0)), overwrite=True)

def index(env):
    return forked(lambda: index_datastore(path, 3), env)

def state():
    arrays = open_datastore(path)
    return [arrays.meta["keys"], arrays.ivf is not None, sorted(arrays.values.tolist())]

plain()
out = {"clean": index({"GRAPHMAX_FAULT_LOG": str(log)}), "runs": []}
out["points"] = list(dict.fromkeys(log.read_text().split()))
for point in out["points"]:
    plain()
    out["runs"].append([point, index({"GRAPHMAX_FAULT": point}), state()])
out["last"] = [index({}), state()[1], sorted(p.name for p in path.parent.iterdir())]
print(json.dumps(out))
"""


def test_a_kill_at_any_point_of_indexing_leaves_the_plain_datastore_or_the_indexed_one(tmp_path):
    run = subprocess.run([sys.executable, "-c", _INDEXER, str(tmp_path / "ds"), str(tmp_path / "points")], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["clean"] == 0 and "datastore.written" in out["points"]
    plain = sorted(random_keys(np.random.default_rng(0))[1].tolist())
    for point, code, after in out["runs"]:
        assert code == 137, point
        assert after[0] == 40 and after[2] == plain, point  # the plain datastore or the indexed one, whole
    assert out["last"] == [0, True, ["ds", "points"]]  # the next writer removes the debris of the killed ones


def test_an_index_given_in_memory_is_checked_as_one_read_from_a_folder(tmp_path):
    keys = np.random.default_rng(0).normal(size=(40, 6))
    with pytest.raises(DatastoreError, match="offsets must lie"):  # uint64 never goes negative when differenced
        Datastore(keys, np.zeros(40, dtype=int), 3, ivf=(np.zeros((2, 6)), np.array([0, 2**62, 40], np.uint64)))
    with pytest.raises(DatastoreError, match="never decrease"):
        Datastore(keys, np.zeros(40, dtype=int), 3, ivf=(np.zeros((2, 6)), np.array([0, 50, 40], np.uint64)))
    with pytest.raises(DatastoreError, match="float16's range"):
        Datastore(keys * 1e6, np.zeros(40, dtype=int), 3, ivf=(np.zeros((1, 6)), np.array([0, 40])))
    late = keys.copy()
    late[39, 5] = np.nan  # the index is the keys' only copy, so it checks them: here in its last list
    with pytest.raises(DatastoreError, match="keys must be finite"):
        Datastore(late, np.zeros(40, dtype=int), 3, ivf=(np.zeros((2, 6)), np.array([0, 20, 40])))
    path = write_store(tmp_path / "ds", *random_keys(np.random.default_rng(1)))
    for name, bad in (("seed", -1), ("seed", 2**40), ("seed", True), ("points_per_list", 0)):
        with pytest.raises(ValueError, match=name):
            dsmod.index_datastore(path, 2, **{name: bad})
    assert not open_datastore(path).ivf


def _tensor_bytes(store: Datastore) -> int:
    return sum(t.numel() * t.element_size() for t in vars(store).values() if torch.is_tensor(t))


def test_an_indexed_datastore_holds_its_keys_once_and_answers_as_the_exact_search(tmp_path):
    arrays = open_datastore(indexed_store(tmp_path / "ds", n=300, lists=4))
    store = Datastore(arrays.keys, arrays.values, 50, meta=arrays.meta, ivf=arrays.ivf, nprobe=4)  # every list
    exact = Datastore(arrays.keys, arrays.values, 50, meta=arrays.meta, precision="float32")  # the same keys
    # faiss' float16 codes are the only copy of the keys: no brute-force tensor (nor its norms) beside them
    assert store.approximate and store.keys is None and store.norms is None
    assert _tensor_bytes(store) == store.values.numel() * 8 and _tensor_bytes(exact) == 300 * 8 + 300 * 6 * 4 + 300 * 4
    assert store.dim == exact.dim == 6 and len(store) == len(exact) == 300
    h = torch.tensor(np.random.default_rng(1).normal(size=(3, 6)), dtype=torch.float32)
    (d, t), (de, te) = store.neighbours(h, 10), exact.neighbours(h, 10)
    assert torch.equal(t, te) and torch.allclose(d, de, rtol=1e-4, atol=1e-4)
    (tokens, w), (te, we) = store.distribution(h, 10, 2.0), exact.distribution(h, 10, 2.0)
    assert torch.equal(tokens, te) and torch.allclose(w, we, atol=1e-5)
    with store.remembered():
        assert store.neighbours(h, 10)[0] is store.neighbours(h, 10)[0]
    store.check_tokenizer("ab" * 32, 50)
    with pytest.raises(DatastoreError, match="another vocabulary"):
        store.check_tokenizer("0" * 64, 50)
    with pytest.raises(ValueError, match=r"\(B, 6\)"):
        store.neighbours(torch.zeros(1, 5), 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the device tool lends one to some sessions)")
def test_off_the_cpu_an_indexed_datastore_reads_every_key(tmp_path):
    path = indexed_store(tmp_path / "ds", n=300, lists=4)
    arrays = open_datastore(path)
    gpu = dsmod.load_datastore(path, device="cuda", precision="float32", nprobe=1)
    assert not gpu.approximate and gpu.keys.device.type == "cuda" and tuple(gpu.keys.shape) == (300, 6)
    h = torch.tensor(np.random.default_rng(1).normal(size=(3, 6)), dtype=torch.float32)
    d, t = gpu.neighbours(h.cuda(), 10)
    de, te = Datastore(arrays.keys, arrays.values, 50, precision="float32").neighbours(h, 10)
    assert torch.equal(t.cpu(), te) and torch.allclose(d.cpu(), de, rtol=1e-4, atol=1e-4)


# ---- an indexed build ---------------------------------------------------------------------------------------------

def test_an_indexed_build_writes_once_the_keys_of_a_plain_build_list_after_list(tmp_path, monkeypatch):
    lm, tok = tiny_lm()
    plain = dsmod.build_datastore(lm, tok, TEXTS, tmp_path / "plain", positions=6, progress=False)
    log = tmp_path / "points"
    monkeypatch.setenv("GRAPHMAX_FAULT_LOG", str(log))
    store = dsmod.build_datastore(lm, tok, TEXTS, tmp_path / "ds", positions=6, progress=False, ivf_lists=3)
    monkeypatch.delenv("GRAPHMAX_FAULT_LOG")
    points = log.read_text().split()
    assert points.count("stage.created") == points.count("datastore.written") == 1  # one folder, written once
    flat, arrays = open_datastore(tmp_path / "plain"), open_datastore(tmp_path / "ds")
    assert sorted(zip(map(bytes, arrays.keys), arrays.values.tolist())) == \
        sorted(zip(map(bytes, flat.keys), flat.values.tolist()))
    assert arrays.meta["ivf_lists"] == 3 and arrays.meta["documents"] == flat.meta["documents"] == 8
    assert store.approximate and store.keys is None and len(store) == len(plain) == 48 and store.dim == 8
    store.check_model(lm)
    with pytest.raises(DatastoreError, match="16-wide states"):
        store.check_model(tiny_lm(hidden=16)[0])
    # the index index_datastore gives the plain datastore: one k-means and one order for both
    dsmod.index_datastore(tmp_path / "plain", 3)
    again = open_datastore(tmp_path / "plain")
    assert np.array_equal(again.keys, arrays.keys) and np.array_equal(again.values, arrays.values)
    assert all(np.array_equal(a, b) for a, b in zip(again.ivf, arrays.ivf))
    # more lists than keys: one per key; no keys at all: refused, nothing written
    many = dsmod.build_datastore(lm, tok, TEXTS[:2], tmp_path / "many", positions=6, progress=False, ivf_lists=100)
    assert many.meta["ivf_lists"] == len(many) == 12
    with pytest.raises(DatastoreError, match="no keys"):
        dsmod.build_datastore(lm, tok, ["cat"], tmp_path / "none", positions=6, progress=False, ivf_lists=3)
    assert sorted(os.listdir(tmp_path)) == ["ds", "many", "plain", "points"]


_INDEXED_BUILDS = """
import json, os, shutil, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, "tests")
import faiss, transformers.models.llama.modeling_llama  # imported once, not in each child
import gm_graphs.store.faults as faults
from gm_graphs.format.datastore_files import open_datastore
from gm_solver.datastore import build_datastore
from helpers import TEXTS, random_keys, tiny_lm, write_store
path, log = Path(sys.argv[1]), Path(sys.argv[2])
real = faults.fault_point

def build(kill_at):
    # in a forked child (the parent runs no torch op): the kill_at-th fault point reached kills it as GRAPHMAX_FAULT
    # does, at every arrival of a point and not only its first (a flat write first reaches the same points twice);
    # the exit code and the points reached
    log.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            os.environ["GRAPHMAX_FAULT_LOG"] = str(log)
            reached = 0
            def counted(name):
                nonlocal reached
                reached += 1
                if reached == kill_at:
                    os.environ["GRAPHMAX_FAULT"] = name
                real(name)
            for module in list(sys.modules.values()):
                if vars(module).get("fault_point") is real:  # (no lazy module asked: transformers 5.19 imports on it)
                    module.fault_point = counted
            import torch
            torch.set_num_threads(1)
            lm, tok = tiny_lm()
            build_datastore(lm, tok, TEXTS, path, positions=6, model_name="new", overwrite=True, progress=False,
                            ivf_lists=3)
            code = 0
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return code, log.read_text().split()

def state():
    if not os.path.lexists(path):
        return None
    arrays = open_datastore(path)
    return [arrays.meta["model"], arrays.ivf is not None, sorted(arrays.values.tolist())]

def nothing():  # nor a dead writer's debris, whose removal would reach points of its own
    shutil.rmtree(path.parent)
    path.parent.mkdir()

def old():  # written in this process, which removes the debris
    write_store(path, *random_keys(np.random.default_rng(0)), overwrite=True)

out = {}
for name, start in (("nothing", nothing), ("old", old)):
    start()
    code, seen = build(0)
    out[name] = {"clean": [code, state()], "points": seen, "runs": []}
    for i in range(1, len(seen) + 1):
        start()
        before = state()
        code, reached = build(i)
        out[name]["runs"].append([seen[i - 1], code, reached[-1:], before, state()])
out["last"] = [build(0)[0], state(), sorted(os.listdir(path.parent))]
print(json.dumps(out))
"""


def test_a_kill_at_any_point_of_an_indexed_build_leaves_the_old_datastore_or_the_new_indexed_one(tmp_path):
    run = subprocess.run([sys.executable, "-c", _INDEXED_BUILDS, str(tmp_path / "ds"), str(tmp_path / "points")],
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    new = ["new", True, sorted(v for t in TEXTS for v in tiny_lm()[1](t, add_special_tokens=False)["input_ids"][1:7])]
    old = ["m", False, sorted(random_keys(np.random.default_rng(0))[1].tolist())]
    for start, before in (("nothing", None), ("old", old)):
        code, after = out[start]["clean"]
        points = out[start]["points"]
        assert code == 0 and after == new, start
        # the folder is written once: no flat datastore is ever committed, then rewritten indexed
        assert {"stage.created", "datastore.chunk", "datastore.written", "stage.filled"} <= set(points), points
        assert points.count("datastore.written") == points.count("stage.filled") == 1, points
        assert len(out[start]["runs"]) == len(points)
        for point, code, died_at, was, after in out[start]["runs"]:
            assert code == 137 and died_at == [point] and was == before, (start, point, died_at)
            assert after in (before, new), (start, point, after)
    assert out["last"] == [0, new, ["ds", "points"]]  # the next writer removes the debris of the killed ones


# ---- the model's marginals and the marginal bias ------------------------------------------------------------------

def test_build_datastore_records_the_models_softmax_summed_over_the_keys_positions(tmp_path):
    lm, tok = tiny_lm()
    plain = dsmod.build_datastore(lm, tok, TEXTS, tmp_path / "plain", positions=6, progress=False)
    want = np.zeros(len(LM_WORDS))
    with torch.no_grad():
        for text in TEXTS:
            ids = tok(text, add_special_tokens=False)["input_ids"][:7]
            if len(ids) >= 2:  # the softmax at each kept position, summed independently of the builder
                logits = lm(input_ids=torch.tensor([ids])).logits[0, :len(ids) - 1].double()
                want += torch.softmax(logits, -1).sum(0).numpy()
    # the builder's batched forward pass gives float32 logits that differ from one sequence's in the last bits
    assert plain.marginals is not None and np.allclose(plain.marginals, want, rtol=1e-6, atol=1e-12)
    assert np.isclose(plain.marginals.sum(), len(plain))
    indexed = dsmod.build_datastore(lm, tok, TEXTS, tmp_path / "indexed", positions=6, progress=False, ivf_lists=3)
    assert np.array_equal(indexed.marginals, plain.marginals)  # the order of the keys does not change them
    assert np.array_equal(dsmod.index_datastore(tmp_path / "plain", 2).marginals, plain.marginals)
    assert np.array_equal(dsmod.load_datastore(tmp_path / "indexed").marginals, plain.marginals)


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(1, 30), n=st.integers(1, 60), weight=st.floats(0, 3), smoothing=st.floats(0.01, 5),
       seed=st.integers(0, 2**16))
def test_the_marginal_bias_is_the_weighted_log_ratio_of_the_corpus_counts_to_the_models(vocab, n, weight, smoothing,
                                                                                        seed):
    rng = np.random.default_rng(seed)
    values, expected = rng.integers(0, vocab, n), random_marginals(vocab, n, seed)
    store = Datastore(rng.normal(size=(n, 3)), values, vocab_size=vocab, marginals=expected)
    counts = np.array([np.sum(values == w) for w in range(vocab)])
    want = weight * np.log((counts + smoothing) / (expected + smoothing))
    assert np.allclose(store.marginal_bias(weight, smoothing).numpy(), want, rtol=1e-5, atol=1e-5)
    if weight == 0:  # no bias at all, whatever the counts
        assert not store.marginal_bias(weight, smoothing).any()


@pytest.mark.parametrize("kw, match", [(dict(weight=-1.0), "weight"), (dict(weight=float("nan")), "weight"),
                                       (dict(weight="1"), "weight"), (dict(weight=1.0, smoothing=0.0), "smoothing"),
                                       (dict(weight=1.0, smoothing=float("inf")), "smoothing"),
                                       (dict(weight=1.0, smoothing=1e-320), "smoothing"),
                                       (dict(weight=11.0), "weight"), (dict(weight=1e308), "weight"),
                                       (dict(weight=10**400), "weight")])
def test_the_marginal_bias_checks_its_arguments(kw, match):
    store = Datastore(np.eye(3, 2), np.array([0, 1, 1]), vocab_size=2, marginals=[1.5, 1.5])
    with pytest.raises(ValueError, match=match):
        store.marginal_bias(**kw)


def test_marginals_are_copied_when_checked_and_logits_that_are_not_finite_stop_the_build(tmp_path):
    given = np.array([1.0, 1.0, 1.0])
    store = Datastore(np.eye(3, 2), np.array([0, 1, 2]), vocab_size=3, marginals=given)
    given[0] = np.nan  # after the check: the datastore keeps what was checked
    assert np.isfinite(store.marginal_bias(1.0).numpy()).all()
    lm, tok = tiny_lm()
    with torch.no_grad():
        lm.lm_head.weight.mul_(1e39)  # finite states (the head is not tied here), logits beyond float32
    with pytest.raises(DatastoreError, match="logits are not finite") as err:
        dsmod.build_datastore(lm, tok, TEXTS, tmp_path / "ds", positions=6, progress=False)
    assert "\n" not in str(err.value) and os.listdir(tmp_path) == []


def test_a_datastore_refuses_a_graph_whose_tokenizer_splits_text_otherwise(tmp_path):
    tok = {"name": "t", "vocab_size": 3, "vocab_sha256": "0" * 64, "split_sha256": "c" * 64}
    store = dsmod.load_datastore(write_datastore(tmp_path / "ds", [(np.eye(3, 4), np.arange(3))], dim=4,
                                                 tokenizer=tok, model="m", model_sha256="1" * 64, positions=8,
                                                 documents=1))
    store.check_tokenizer("0" * 64, 3, "c" * 64)
    store.check_tokenizer("0" * 64, 3, None)  # a graph built before graphs recorded the split: by vocabulary
    with pytest.raises(DatastoreError, match="splits text otherwise"):
        store.check_tokenizer("0" * 64, 3, "d" * 64)
