"""A kNN datastore of the LM's hidden states (Khandelwal et al., ICLR 2020): a reference that reads the whole context.

The n-gram reference q sees the last few tokens; the LM's last hidden state sees the whole context. A datastore
keeps that state at each position of a domain corpus (the key) with the token that followed (the value). At a
decoding step the k keys nearest the current state (squared L2) give

    p_knn(w) = Σ_{i ≤ k: value_i = w} softmax(−d_i / T)_i,

which :class:`KnnContextGraphmaxLogitsProcessor` mixes into q. The keys are the input of the model's output
embeddings (the LM head), taken by a :class:`HiddenStateTap`, both when the datastore is built and when it is
searched, so the two always see the same vectors. The search reads every key (a matrix product per block of keys),
its products in bfloat16 by default (``precision``), or, with an inverted-file index on the CPU, the keys of the lists
nearest the state (faiss, which then holds the only copy of the keys, as float16 codes).

The same pass over the corpus also records the model's marginals: its expected count of each token over the keys'
positions, e(w) = Σ_i softmax(z_i)(w), beside the tokens' own counts c(w) there. Where the two differ the model's
habits are not the corpus' (another register, other names, other punctuation), whatever the context; the log ratio
b(w) = log((c(w) + δ)/(e(w) + δ)) added to the scores with a weight w (:meth:`Datastore.marginal_bias`) is the
unigram marginal adaptation of Kneser, Peters & Klakow (1997), with the LM's own marginals as the background.
The folder's format is ``gm_graphs.format.datastore_files``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from gm_graphs.errors import DatastoreError
from gm_graphs.format.datastore_files import (
    KEY_DTYPE,
    MODEL_DTYPES,
    VALUE_DTYPE,
    check_datastore_target,
    checked_chunk,
    checked_ivf,
    checked_marginals,
    open_datastore,
    write_datastore,
)
from gm_graphs.tokenize.encoder import TokenizerIdentity

from .checks import raise_unless
from .decoders.context import MAX_MARGINAL_WEIGHT

_BLOCK = 1 << 24  # query × key products per block of the search (64 MB of float32 distances)
# the keys' type in memory and in the search's products: bfloat16 halves the memory and, on CPUs with bf16
# instructions, runs the products several times faster (benchmarks/datastore.py)
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NPROBE = 32  # lists an index reads per search: on news, the held-out perplexity of reading every key
POINTS_PER_LIST = 256  # the k-means sample's keys per list of an index
# δ of the marginal bias log((c + δ)/(e + δ)): a token the corpus never shows at these positions is pushed down by
# log(δ/(e + δ)), not to −inf (on drug-review validation text δ = 0.5 did best of 0.1, 0.5 and 2)
MARGINAL_SMOOTHING = 0.5
_NOT_FINITE = ("the model's hidden states are not finite (NaN or inf in float32); the datastore cannot be searched "
               "with them: check the model and its dtype")
_OVERFLOW = ("distances to the datastore's keys overflow float32: the model's hidden states are far larger than the "
             "keys; check the model and its dtype")


class HiddenStateTap:
    """Keeps what the model's LM head receives at each forward call: the last hidden states (B, T, d).

    Attached with a forward pre-hook on ``model.get_output_embeddings()``; inside ``generate()`` the head sees the
    newest position only, so :attr:`last` is each row's current state when the logits processors run.
    ``states`` may also be set by hand (teacher-forced scoring does).

    Args:
        model (``transformers.PreTrainedModel`` or ``None``): the model to tap; ``None``: attach later or set
            ``states`` by hand.

    Example::

        >>> import torch
        >>> head = torch.nn.Linear(4, 3)
        >>> class LM(torch.nn.Module):
        ...     def get_output_embeddings(self): return head
        >>> tap = HiddenStateTap(LM())
        >>> _ = head(torch.ones(2, 5, 4))
        >>> tap.last.shape
        torch.Size([2, 4])
        >>> tap.remove()
    """

    def __init__(self, model: Any = None):
        self.states: torch.Tensor | None = None
        self._handle = None
        if model is not None:
            self.attach(model)

    def attach(self, model: Any) -> HiddenStateTap:
        self.remove()
        self._handle = _head(model).register_forward_pre_hook(self._keep, with_kwargs=True)
        return self

    def _keep(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        states = args[0] if args else next(iter(kwargs.values()))  # the head's one input, however it is passed
        self.states = states.detach()

    @property
    def last(self) -> torch.Tensor:
        """(B, d): each row's state at its last position."""
        if self.states is None:
            raise RuntimeError("the tap has seen no forward call yet: run the model (generate) before the processor")
        if self.states.dim() not in (2, 3):
            raise ValueError(f"the tap holds states of shape {tuple(self.states.shape)}; expected (B, T, d) or (B, d)")
        return self.states[:, -1, :] if self.states.dim() == 3 else self.states

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> HiddenStateTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Datastore:
    """Keys (N, d) and values (N,) in memory on ``device``, searched by brute force (every key, one matrix product
    per block), or on the CPU through an inverted-file index (faiss) when one is given: the keys are then held once,
    as faiss' float16 codes, and ``keys`` and ``norms`` (the brute-force search's) are ``None``.

    Args:
        keys (``np.ndarray`` or ``torch.Tensor`` (N, d)): finite keys.
        values (``np.ndarray`` or ``torch.Tensor`` (N,)): the token that followed each key, in [0, ``vocab_size``).
        vocab_size (``int``): the tokenizer's vocabulary size.
        device (``str`` or ``torch.device``, defaults to ``"cpu"``): where the keys live and the search runs.
        meta (``dict``, defaults to ``{}``): what the folder records (model, tokenizer, positions, documents).
        precision (``str``, defaults to ``"bfloat16"``): the keys' type in the search's products: ``"float32"``
            ranks exactly (to float32 rounding); ``"bfloat16"`` halves the memory and runs faster on CPUs with bf16
            instructions (``benchmarks/datastore.py``), its distances within ~0.4 % of ‖h‖·‖k‖.
        ivf (``(np.ndarray, np.ndarray)`` or ``None``): an inverted-file index of the keys (``index_datastore``):
            centroids (lists, d) and offsets (lists + 1,), list i holding keys ``offsets[i]:offsets[i + 1]``. On the
            CPU the search then reads the ``nprobe`` lists whose centroids are nearest (faiss, keys in float16,
            distances in float32) instead of every key: approximate, far faster on large datastores. Off the CPU
            the brute-force search is used (a GPU reads every key fast).
        nprobe (``int``, defaults to 32): the lists read per search with ``ivf``, in [1, lists].
        marginals (``np.ndarray`` (vocab_size,) or ``None``): the model's expected count of each token over the keys'
            positions (``build_datastore`` records them); needed by :meth:`marginal_bias`.

    Example::

        >>> store = Datastore(np.array([[0.0, 0.0], [1.0, 0.0], [5.0, 5.0]]), np.array([2, 1, 0]), vocab_size=3,
        ...                   precision="float32")
        >>> d, tokens = store.neighbours(torch.tensor([[0.9, 0.0]]), k=2)
        >>> tokens.tolist(), [round(v, 2) for v in d[0].tolist()]
        ([[1, 2]], [0.01, 0.81])
    """

    def __init__(self, keys: Any, values: Any, vocab_size: int, device: str | torch.device = "cpu",
                 meta: dict | None = None, precision: str = "bfloat16", ivf: tuple | None = None,
                 nprobe: int = NPROBE, marginals: Any = None):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if isinstance(nprobe, bool) or not isinstance(nprobe, int) or nprobe < 1:
            raise ValueError(f"nprobe must be an int >= 1, got {nprobe!r}")
        keys = torch.from_numpy(np.asarray(keys)) if not torch.is_tensor(keys) else keys
        if not (keys.is_floating_point() or keys.numel() == 0):
            raise DatastoreError(f"keys must be floats, got {keys.dtype}")
        values = np.asarray(values) if not torch.is_tensor(values) else values
        if values.dtype not in (torch.int32, torch.int64) and not (isinstance(values, np.ndarray) and (
                np.issubdtype(values.dtype, np.integer) or values.size == 0)):
            raise DatastoreError(f"values must be token ids (integers), got {values.dtype}")
        values = torch.as_tensor(values, device=device).to(torch.int64)
        if keys.dim() != 2 or values.shape != (keys.shape[0],) or keys.shape[0] == 0:
            raise DatastoreError(f"keys must be (N, d) and values (N,) with N >= 1, got {tuple(keys.shape)} and "
                                 f"{tuple(values.shape)}")
        if int(values.min()) < 0 or int(values.max()) >= vocab_size:
            raise DatastoreError(f"values must be token ids in [0, {vocab_size})")
        self.values, self.vocab_size, self._dim = values, int(vocab_size), int(keys.shape[1])
        self.marginals = None if marginals is None else checked_marginals(marginals, self.vocab_size, len(self))
        self.precision = precision
        self.meta = dict(meta or {})
        self._memo: dict | None = None
        self.nprobe, self._ivf = nprobe, None
        self.keys: torch.Tensor | None = None
        self.norms: torch.Tensor | None = None
        if ivf is not None and values.device.type == "cpu":
            # the index's float16 codes are the only copy: the brute-force tensor beside them would hold the keys
            # twice (1.15 GB more at 1M keys of 576 in bfloat16, 2.3 GB in float32)
            self._ivf = _ivf_index(keys, ivf)
            self.nprobe = min(nprobe, self._ivf.nlist)
        else:
            self.keys, self.norms = _search_keys(keys, precision, device)

    @contextlib.contextmanager
    def remembered(self) -> Iterator[Datastore]:
        """Inside the block each search is kept and given again for the same states and ``k``: tuning decodes the
        same held-out states with many β, T and λ, and the neighbours depend on none of them (each state's bytes
        are read to the host to be recognised).

        Example::

            >>> store = Datastore(np.eye(3, 2), np.array([0, 1, 2]), vocab_size=3)
            >>> with store.remembered():
            ...     a = store.neighbours(torch.ones(1, 2), 2)
            ...     b = store.neighbours(torch.ones(1, 2), 2)     # not searched again
            >>> a[0] is b[0]
            True
        """
        self._memo = {}
        try:
            yield self
        finally:
            self._memo = None

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def keys_sha256(self) -> str | None:
        """What identifies the keys: their file's SHA-256 as the folder records it (``None`` for a datastore built
        in memory). ``graphmax tune --datastore`` stores its choice under it."""
        files = self.meta.get("files")
        return files["keys.npy"]["sha256"] if isinstance(files, dict) and "keys.npy" in files else None

    def __len__(self) -> int:
        return self.values.shape[0]

    def marginal_bias(self, weight: float, smoothing: float = MARGINAL_SMOOTHING) -> torch.Tensor:
        """``weight``·log((c(w) + δ)/(e(w) + δ)) for each token w (vocab_size,) float32 on the datastore's device:
        c the tokens' counts at the keys' positions (the values), e the model's expected counts there
        (``marginals``), δ = ``smoothing``. Added to the model's scores, it moves each token's probability by
        (c/e)^weight, then renormalises: the model's unigram habits toward the corpus'.

        Example::

            >>> store = Datastore(np.eye(4, 2), np.array([0, 0, 0, 1]), vocab_size=3, marginals=[1.0, 1.0, 2.0])
            >>> [round(b, 3) for b in store.marginal_bias(1.0).tolist()]     # token 0 thrice, the model said once
            [0.847, 0.0, -1.609]
        """
        if self.marginals is None:
            raise DatastoreError("this datastore records no marginals (written before graphmax kept them); build it "
                                 "again with `graphmax datastore`")
        for name, value, low, high in (("weight", weight, 0.0, MAX_MARGINAL_WEIGHT),
                                       ("smoothing", smoothing, 1e-6, 1e6)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValueError(f"{name} must be a float in [{low:g}, {high:g}], got {value!r}")
        counts = np.bincount(self.values.cpu().numpy(), minlength=self.vocab_size)
        bias = weight * np.log((counts + smoothing) / (self.marginals + smoothing))
        return torch.as_tensor(bias, dtype=torch.float32, device=self.values.device)

    def check_model(self, model: Any) -> None:
        """Raise :class:`DatastoreError` unless ``model`` computed these keys: its LM head's input width, and (when
        the datastore records them) the fingerprints of its weights and of its buffers. Where the datastore records
        the dtype its model ran in and this model runs in another, the message names the dtype to pass."""
        width = getattr(_head(model), "in_features", None)
        recorded, buffers = self.meta.get("model_sha256"), self.meta.get("buffers_sha256")
        weights_differ = recorded is not None and recorded != model_fingerprint(model)
        # datastores written before graphmax recorded the buffers are checked by their weights alone
        buffers_differ = buffers is not None and buffers != buffers_fingerprint(model)
        if width != self.dim or weights_differ or buffers_differ:
            what = f"{width}-wide states" if width != self.dim else "other weights" if weights_differ else \
                "other buffers: the same weights under another configuration, e.g. its rotary base"
            built, mine = self.meta.get("model_dtype"), model_dtype(model)
            if width == self.dim and built is not None and built != mine:  # (datastores before it record none)
                same = recorded is not None and recorded == model_fingerprint(model, as_dtype=getattr(torch, built))
                raise DatastoreError(
                    f"the datastore's keys were computed by {self.meta.get('model') or 'another model'!r} in "
                    f"{built}, and this model runs in {mine}"
                    + (f" (its weights in {built} are the datastore's)" if same else "")
                    + f"; pass --dtype {built} (dtype=torch.{built} in Python) to decode with this datastore, or "
                    f"build the datastore again in {mine}")
            raise DatastoreError(f"the datastore's keys ({self.dim}-wide) were computed by "
                                 f"{self.meta.get('model') or 'another model'!r}, not by this model ({what}); "
                                 f"build the datastore with the model that decodes (graphmax datastore --model)")

    def check_tokenizer(self, vocab_sha256: str, vocab_size: int, split_sha256: str | None = None) -> None:
        """Raise :class:`DatastoreError` unless the datastore's token ids are of this vocabulary (when it records
        one; else its size must not exceed ``vocab_size``), split as ``split_sha256`` says (when both record it:
        ``gm_graphs.tokenize.encoder.TokenizerIdentity``)."""
        mine = self.meta.get("tokenizer")
        if (mine is not None and (mine["vocab_sha256"] != vocab_sha256 or mine["vocab_size"] != vocab_size)) \
                or self.vocab_size > vocab_size:
            raise DatastoreError(f"the datastore's token ids are of another vocabulary ({self.vocab_size} tokens"
                                 + (f", {mine['vocab_sha256'][:12]}…" if mine else "") + f") than the graph's "
                                 f"({vocab_size} tokens, {vocab_sha256[:12]}…); build both with one tokenizer")
        split = None if mine is None else mine.get("split_sha256")
        if split is not None and split_sha256 is not None and split != split_sha256:
            raise DatastoreError(f"the datastore's tokenizer splits text otherwise than the graph's (split "
                                 f"{split[:12]}… against {split_sha256[:12]}…), with the same vocabulary; build both "
                                 f"with one tokenizer, loaded the same way")

    def neighbours(self, hidden: torch.Tensor, k: int, sync: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` nearest keys of each row of ``hidden`` (B, d): squared L2 distances (B, k), ascending, and
        their values (B, k), on the datastore's device: ‖k‖² − 2⟨h, k⟩ + ‖h‖², the products in ``precision``.
        ``sync``: check the states and distances are finite with a host synchronisation (a DatastoreError), or
        assert it on the device (a device-side assert, no round trip per step); ``None``: sync on the CPU only."""
        if not torch.is_tensor(hidden) or hidden.dim() != 2 or hidden.shape[1] != self.dim:
            raise ValueError(f"hidden states must be (B, {self.dim}) (the datastore's model), got "
                             f"{tuple(getattr(hidden, 'shape', ()))}; build the datastore with this model")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        h = hidden.detach().to(self.values.device, torch.float32)
        sync = self.values.device.type == "cpu" if sync is None else sync
        if self._memo is None:
            return self._search(h, k, sync)
        key = (k, tuple(h.shape), hashlib.blake2b(h.cpu().numpy().tobytes(), digest_size=16).digest())
        if key not in self._memo:
            self._memo[key] = self._search(h, k, sync)
        return self._memo[key]

    @property
    def approximate(self) -> bool:
        """Whether searches go through the inverted-file index (approximate) rather than over every key."""
        return self._ivf is not None

    def _search(self, h: torch.Tensor, k: int, sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
        raise_unless({_NOT_FINITE: torch.isfinite(h).all()}, sync, DatastoreError)
        k = min(k, len(self))
        if self._ivf is not None:
            return self._search_ivf(h, k)
        hq = h.to(self.keys.dtype)
        block = max(k, _BLOCK // max(h.shape[0], 1))
        best_d = best_i = None
        for lo in range(0, len(self), block):
            d = torch.add(self.norms[lo:lo + block], (hq @ self.keys[lo:lo + block].T).float(), alpha=-2.0)
            dv, di = torch.topk(d, min(k, d.shape[1]), dim=1, largest=False)
            di = di + lo
            if best_d is not None:
                dv, j = torch.topk(torch.cat([best_d, dv], 1), k, dim=1, largest=False)
                di = torch.cat([best_i, di], 1).gather(1, j)
            best_d, best_i = dv, di
        order = torch.argsort(best_d, dim=1, stable=True)
        dist = (best_d.gather(1, order) + (h * h).sum(1, keepdim=True)).clamp_min(0.0)
        raise_unless({_OVERFLOW: torch.isfinite(dist).all()}, sync, DatastoreError)
        return dist, self.values[best_i.gather(1, order)]

    def _search_ivf(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The index's answer, as the brute-force one's: the lists read may hold fewer than ``k`` keys, and the
        places left (faiss's id −1) get distance +inf (weight 0 in p_knn) and token 0."""
        self._ivf.nprobe = self.nprobe
        dist, ids = self._ivf.search(np.ascontiguousarray(h.numpy(), dtype=np.float32), k)
        found = torch.from_numpy(ids >= 0)
        dist = torch.where(found, torch.from_numpy(dist).clamp_min(0.0), torch.inf)
        raise_unless({_OVERFLOW: torch.isfinite(dist[found]).all()}, True, DatastoreError)
        if not bool(found[:, 0].all()):  # an empty list read: no neighbour at all
            raise DatastoreError(f"the index found no key within {self.nprobe} lists of a state; raise nprobe")
        return dist, torch.where(found, self.values[torch.from_numpy(ids).clamp_min(0)], 0)

    def distribution(self, hidden: torch.Tensor, k: int, temperature: float,
                     sync: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """p_knn of each row as (tokens (B, k), weights (B, k)) float64 weights summing to 1 per row (a token may
        appear more than once: its weights add up); ``temperature`` T > 0 (squared-distance units); ``sync`` as
        for :meth:`neighbours`."""
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not 0 < temperature < float("inf"):
            raise ValueError(f"temperature must be a finite float > 0, got {temperature!r}")
        dist, tokens = self.neighbours(hidden, k, sync)
        dist = dist.double()
        # shifted by each row's nearest distance: the same softmax, without underflow to 0/0 at tiny T (+inf, a
        # place an approximate search left empty, gets weight 0)
        return tokens, torch.softmax(-(dist - dist[:, :1]) / temperature, dim=1)


def _search_keys(keys: torch.Tensor, precision: str, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The brute-force search's keys (N, d) in ``precision`` and their squared norms (N,) in float32, on ``device``;
    a DatastoreError if a key is not finite."""
    out = torch.empty(keys.shape, dtype=PRECISIONS[precision], device=device)
    norms = torch.empty(keys.shape[0], dtype=torch.float32, device=device)
    # block by block: a float32 copy of all the keys would be 2.3 GB at 1M keys of 576 (float16 on disk)
    step = max(1, _BLOCK // keys.shape[1])
    for lo in range(0, keys.shape[0], step):
        block = keys[lo:lo + step].to(device, torch.float32)
        if not bool(torch.isfinite(block).all()):
            raise DatastoreError("keys must be finite")
        norms[lo:lo + step] = (block * block).sum(1)  # float32 whatever the precision: products alone round
        out[lo:lo + step] = block
    return out, norms


def _ivf_index(keys: Any, ivf: tuple) -> Any:
    """A faiss IVF index over ``keys`` (float16 codes, by list, no residuals) from checked centroids and offsets:
    the lists are filled with the keys as stored, nothing is re-assigned or trained."""
    faiss = _faiss()
    if torch.is_tensor(keys):
        keys = keys.detach().cpu()
        keys = (keys.float() if keys.dtype == torch.bfloat16 else keys).numpy()  # numpy has no bfloat16
    keys = np.asarray(keys)
    centroids, offsets = checked_ivf(ivf, keys.shape[1], keys.shape[0])
    lists, dim = centroids.shape
    quantizer = faiss.IndexFlatL2(dim)
    quantizer.add(centroids)
    index = faiss.IndexIVFScalarQuantizer(quantizer, dim, lists, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_L2,
                                          False)
    index.is_trained = True  # float16 codes need no training; the lists' centres are given
    for i in range(lists):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        for a in range(lo, hi, 1 << 16):  # float16 codes by blocks: the keys need not be float16 already
            b = min(hi, a + (1 << 16))
            if not np.isfinite(keys[a:b]).all():  # the only check of the keys: no brute-force copy is made
                raise DatastoreError("keys must be finite")
            with np.errstate(over="ignore"):
                half = np.ascontiguousarray(keys[a:b], dtype=np.float16)
            if not np.isfinite(half).all():
                raise DatastoreError("keys beyond float16's range (±65504) cannot be indexed; index keys as "
                                     "build_datastore stores them")
            codes = half.view(np.uint8)
            ids = np.arange(a, b, dtype=np.int64)
            index.invlists.add_entries(i, b - a, faiss.swig_ptr(ids), faiss.swig_ptr(codes))
    index.ntotal = keys.shape[0]
    return index


def _faiss() -> Any:
    """The faiss module: only an indexed datastore needs it (built or searched)."""
    try:
        import faiss
    except ImportError:  # faiss-cpu is an extra, so that an environment's own faiss (faiss-gpu) is the one used
        raise DatastoreError("an indexed datastore needs faiss, which is not installed; install it with "
                             "pip install 'graphmax[faiss]' (faiss-cpu), or install faiss-gpu") from None
    return faiss


def _model_device(model: Any) -> torch.device:
    """Where ``model``'s weights are (its first parameter's device; the CPU for a model without parameters)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _head(model: Any) -> torch.nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        raise ValueError(f"`model` must have output embeddings (an LM head) to tap, got {type(model).__name__}")
    return head


def model_dtype(model: Any) -> str:
    """The dtype ``model`` runs in, by name (``"float32"``, ``"bfloat16"``, ``"float16"``): its first floating-point
    parameter's, ``"float32"`` for a model without one.

    Example::

        >>> model_dtype(torch.nn.Linear(2, 2).to(torch.bfloat16))
        'bfloat16'
    """
    dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    return str(dtype).removeprefix("torch.")


def model_fingerprint(model: Any, as_dtype: torch.dtype | None = None) -> str:
    """SHA-256 of every parameter of ``model`` (names, shapes, float32 values): what identifies the model whose
    hidden states a datastore holds. All of them, not the head alone: LoRA on the attention (or any fine-tuning
    below the head) changes the states and leaves the head as it was. 0.28 s for SmolLM2-135M on this CPU.

    Args:
        model (``torch.nn.Module``): the model.
        as_dtype (``torch.dtype`` or ``None``, defaults to ``None``): fingerprint the weights as they would be in
            this dtype (rounded to it), e.g. a float32 model's as in bfloat16; ``None``: as they are.

    Returns:
        ``str``: 64 hex digits.

    Example::

        >>> lm = torch.nn.Linear(2, 2)
        >>> before = model_fingerprint(lm)
        >>> with torch.no_grad(): lm.bias[0] += 1
        >>> before == model_fingerprint(lm)
        False
    """
    digest = hashlib.sha256()
    for name, param in model.named_parameters():  # shared (tied) weights once
        value = param.detach().to("cpu")
        value = (value if as_dtype is None else value.to(as_dtype)).to(torch.float32).contiguous().numpy()
        digest.update(f"{name}:{tuple(value.shape)};".encode())
        digest.update(memoryview(value).cast("B"))
    return digest.hexdigest()


def buffers_fingerprint(model: Any) -> str:
    """SHA-256 of every buffer of ``model`` (names, dtypes, shapes, values), persistent or not: the rotary
    frequencies a Llama computes from its config (``rope_theta``, ``rope_scaling``) are buffers, not parameters, so
    the same weights under another configuration give other hidden states and the same
    :func:`model_fingerprint`.

    Args:
        model (``torch.nn.Module``): the model.

    Returns:
        ``str``: 64 hex digits.

    Example::

        >>> norm = torch.nn.BatchNorm1d(2)
        >>> before = buffers_fingerprint(norm)
        >>> norm.running_mean += 1
        >>> before == buffers_fingerprint(norm)
        False
    """
    digest = hashlib.sha256()
    for name, buffer in model.named_buffers():
        value = buffer.detach().to("cpu").contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_datastore(path: str | os.PathLike, device: str | torch.device = "cpu", verify: bool = True,
                   precision: str = "bfloat16", nprobe: int = NPROBE) -> Datastore:
    """The datastore folder at ``path`` (checked by ``gm_graphs.format.datastore_files.open_datastore``), its keys on
    ``device`` in ``precision``, searched through its inverted-file index when it has one (see :class:`Datastore`).

    Args:
        path (``str`` or ``os.PathLike``): a folder written by :func:`build_datastore` (or ``graphmax datastore``).
        device (``str`` or ``torch.device``, defaults to ``"cpu"``): where the keys live and the search runs.
        verify (``bool``, defaults to ``True``): also check each file's SHA-256.
        precision (``str``, defaults to ``"bfloat16"``): the keys' type in the search (``PRECISIONS``).
        nprobe (``int``, defaults to 32): the index's lists read per search (when the folder has an index).

    Returns:
        ``Datastore``: with the folder's metadata (tokenizer, model fingerprint) in ``meta``.

    Raises:
        DatastoreError: the folder is not a sound datastore; the message says what is wrong and how to fix it.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs.format.datastore_files import write_datastore
        >>> tok = {"name": "t", "vocab_size": 3, "vocab_sha256": "0" * 64}
        >>> path = write_datastore(Path(tempfile.mkdtemp()) / "ds", [(np.eye(3, 4), np.array([2, 0, 1]))], dim=4,
        ...                        tokenizer=tok, model="m", model_sha256="1" * 64, positions=8, documents=1)
        >>> store = load_datastore(path)
        >>> len(store), store.dim, store.precision
        (3, 4, 'bfloat16')
    """
    arrays = open_datastore(path, verify=verify)
    return Datastore(arrays.keys, arrays.values, arrays.meta["vocab_size"], device=device, meta=arrays.meta,
                     precision=precision, ivf=arrays.ivf, nprobe=nprobe, marginals=arrays.marginals)


def index_datastore(path: str | os.PathLike, lists: int, *, seed: int = 0,
                    points_per_list: int = POINTS_PER_LIST) -> Datastore:
    """Give the datastore at ``path`` an inverted-file index of ``lists`` lists, rewriting it atomically with its
    keys stored list after list: k-means (faiss) on a sample of ``points_per_list`` keys per list, then each key in
    the list of its nearest centroid. A search then reads ``nprobe`` lists instead of every key.

    Args:
        path (``str`` or ``os.PathLike``): a datastore folder graphmax wrote (indexed or not).
        lists (``int``): the number of lists, in [1, the number of keys]; ~4·√N is usual (1,024 for 250k keys).
        seed (``int``, defaults to 0): the sample's and k-means' seed.
        points_per_list (``int``, defaults to 256): the k-means sample's size per list.

    Returns:
        ``Datastore``: the indexed datastore, loaded.

    Example::

        >>> import tempfile; from pathlib import Path
        >>> from gm_graphs.format.datastore_files import write_datastore
        >>> tok = {"name": "t", "vocab_size": 5, "vocab_sha256": "0" * 64}
        >>> keys = np.random.default_rng(0).normal(size=(200, 8))
        >>> path = write_datastore(Path(tempfile.mkdtemp()) / "ds", [(keys, np.arange(200) % 5)], dim=8,
        ...                        tokenizer=tok, model="m", model_sha256="1" * 64, positions=8, documents=1)
        >>> store = index_datastore(path, 4)
        >>> store.approximate, len(store), store.meta["ivf_lists"]
        (True, 200, 4)
    """
    arrays = open_datastore(path)
    meta, n = arrays.meta, arrays.values.shape[0]
    if isinstance(lists, bool) or not isinstance(lists, int) or not 1 <= lists <= n:
        raise ValueError(f"lists must be an int in [1, {n}] (the datastore's keys), got {lists!r}")
    for name, value, low in (("points_per_list", points_per_list, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**31:
            raise ValueError(f"{name} must be an int in [{low}, 2**31), got {value!r}")
    _write_indexed(path, arrays.keys, arrays.values, lists, seed=seed, points_per_list=points_per_list,
                   tokenizer=meta["tokenizer"], model=meta["model"], model_sha256=meta["model_sha256"],
                   positions=meta["positions"], documents=meta["documents"], overwrite=True,
                   marginals=arrays.marginals, buffers_sha256=meta.get("buffers_sha256"),
                   model_dtype=meta.get("model_dtype"))
    return load_datastore(path, verify=False)


def _write_indexed(path: str | os.PathLike, keys: np.ndarray, values: np.ndarray, lists: int, *, seed: int = 0,
                   points_per_list: int = POINTS_PER_LIST, **meta: Any) -> None:
    """Write ``keys`` (N, d) and ``values`` (N,) at ``path`` in one atomic ``write_datastore`` with an inverted-file
    index of ``lists`` lists (checked by the caller): k-means (faiss) on a sample of ``points_per_list`` keys per
    list, each key in the list of its nearest centroid, the keys stored list after list. ``meta``: write_datastore's
    other keyword arguments (tokenizer, model, model_sha256, buffers_sha256, model_dtype, positions, documents,
    overwrite, marginals)."""
    faiss = _faiss()
    n, dim = keys.shape
    rng = np.random.default_rng(seed)
    sample = keys[np.sort(rng.choice(n, min(n, lists * points_per_list), replace=False))].astype(np.float32)
    kmeans = faiss.Kmeans(dim, lists, niter=20, seed=seed, max_points_per_centroid=points_per_list)
    kmeans.train(sample)
    quantizer = faiss.IndexFlatL2(dim)
    quantizer.add(kmeans.centroids)
    step = 1 << 16  # float32 copies of 64k keys at a time, never of all of them
    assign = np.concatenate([quantizer.search(keys[lo:lo + step].astype(np.float32), 1)[1][:, 0]
                             for lo in range(0, n, step)])
    order = np.argsort(assign, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(assign, minlength=lists))])
    chunks = ((keys[order[lo:lo + step]], values[order[lo:lo + step]]) for lo in range(0, n, step))
    write_datastore(path, chunks, dim=dim, ivf=(kmeans.centroids, offsets), **meta)


def build_datastore(model: Any, tokenizer: Any, texts: Sequence[str], path: str | os.PathLike, *,
                    positions: int = 64, batch_docs: int = 16, model_name: str = "", overwrite: bool = False,
                    progress: bool = True, ivf_lists: int = 0) -> Datastore:
    """Run ``model`` over the first ``positions + 1`` tokens of each text and write the datastore at ``path``.

    Each document gives ``positions`` keys at most: the LM head's input after tokens 1…t and the token t + 1. The
    same forward passes give the model's marginals (the sum of its softmax over the kept positions), recorded
    beside the keys for :meth:`Datastore.marginal_bias`.
    Only the first positions are kept because the decoder is asked most where the context is short, and a key
    costs one forward position (on 2 CPU cores ~700 positions/s for SmolLM2-135M).

    Args:
        model (``transformers.PreTrainedModel``): a causal LM with output embeddings (the model that will decode).
        tokenizer (``transformers.PreTrainedTokenizerBase``): its tokenizer.
        texts (sequence of ``str``): the documents (a corpus' training split).
        path (``str`` or ``os.PathLike``): the folder to write (atomically; see ``gm_graphs.format.datastore_files``).
        positions (``int``, defaults to 64): the keys kept per document, ≥ 1.
        batch_docs (``int``, defaults to 16): documents per forward call.
        model_name (``str``, defaults to ``""``): recorded in the folder.
        overwrite (``bool``, defaults to ``False``): replace a datastore graphmax wrote at ``path``.
        progress (``bool``, defaults to ``True``): a progress bar.
        ivf_lists (``int``, defaults to 0): with N > 0, the folder is written once, already indexed with N lists (at
            most one per key; k-means as in :func:`index_datastore`): the keys are kept in memory until then, as
            they are stored (float16: 1.15 GB at 1M keys of 576). 0: no index (every search reads every key), the
            keys written as the model gives them.

    Returns:
        ``Datastore``: the one written, loaded back (checked).

    Example::

        >>> import tempfile; from pathlib import Path
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
        >>> raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate("[UNK] the cat sat on mat".split())}, "[UNK]"))
        >>> raw.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> tok = PreTrainedTokenizerFast(tokenizer_object=raw)
        >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=6, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        ...                                   num_attention_heads=2, num_key_value_heads=1))
        >>> store = build_datastore(lm, tok, ["the cat sat on the mat"], Path(tempfile.mkdtemp()) / "ds", positions=4,
        ...                         progress=False)
        >>> len(store), store.dim, store.values.tolist()     # keys after "the", "the cat", …; values: what followed
        (4, 8, [2, 3, 4, 1])
    """
    if not (isinstance(positions, int) and positions >= 1 and isinstance(batch_docs, int) and batch_docs >= 1):
        raise ValueError(f"positions and batch_docs must be ints >= 1, got {positions!r} and {batch_docs!r}")
    if isinstance(ivf_lists, bool) or not isinstance(ivf_lists, int) or ivf_lists < 0:
        raise ValueError(f"ivf_lists must be an int >= 0 (0: no index), got {ivf_lists!r}")
    check_datastore_target(path, overwrite)  # before the model's forward passes
    identity = TokenizerIdentity.of(tokenizer).to_dict()
    dim = _head(model).in_features
    fingerprint = model_fingerprint(model)
    encoded = [e for e in (tokenizer(t, add_special_tokens=False)["input_ids"][:positions + 1] for t in texts)
               if len(e) >= 2]

    vocab = identity["vocab_size"]
    marginals = np.zeros(vocab)  # filled as the chunks are written: write_datastore reads it after the last one

    def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        device = _model_device(model)
        totals = torch.zeros(vocab, dtype=torch.float64, device=device)
        with HiddenStateTap(model) as tap, torch.no_grad():
            for lo in tqdm(range(0, len(encoded), batch_docs), desc="datastore", disable=not progress):
                batch = encoded[lo:lo + batch_docs]
                width = max(len(e) for e in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, e in enumerate(batch):  # right padding: the real positions are those of the text alone
                    ids[j, :len(e)] = torch.tensor(e)
                    mask[j, :len(e)] = 1
                ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
                logits = model(input_ids=ids, attention_mask=mask).logits
                # the softmax over the tokenizer's ids (a padded head's extra ids are never text), document by
                # document: a batch's rows at once would hold GBs of float64 on the CPU
                cols = min(vocab, logits.shape[-1])
                finite = torch.ones((), dtype=torch.bool, device=device)
                for j, e in enumerate(batch):
                    probs = torch.softmax(logits[j, :len(e) - 1, :cols].double(), -1)
                    totals[:cols] += probs.sum(0)
                    finite &= torch.isfinite(probs[:, 0]).all()  # a NaN or inf logit makes its row's softmax NaN
                # the positions kept: each text's but its last (no token follows it), the padding's none
                keys = tap.states[:, :-1][mask[:, 1:].bool()].float().cpu()  # the batch's one copy to the host
                if not bool(finite):  # checked per batch (the keys' copy waits for the device anyway)
                    raise DatastoreError("the model's logits are not finite (NaN or inf); its marginals cannot be "
                                         "recorded: check the model and its dtype")
                values = np.concatenate([np.asarray(e[1:], dtype=np.int64) for e in batch])
                yield keys.numpy(), values
        marginals[:] = totals.cpu().numpy()

    meta = dict(tokenizer=identity, model=model_name, model_sha256=fingerprint,
                buffers_sha256=buffers_fingerprint(model), positions=positions,
                model_dtype=model_dtype(model) if model_dtype(model) in MODEL_DTYPES else None,
                documents=len(encoded), overwrite=overwrite, marginals=marginals)
    n = sum(len(e) - 1 for e in encoded)
    if ivf_lists and n:
        # one write, already indexed: a flat datastore written first and indexed afterwards doubled the disk
        # writes, and a kill between the two left it, unindexed, where an indexed one was asked for
        _write_indexed(path, *_gathered(chunks(), n, dim, vocab), min(ivf_lists, n), **meta)
    else:  # (no keys at all: write_datastore says so)
        write_datastore(path, chunks(), dim=dim, **meta)
    return load_datastore(Path(path), verify=False)  # its checksums were computed as it was written, just now


def _gathered(chunks: Iterator[tuple[np.ndarray, np.ndarray]], n: int, dim: int,
              vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` keys (n, dim) and values (n,) of ``chunks`` in memory as a datastore stores them (float16, int32),
    each chunk checked as ``write_datastore`` checks it: k-means must not see a key the write would refuse."""
    keys, values = np.empty((n, dim), KEY_DTYPE), np.empty(n, VALUE_DTYPE)
    at = 0
    for k, v in chunks:
        k, v = checked_chunk(k, v, dim, vocab_size)
        keys[at:at + v.shape[0]], values[at:at + v.shape[0]] = k, v
        at += v.shape[0]
    return keys, values
