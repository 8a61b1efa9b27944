"""gm_solver.vector_math: the kernels' own exp and log against the C library's."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gm_solver.vector_math import exp, jit, log


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
