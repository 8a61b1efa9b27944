"""The CPU kernel of a context-aware decoding step: every row's reference q, built from the graph's sparse
structure, then ``lambert.solve_batch``, in one numba call.

The reference of one row (``context.ContextReference`` gives the formulas) is
α·u plus a few sparse pieces: the bigram row of the previous token (its counts,
discounted under Kneser–Ney), the successors of each n-gram context the corpus
saw (found by walking the context down the n-gram trie), and, for orders
k ≥ 2, the rows of Ãᵏ, which the caller computes and passes as ``extra``
pieces. An n-gram context that is found discounts everything below it, so the
kernel walks the tables from the highest order down, carrying the factor
D·m/T that the lower orders get, and adds the pieces once α is known.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from gm_graphs.count.ngram_trie import count_at, find_context, ptr_at
from gm_graphs.store.kernel_cache import ensure_cache_dir

from .lambert import BINS, CHUNK, FINE, LOCKSTEP, ROWS, STATE, solve_batch, solve_row
from .vector_math import LOOP, jit

ensure_cache_dir()  # before the cached kernels below are defined


@jit()
def count_stats(indptr, indices, data, n):
    """(row_counts, successors, predecessors, column_counts) of a CSR count matrix, int64, in one pass over it."""
    rows = np.zeros(n, dtype=np.int64)
    successors = np.zeros(n, dtype=np.int64)
    predecessors = np.zeros(n, dtype=np.int64)
    columns = np.zeros(n, dtype=np.int64)
    for i in range(n):
        for p in range(indptr[i], indptr[i + 1]):
            c = np.int64(data[p])
            j = indices[p]
            rows[i] += c
            columns[j] += c
            if c > 0:
                successors[i] += 1
                predecessors[j] += 1
    return rows, successors, predecessors, columns


@jit()
def _coefficients(ctx, beta1, row_counts, successors, tables, kneser_ney, discount, kappa, extra_alpha, extra_ptr,
                  extra_idx, extra_val):
    """Each row's reference as α·u + ``below``·(the bigram row of ``prev``, less ``discount`` under Kneser–Ney)
    + sparse pieces: returns (α, below, prev, piece_ptr, piece_idx, piece_val), the pieces being each found
    n-gram context's discounted successors and the ``extra`` orders k ≥ 2 (already weighted)."""
    rows, length = ctx.shape
    n = row_counts.size
    chains, orders = tables
    alpha = extra_alpha.copy()
    below = np.zeros(rows)
    prev = np.zeros(rows, dtype=np.int64)
    found = np.zeros((rows, orders.size, 2), dtype=np.int64)  # each table's entries after the context (lo, hi)
    scales = np.zeros((rows, orders.size))
    size = extra_idx.size
    for b in range(rows):
        if not (beta1[b] > 0.0 and length >= 1):
            continue
        factor = beta1[b]  # what the orders below the current table get
        for j in range(orders.size - 1, -1, -1):
            order = orders[j]
            if order == 0 or length < order - 1:
                continue
            node = find_context(chains[j], ctx[b], length - (order - 1), order - 1, n)
            if node < 0:
                continue
            level = chains[j][order - 2]
            lo, hi = ptr_at(level, node), ptr_at(level, node + 1)
            if hi == lo:  # an (n−1)-gram only ever at a document's end
                continue
            total = 0.0
            for p in range(lo, hi):
                total += count_at(level, p)
            found[b, j, 0], found[b, j, 1] = lo, hi
            scales[b, j] = factor / total
            size += hi - lo
            factor *= discount * (hi - lo) / total
        v = ctx[b, length - 1]
        c = row_counts[v] if 0 <= v < n else 0.0
        if c == 0.0:  # a context the corpus never continued: the unigram
            alpha[b] += factor
        elif kneser_ney:
            alpha[b] += factor * discount * successors[v] / c
            below[b] = factor / c
            prev[b] = v
        else:  # Dirichlet: (c·Ã[v] + κ·u)/(c + κ), and c·Ã[v] is the row of counts
            alpha[b] += factor * kappa / (c + kappa)
            below[b] = factor / (c + kappa)
            prev[b] = v
    piece_ptr = np.zeros(rows + 1, dtype=np.int64)
    piece_idx = np.empty(size, dtype=np.int32)
    piece_val = np.empty(size)
    m = 0
    for b in range(rows):
        for j in range(orders.size):
            if found[b, j, 1] > found[b, j, 0]:
                level = chains[j][orders[j] - 2]
                for p in range(found[b, j, 0], found[b, j, 1]):
                    piece_idx[m] = level[4][p]
                    piece_val[m] = scales[b, j] * max(count_at(level, p) - discount, 0.0)
                    m += 1
        for p in range(extra_ptr[b], extra_ptr[b + 1]):
            piece_idx[m] = extra_idx[p]
            piece_val[m] = extra_val[p]
            m += 1
        piece_ptr[b + 1] = m
    return alpha, below, prev, piece_ptr, piece_idx, piece_val


