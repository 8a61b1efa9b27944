"""A left-padded ``transformers`` batch, row by row: ``generate()`` passes a logits processor ``input_ids`` alone, so
the processors that read a row's context are told each row's padding, from the batch's attention mask, in a block
around ``generate()`` (:meth:`LeftPadding.padding`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class LeftPadding:
    """What a processor that reads each row's context needs to skip the row's left padding."""

    _starts: torch.Tensor | None = None  # each row's first column, inside padding()

    @contextlib.contextmanager
    def padding(self, attention_mask: torch.Tensor) -> Iterator[LeftPadding]:
        """Decode a left-padded batch: inside the block, each row's padding (the zeros before its first token in
        ``attention_mask``) is never read as context, and λ_t counts the row's own tokens, so a row decodes as it
        does alone (the context decoders and the interpolation; the paper's read no context, and are the same
        inside). ``generate()`` passes a processor ``input_ids`` only, hence this block around it.

        Args:
            attention_mask (``torch.Tensor`` (B, T)): the batch's mask, padded on the left (``tok.padding_side =
                "left"``, as decoder-only generation needs); beams and ``num_return_sequences`` repeat its rows.

        Returns:
            A context manager yielding ``self``; one ``generate()`` at a time per processor.

        Example::

            >>> import scipy.sparse as sp, torch
            >>> from gm_solver import ContextGraphmaxLogitsProcessor
            >>> proc = ContextGraphmaxLogitsProcessor(sp.csr_matrix([[0, 5, 1], [2, 0, 3], [4, 0, 0]]), lam=2.0)
            >>> alone = proc(torch.tensor([[0]]), torch.zeros(1, 3))
            >>> with proc.padding(torch.tensor([[0, 0, 1], [1, 1, 1]])):   # row 0 is [pad, pad, 0]
            ...     batch = proc(torch.tensor([[2, 2, 0], [1, 2, 0]]), torch.zeros(2, 3))
            >>> torch.equal(batch[0], alone[0])
            True
        """
        starts = left_padding(attention_mask)
        previous, self._starts = self._starts, starts
        try:
            yield self
        finally:
            self._starts = previous

    def row_starts(self, rows: int) -> torch.Tensor | None:
        """The column of each of ``rows`` rows' first token inside :meth:`padding` (beams and returned sequences
        repeat a prompt's rows), else ``None``."""
        starts = self._starts
        if starts is None:
            return None
        if rows % starts.shape[0]:
            raise ValueError(f"input_ids has {rows} rows but the attention mask given to padding() has "
                             f"{starts.shape[0]}; pass the mask of the batch generate() decodes")
        return starts.repeat_interleave(rows // starts.shape[0])


def left_padding(attention_mask: Any) -> torch.Tensor:
    """The column of each row's first token in a left-padded ``attention_mask`` (B, T), checked: 0s then 1s."""
    mask = attention_mask
    if not (torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[0] >= 1 and not mask.is_complex()):
        raise ValueError(f"attention_mask must be a (B, T) tensor, got {type(mask).__name__} of shape "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    mask = mask.detach().cpu()
    ones = mask == 1
    if not bool((ones | (mask == 0)).all()):
        raise ValueError("attention_mask must hold 0s and 1s (the tokenizer's mask of the batch)")
    starts = (~ones).long().cumprod(1).sum(1)  # the zeros before the first 1
    tokens = ones.long().sum(1)
    if not bool(((starts + tokens == mask.shape[1]) & (tokens > 0)).all()):
        raise ValueError("attention_mask must be padded on the left (set tok.padding_side = 'left') with a token in "
                         "every row; right padding would put pad ids into the context")
    return starts
