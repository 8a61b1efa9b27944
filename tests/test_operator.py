"""The transition operator (gm_solver.operator): its numba and torch backends, L·x and the Gram product against dense
products, and a pruned order applied matrix-free as Ã·Ã."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gm_solver import graphmax
from gm_solver.operator import TransitionOperator

from .helpers import DTYPES, dense_l, random_graph


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_and_torch_backends_agree(dtype):
    a = random_graph(40, 0.15, 5)
    z = (torch.randn(3, 40) * 4).to(dtype)
    x_numba = graphmax(z, a, 1.0, backend="numba")
    x_torch = graphmax(z, a, 1.0, backend="torch")
    torch.testing.assert_close(x_numba, x_torch, atol=1e-6, rtol=0)
    torch.testing.assert_close(graphmax(z, torch.from_numpy(a.toarray()).to_sparse_csr(), 1.0), x_numba,
                               atol=1e-6, rtol=0)


@given(n=st.integers(1, 30), density=st.floats(0.0, 0.7), seed=st.integers(0, 10_000), batch=st.integers(1, 5),
       pad=st.integers(0, 3))
def test_residual_and_gram_equal_dense_products(n, density, seed, batch, pad):
    a = random_graph(n, density, seed)
    x = torch.softmax(torch.from_numpy(np.random.default_rng(seed).normal(size=(batch, n + pad)) * 3), -1)
    L = dense_l(a, n + pad)  # ids beyond the graph are isolated nodes
    # a solver asks for some rows only (its converged ones stay): those as from the whole batch, the others 0
    rows = torch.from_numpy(np.flatnonzero(np.random.default_rng(seed + 1).random(batch) < 0.5))
    asked = np.isin(np.arange(batch), rows.numpy())[:, None]
    for backend in ("numba", "torch"):
        op = TransitionOperator(a, backend=backend)
        lx, gram = op.residual_and_gram(x)
        np.testing.assert_allclose(lx.numpy(), x.numpy() @ L.T, atol=1e-14)
        np.testing.assert_allclose(gram.numpy(), x.numpy() @ (L.T @ L).T, atol=1e-13)
        lx_part, gram_part = op.residual_and_gram(x, rows=rows)
        np.testing.assert_allclose(lx_part.numpy(), np.where(asked, x.numpy() @ L.T, 0.0), atol=1e-14)
        np.testing.assert_allclose(gram_part.numpy(), np.where(asked, x.numpy() @ (L.T @ L).T, 0.0), atol=1e-13)


@pytest.mark.parametrize("rows", [torch.tensor([0, 3]), torch.tensor([-1]), torch.tensor([0.0]),
                                  torch.tensor([[0]]), [0]])
def test_rows_outside_the_batch_are_refused_before_a_kernel_reads_them(rows):
    x = torch.softmax(torch.randn(3, 6, dtype=torch.float64), -1)
    for backend in ("numba", "torch"):
        with pytest.raises(ValueError, match=r"rows must be a 1-D long tensor of row indices in \[0, 3\)"):
            TransitionOperator(random_graph(6, 0.5, 0), backend=backend).residual_and_gram(x, rows=rows)


@given(n=st.integers(1, 30), density=st.floats(0.0, 0.7), seed=st.integers(0, 10_000), pad=st.integers(0, 3))
def test_the_gram_diagonal_is_diag_of_l_transposed_l(n, density, seed, pad):
    # the solver's per-token step sizes come from it: for one matrix it is exact, ids beyond the graph give 1
    a = random_graph(n, density, seed)
    L = dense_l(a, n + pad)
    diag = TransitionOperator(a).gram_diagonal(n + pad, torch.float64)
    np.testing.assert_allclose(diag.numpy(), np.diag(L.T @ L), rtol=1e-12, atol=1e-12)


def test_matrix_free_order_equals_materialised_exact_order(tmp_path, csv_corpus, bpe_tokenizer):
    from gm_graphs import PruneRule, build_graph, load_graph

    path, _ = csv_corpus
    g = build_graph(path, bpe_tokenizer, path=tmp_path / "g", orders=(1, 2), mixture=2, prune=PruneRule.exact(),
                    progress=False)
    pruned = build_graph(path, bpe_tokenizer, path=tmp_path / "p", orders=(2,), prune=PruneRule(top_k=1),
                         progress=False)
    n = g.vocab_size
    z = torch.randn(2, n, dtype=torch.float64) * 3
    # solved to a gap of 1e-12, so that both are the optimum to 1e-6 (the solver's steps differ between the two: a
    # materialised M gives its exact diag(LᵀL), a chain an estimate)
    exact = graphmax(z, load_graph(g.path, order=2), 1.0, tol=1e-12)
    free = graphmax(z, load_graph(pruned.path, order=2), 1.0, tol=1e-12)  # pruned on disk → applied as Ã·Ã
    assert load_graph(pruned.path, order=2).pruned
    torch.testing.assert_close(exact, free, atol=1e-6, rtol=0)
    mix_free = graphmax(z, load_graph(pruned.path, mixture=2), 1.0, tol=1e-12)
    mix = graphmax(z, load_graph(g.path, mixture=2), 1.0, tol=1e-12)
    torch.testing.assert_close(mix, mix_free, atol=1e-6, rtol=0)