@jit(fastmath=LOOP)
def _fill_row(alpha, below, prev, shift, indptr, indices, counts, unigram, log_unigram, piece_idx, piece_val, q, logq):
    # q = α·u + below·max(A[prev] − shift, 0) + the pieces, zeros past the graph; log q = log α + log u except
    # where something landed (a log each)
    n = unigram.size
    log_alpha = math.log(alpha) if alpha > 0.0 else -np.inf
    for i in range(n):
        q[i] = alpha * unigram[i]
        logq[i] = log_alpha + log_unigram[i]
    for i in range(n, q.size):
        q[i] = 0.0
        logq[i] = -np.inf
    if below > 0.0:
        for p in range(indptr[prev], indptr[prev + 1]):
            q[indices[p]] += below * max(counts[p] - shift, 0.0)
        for p in range(indptr[prev], indptr[prev + 1]):
            logq[indices[p]] = math.log(q[indices[p]])
    for p in range(piece_idx.size):
        q[piece_idx[p]] += piece_val[p]
    for p in range(piece_idx.size):
        logq[piece_idx[p]] = math.log(q[piece_idx[p]])


@jit(parallel=True)
def _fill_rows(alpha, below, prev, shift, indptr, indices, counts, unigram, log_unigram, piece_ptr, piece_idx,
               piece_val, q, logq):
    for b in numba.prange(q.shape[0]):
        lo, hi = piece_ptr[b], piece_ptr[b + 1]
        _fill_row(alpha[b], below[b], prev[b], shift, indptr, indices, counts, unigram, log_unigram, piece_idx[lo:hi],
                  piece_val[lo:hi], q[b], logq[b])


@jit()
def reference_rows(ctx, beta1, indptr, indices, counts, row_counts, successors, unigram, log_unigram, tables,
                   kneser_ney, discount, kappa, extra_alpha, extra_ptr, extra_idx, extra_val, q, logq):
    """Fill ``q`` (B, V ≥ N) with the reference after each row of ``ctx`` (B, L; its last tokens, oldest first),
    zeros past the graph, and ``logq`` with its logs.

    ``beta1`` (B,) is each row's order-1 weight β₁/Σβ (0: order 1 left out); a token −1 in ``ctx`` is none (before
    the row's start); ``tables`` is (chains, orders): per n-gram table
    by ascending order n (n = 0: an empty one, skipped), the kernel views of the trie's levels 2 … above it;
    ``extra_alpha`` (B,) and the CSR ``extra_ptr``/``extra_idx``/``extra_val`` the orders
    k ≥ 2, already weighted: their unigram coefficient and sparse part. The lookups
    run first, serially (binary searches); the rows are then filled in parallel.
    """
    alpha, below, prev, piece_ptr, piece_idx, piece_val = _coefficients(
        ctx, beta1, row_counts, successors, tables, kneser_ney, discount, kappa, extra_alpha, extra_ptr, extra_idx,
        extra_val)
    _fill_rows(alpha, below, prev, discount if kneser_ney else 0.0, indptr, indices, counts, unigram, log_unigram,
               piece_ptr, piece_idx, piece_val, q, logq)


