"""What every kernel of gm_solver is built with: ``jit`` (numba's, cached, numpy's float semantics), ``LOOP`` (the
float liberties a loop over tokens may take), and ``exp`` and ``log`` written as code a loop vectorizes (the C
library's are calls it cannot)."""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from gm_graphs.store.kernel_cache import ensure_cache_dir

ensure_cache_dir()  # before the cached kernels below are defined


def jit(**options):
    """numba.njit for the kernels: cached on disk, and with numpy's float semantics (x/0 = inf, as the torch path
    gives), so the loops carry no division checks."""
    return numba.njit(cache=True, error_model="numpy", **options)


# the loops over tokens may reorder their sums and fuse multiply-adds (inf and NaN keep their meaning): the ν pass
# takes 5.5 instead of 8.7 ns per token. A given chunk is still summed the same way every time, so the results
# stay deterministic and the same whichever driver runs them.
LOOP = {"reassoc", "contract"}


@intrinsic
def _float_from_bits(typingctx, bits):
    # the float64 whose IEEE bits are the int64 ``bits``
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@jit(inline="always", fastmath=LOOP)
def exp(x):
    """e^x to within an ulp, as code a loop can vectorize (the C library's exp is a call it cannot): 0.4 instead
    of 3.4 ns per token summed. 2^k·e^r with |r| ≤ ln 2/2 (ln 2 split in two, so r is exact) and e^r by its
    Taylor polynomial to r¹³ (remainder < 2e-16); below e^−708 (no longer a normal float) it gives 0, and from
    e^710 on, inf."""
    x = min(max(x, -709.0), 710.0)
    k = math.floor(x * 1.4426950408889634 + 0.5)
    r = (x - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10
    p = 1.0 + r * (1.0 + r * (1 / 2 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (1 / 720 + r * (
        1 / 5040 + r * (1 / 40320 + r * (1 / 362880 + r * (1 / 3628800 + r * (1 / 39916800 + r * (
            1 / 479001600 + r * (1 / 6227020800)))))))))))))
    n = np.int64(k)
    return p * _float_from_bits((n + 1023) << 52) if n >= -1022 else 0.0


@intrinsic
def _bits_from_float(typingctx, x):
    # the int64 holding the IEEE bits of the float64 ``x``
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(types.float64), codegen


@jit(inline="always", fastmath=LOOP)
def log(x):
    """log x for x ≥ 0 to within an ulp, as code a loop can vectorize (as :func:`exp`). x = 2^e·m with m in
    [√½, √2) (a subnormal x scaled by 2^54 first), log m = 2 atanh u, u = (m − 1)/(m + 1), |u| < 0.172, by its
    series to u¹⁹ (remainder < 1e-17); log 0 = −inf."""
    small = x < 2.2250738585072014e-308
    bits = _bits_from_float(x * 18014398509481984.0 if small else x)
    e = (bits >> 52) - (1023 + 54 if small else 1023)
    m = _float_from_bits((bits & 0xFFFFFFFFFFFFF) | (np.int64(1023) << 52))
    high = m > 1.4142135623730951
    m = m * 0.5 if high else m
    k = np.float64(e + 1 if high else e)
    u = (m - 1.0) / (m + 1.0)
    v = u * u
    p = 2.0 * u * (1.0 + v * (1 / 3 + v * (1 / 5 + v * (1 / 7 + v * (1 / 9 + v * (1 / 11 + v * (1 / 13 + v * (
        1 / 15 + v * (1 / 17 + v * (1 / 19))))))))))
    out = k * 6.93147180369123816490e-01 + (p + k * 1.90821492927058770002e-10)
    return out if x > 0 else -np.inf


@jit(inline="always")
def maximum(v):
    """The largest entry of ``v`` (−inf when empty; ``v`` NaN-free), kept in eight running maxima: a loop with one
    waits on each comparison before the next (63 against 13 µs over 49,152 tokens)."""
    top = np.full(8, -np.inf)
    whole = v.size - v.size % 8
    for i in range(0, whole, 8):
        for k in range(8):
            top[k] = max(top[k], v[i + k])
    out = -np.inf
    for k in range(8):
        out = max(out, top[k])
    for i in range(whole, v.size):
        out = max(out, v[i])
    return out
