"""A kNN datastore of the LM's hidden states (Khandelwal et al., ICLR 2020): a reference that reads the whole context.

The n-gram reference q sees the last few tokens; the LM's last hidden state sees the whole context. A datastore
keeps that state at each position of a domain corpus (the key) with the token that followed (the value). At a
decoding step the k keys nearest the current state (squared L2) give

    p_knn(w) = Σ_{i ≤ k: value_i = w} softmax(−d_i / T)_i,

which :class:`KnnContextGraphmaxLogitsProcessor` mixes into q. The keys are the input of the model's output
embeddings (the LM head), taken by a :class:`HiddenStateTap`, both when the datastore is built and when it is
searched, so the two always see the same vectors. The search is exact (a matrix product per block of keys).
The folder's format is ``gm_graphs.datastore``'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from gm_graphs.datastore import open_datastore, write_datastore
from gm_graphs.errors import DatastoreError

_BLOCK = 1 << 24  # query × key products per block of the search (64 MB of float32 distances)


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
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, torch.nn.Module):
            raise ValueError(f"`model` must have output embeddings (an LM head) to tap, got {type(model).__name__}")
        self.remove()
        self._handle = head.register_forward_pre_hook(self._keep)
        return self

    def _keep(self, module: torch.nn.Module, args: tuple) -> None:
        self.states = args[0].detach()

    @property
    def last(self) -> torch.Tensor:
        """(B, d): each row's state at its last position."""
        if self.states is None:
            raise RuntimeError("the tap has seen no forward call yet: run the model (generate) before the processor")
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
    """Keys (N, d) and values (N,) in memory (float32 keys on ``device``), searched exactly.

    Args:
        keys (``np.ndarray`` or ``torch.Tensor`` (N, d)): finite keys.
        values (``np.ndarray`` or ``torch.Tensor`` (N,)): the token that followed each key, in [0, ``vocab_size``).
        vocab_size (``int``): the tokenizer's vocabulary size.
        device (``str`` or ``torch.device``, defaults to ``"cpu"``): where the keys live and the search runs.
        meta (``dict``, defaults to ``{}``): what the folder records (model, tokenizer, positions, documents).

    Example::

        >>> store = Datastore(np.array([[0.0, 0.0], [1.0, 0.0], [5.0, 5.0]]), np.array([2, 1, 0]), vocab_size=3)
        >>> d, tokens = store.neighbours(torch.tensor([[0.9, 0.0]]), k=2)
        >>> tokens.tolist(), [round(v, 2) for v in d[0].tolist()]
        ([[1, 2]], [0.01, 0.81])
    """

    def __init__(self, keys: Any, values: Any, vocab_size: int, device: str | torch.device = "cpu",
                 meta: dict | None = None):
        keys = torch.as_tensor(np.asarray(keys, dtype=np.float32) if not torch.is_tensor(keys) else keys,
                               dtype=torch.float32, device=device)
        values = torch.as_tensor(np.asarray(values, dtype=np.int64) if not torch.is_tensor(values) else values,
                                 dtype=torch.int64, device=device)
        if keys.dim() != 2 or values.shape != (keys.shape[0],) or keys.shape[0] == 0:
            raise DatastoreError(f"keys must be (N, d) and values (N,) with N >= 1, got {tuple(keys.shape)} and "
                                 f"{tuple(values.shape)}")
        if not bool(torch.isfinite(keys).all()):
            raise DatastoreError("keys must be finite")
        if int(values.min()) < 0 or int(values.max()) >= vocab_size:
            raise DatastoreError(f"values must be token ids in [0, {vocab_size})")
        self.keys, self.values, self.vocab_size = keys, values, int(vocab_size)
        self.norms = (keys * keys).sum(1)
        self.meta = dict(meta or {})

    @property
    def dim(self) -> int:
        return self.keys.shape[1]

    def __len__(self) -> int:
        return self.keys.shape[0]

    def neighbours(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` nearest keys of each row of ``hidden`` (B, d): squared L2 distances (B, k), ascending, and
        their values (B, k), on the datastore's device."""
        if not torch.is_tensor(hidden) or hidden.dim() != 2 or hidden.shape[1] != self.dim:
            raise ValueError(f"hidden states must be (B, {self.dim}) (the datastore's model), got "
                             f"{tuple(getattr(hidden, 'shape', ()))}; build the datastore with this model")
        h = hidden.detach().to(self.keys.device, torch.float32)
        k = min(int(k), len(self))
        block = max(k, _BLOCK // max(h.shape[0], 1))
        best_d = best_i = None
        for lo in range(0, len(self), block):
            d = torch.addmm(self.norms[lo:lo + block], h, self.keys[lo:lo + block].T, alpha=-2.0)
            dv, di = torch.topk(d, min(k, d.shape[1]), dim=1, largest=False)
            di = di + lo
            if best_d is not None:
                dv, j = torch.topk(torch.cat([best_d, dv], 1), k, dim=1, largest=False)
                di = torch.cat([best_i, di], 1).gather(1, j)
            best_d, best_i = dv, di
        order = torch.argsort(best_d, dim=1, stable=True)
        dist = (best_d.gather(1, order) + (h * h).sum(1, keepdim=True)).clamp_min(0.0)
        return dist, self.values[best_i.gather(1, order)]

    def distribution(self, hidden: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """p_knn of each row as (tokens (B, k), weights (B, k)) float64 weights summing to 1 per row (a token may
        appear more than once: its weights add up)."""
        dist, tokens = self.neighbours(hidden, k)
        return tokens, torch.softmax(-dist.double() / temperature, dim=1)


def load_datastore(path: str | os.PathLike, device: str | torch.device = "cpu", verify: bool = True) -> Datastore:
    """The datastore folder at ``path`` (checked by ``gm_graphs.datastore.open_datastore``), its keys on ``device``.

    Raises:
        DatastoreError: the folder is not a sound datastore; the message says what is wrong and how to fix it.
    """
    arrays = open_datastore(path, verify=verify)
    return Datastore(arrays.keys, arrays.values, arrays.meta["vocab_size"], device=device, meta=arrays.meta)


def build_datastore(model: Any, tokenizer: Any, texts: Sequence[str], path: str | os.PathLike, *,
                    positions: int = 64, batch_docs: int = 16, model_name: str = "", overwrite: bool = False,
                    progress: bool = True) -> Datastore:
    """Run ``model`` over the first ``positions + 1`` tokens of each text and write the datastore at ``path``.

    Each document gives ``positions`` keys at most: the LM head's input after tokens 1…t and the token t + 1.
    Only the first positions are kept because the decoder is asked most where the context is short, and a key
    costs one forward position (on 2 CPU cores ~700 positions/s for SmolLM2-135M).

    Args:
        model: a causal LM with output embeddings; tokenizer: its tokenizer (``vocab_size`` ids).
        texts (sequence of ``str``): the documents (a corpus' training split).
        path (``str`` or ``os.PathLike``): the folder to write (atomically; see ``gm_graphs.datastore``).
        positions (``int``, defaults to 64): the keys kept per document, ≥ 1.
        batch_docs (``int``, defaults to 16): documents per forward call.
        model_name (``str``, defaults to ``""``): recorded in the folder.
        overwrite (``bool``, defaults to ``False``): replace a datastore graphmax wrote at ``path``.
        progress (``bool``, defaults to ``True``): a progress bar.

    Returns:
        ``Datastore``: the one written, loaded back (checked).
    """
    if not (isinstance(positions, int) and positions >= 1 and isinstance(batch_docs, int) and batch_docs >= 1):
        raise ValueError(f"positions and batch_docs must be ints >= 1, got {positions!r} and {batch_docs!r}")
    vocab = len(tokenizer)
    encoded = [e for e in (tokenizer(t, add_special_tokens=False)["input_ids"][:positions + 1] for t in texts)
               if len(e) >= 2]
    dim = model.get_output_embeddings().in_features

    def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with HiddenStateTap(model) as tap, torch.no_grad():
            for lo in tqdm(range(0, len(encoded), batch_docs), desc="datastore", disable=not progress):
                batch = encoded[lo:lo + batch_docs]
                width = max(len(e) for e in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for j, e in enumerate(batch):  # right padding: the real positions are those of the text alone
                    ids[j, :len(e)] = torch.tensor(e)
                    mask[j, :len(e)] = 1
                model(input_ids=ids, attention_mask=mask)
                states = tap.states.float()
                keys = torch.cat([states[j, :len(e) - 1] for j, e in enumerate(batch)])
                values = np.concatenate([np.asarray(e[1:], dtype=np.int64) for e in batch])
                yield keys.numpy(), values

    write_datastore(path, chunks(), dim=dim, vocab_size=vocab, model=model_name,
                    tokenizer=getattr(tokenizer, "name_or_path", ""), positions=positions, documents=len(encoded),
                    overwrite=overwrite)
    return load_datastore(Path(path))
