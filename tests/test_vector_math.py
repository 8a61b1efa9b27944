"""gm_solver.backends.numba.vector_math: the kernels' own exp and log against the C library's, their maximum against
numpy's."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gm_solver.backends.numba.vector_math import exp, jit, log, maximum


@jit()
def _logs_and_exps(v, w, logs, exps):
    for i in range(v.size):
        logs[i] = log(v[i])
        exps[i] = exp(w[i])


@given(seed=st.integers(0, 10_000))
def test_the_vectorizable_log_and_exp_are_the_c_librarys_to_two_ulp(seed):
    # the kernels' own log and exp against libm: log over every binade, subnormals, 0 and the edges of its
    # reduction; exp from the smallest normal result to overflow, and below (0)
    rng = np.random.default_rng(seed)
    v = np.concatenate([np.exp(rng.uniform(-745, 709, 2_000)), [0.0, 5e-324, 1e-310, 2.2250738585072014e-308, 1.0,
                        0.5, 2.0, math.sqrt(2), np.nextafter(math.sqrt(2), 2), np.nextafter(1.0, 0), 1.7e308]])
    w = np.concatenate([rng.uniform(-708, 709, v.size - 3), [-np.inf, -800.0, 0.0]])
    logs, exps = np.empty_like(v), np.empty_like(w)
    _logs_and_exps(v, w, logs, exps)
    assert logs[v == 0].tolist() == [-math.inf] and exps[-3:].tolist() == [0.0, 0.0, 1.0]
    exact = np.log(v[v > 0])
    assert (np.abs(logs[v > 0] - exact) <= 2 * np.spacing(np.abs(exact))).all()
    exact = np.exp(w[:-3])
    assert (np.abs(exps[:-3] - exact) <= 2 * np.spacing(exact)).all()


@jit()
def _maximum(v):
    return maximum(v)


@given(size=st.integers(0, 40), seed=st.integers(0, 10_000), masked=st.floats(0.0, 1.0))
def test_the_eight_running_maxima_give_numpys_maximum(size, seed, masked):
    # every length around the eight lanes, the largest entry in any lane or the tail, −inf entries (masked tokens)
    rng = np.random.default_rng(seed)
    v = rng.normal(size=size) * 10.0 ** rng.integers(-3, 4)
    v[rng.random(size) < masked] = -np.inf
    assert _maximum(v) == (v.max() if size else -np.inf)
    assert _maximum(v[1::2]) == (v[1::2].max() if v[1::2].size else -np.inf)  # a strided view