@jit()
def _decode_row(b, kind, z, alpha, below, prev, shift, indptr, indices, counts, unigram, log_unigram, piece_ptr,
                piece_idx, piece_val, lam, share, max_iter, table, q, logq, base, kept, out, state, part, hist):
    # row b's reference, then its solve, by one thread: (status, ν steps, gap)
    lo, hi = piece_ptr[b], piece_ptr[b + 1]
    _fill_row(alpha[b], below[b], prev[b], shift, indptr, indices, counts, unigram, log_unigram, piece_idx[lo:hi],
              piece_val[lo:hi], q[b], logq[b])
    return solve_row(kind, z[b], q[b], logq[b], lam[b], share, max_iter, table, out[b], base[b], kept[b],
                     state[b], part[b], hist[b])


@jit(parallel=True)
def _decode_rows(kind, z, alpha, below, prev, shift, indptr, indices, counts, unigram, log_unigram, piece_ptr,
                 piece_idx, piece_val, lam, share, max_iter, table, q, logq, base, kept, out, state, part, hist,
                 status, iters, gaps):
    # rows in parallel, each built and solved by one thread: one parallel region for the step
    for b in numba.prange(z.shape[0]):
        status[b], iters[b], gaps[b] = _decode_row(b, kind, z, alpha, below, prev, shift, indptr, indices, counts,
                                                   unigram, log_unigram, piece_ptr, piece_idx, piece_val, lam, share,
                                                   max_iter, table, q, logq, base, kept, out, state, part, hist)


@jit()
def decode_step(kind, z, ctx, beta1, indptr, indices, counts, row_counts, successors, unigram, log_unigram, tables,
                kneser_ney, discount, kappa, extra_alpha, extra_ptr, extra_idx, extra_val, lam, share, max_iter, table,
                work, out, iters, gaps, mode):
    """One decoding step: the reference rows into ``work[0]`` (q) and ``work[1]`` (log q) (:func:`reference_rows`),
    then the solve (``lambert.solve_batch``, scratch ``work[2:]``) into ``out``, ``iters`` and ``gaps``;
    returns its status. ``work`` is (4, B, V), the caller's. ``mode`` is ``lambert.schedule``'s: with
    ``ROWS`` or ``SERIAL`` each row is built and solved by one thread, rows in parallel (one parallel region) or
    one after another; with ``LOCKSTEP`` the rows are filled, then every pass of the solve spreads over all
    rows' chunks."""
    q, logq = work[0], work[1]
    alpha, below, prev, piece_ptr, piece_idx, piece_val = _coefficients(
        ctx, beta1, row_counts, successors, tables, kneser_ney, discount, kappa, extra_alpha, extra_ptr, extra_idx,
        extra_val)
    shift = discount if kneser_ney else 0.0
    if mode == LOCKSTEP:
        _fill_rows(alpha, below, prev, shift, indptr, indices, counts, unigram, log_unigram, piece_ptr, piece_idx,
                   piece_val, q, logq)
        return solve_batch(kind, z, q, logq, lam, share, max_iter, table, work[2:], out, iters, gaps, mode)
    rows, width = z.shape
    status = np.zeros(rows, dtype=np.int64)
    state = np.empty((rows, STATE))
    part = np.empty((rows, (width + CHUNK - 1) // CHUNK, 6))
    hist = np.empty((rows, BINS, 4))
    if mode == ROWS:
        _decode_rows(kind, z, alpha, below, prev, shift, indptr, indices, counts, unigram, log_unigram, piece_ptr,
                     piece_idx, piece_val, lam, share, max_iter, table, q, logq, work[2], work[3], out, state, part,
                     hist, status, iters, gaps)
    else:
        for b in range(rows):
            status[b], iters[b], gaps[b] = _decode_row(b, kind, z, alpha, below, prev, shift, indptr, indices,
                                                       counts, unigram, log_unigram, piece_ptr, piece_idx, piece_val,
                                                       lam, share, max_iter, table, q, logq, work[2], work[3], out,
                                                       state, part, hist)
    for b in range(rows):
        if status[b] != FINE:
            return status[b]
    return FINE
