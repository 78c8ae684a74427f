"""Scalar quantization of transformed KV values to rANS symbols, with escapes.

Why escapes: tables are profiled once per model, so a chunk may hold a value
its table never saw (a heavy tail). Such values are coded as the escape
symbol plus their exact integer, so the error bound ``|y - y_hat| <= step/2``
holds for every value and no table needs probability mass on rare symbols.

Symbols are ``q + CENTER`` for ``|q| <= CENTER`` when the stream's table gives
that symbol a nonzero frequency; anything else is ``ESCAPE``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cachegen.codec import _numba_env  # noqa: F401

ALPHABET = 256
CENTER = 127
ESCAPE = 255
N_CLASSES = 24  # tables per level: one per half-octave of std/step
CLASS_OFFSET = 10  # class = round(2*log2(std/step)) + CLASS_OFFSET
MAX_RATIO = 48.0  # per-component step is at least std/MAX_RATIO (keeps symbols inside the alphabet)
_QMAX = float(1 << 30)


def classes_for(std: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Table class of each component from its std/step ratio (half-octave buckets)."""
    r = np.maximum(std.astype(np.float64), 1e-30) / step.astype(np.float64)
    c = np.floor(2.0 * np.log2(r) + 0.5) + CLASS_OFFSET
    return np.clip(c, 0, N_CLASSES - 1).astype(np.int64)


@njit(nogil=True, cache=True)
def quantize(y, inv_step, row_inv, cls, row_shift, freq, sym, esc):
    """y (T, C) float32 -> sym (T, C) uint8; escaped integers go to ``esc``; returns the escape count.

    Value ``(t, c)`` has step ``1 / (inv_step[c] * row_inv[t])`` and table ``cls[c] + row_shift[t]``."""
    T = y.shape[0]
    C = y.shape[1]
    n = 0
    for t in range(T):
        row = y[t]
        out = sym[t]
        ri = row_inv[t]
        rs = row_shift[t]
        for c in range(C):
            v = row[c] * (inv_step[c] * ri)
            v = min(max(v, -1073741824.0), 1073741824.0)
            q = np.int64(np.floor(v + 0.5))
            s = q + 127
            if s >= 0 and s < 255 and freq[cls[c] + rs, s] > 0:
                out[c] = np.uint8(s)
            else:
                out[c] = np.uint8(255)
                esc[n] = np.int32(q)
                n += 1
    return n


@njit(nogil=True, cache=True, boundscheck=False)
def dequantize(sym, step, row_mult, esc, n_esc, out):
    """sym (T, C) uint8 -> out (T, C) float32 (value ``(t, c)`` has step ``step[c] * row_mult[t]``);
    returns escapes consumed (must equal ``n_esc``).

    ``esc`` must hold at least one element more than ``n_esc`` (a pad), so hostile
    symbols can never read outside it. Why two passes per row: the first has no branch
    and vectorizes (3x faster than one loop that branches on the escape symbol); only a
    row that holds an escape, which is rare, is scanned again for them in order."""
    T = sym.shape[0]
    C = sym.shape[1]
    if out.shape[0] != T or out.shape[1] != C or row_mult.shape[0] != T or step.shape[0] != C:
        raise ValueError("dequantize: sym, out, row_mult and step disagree on their shapes")  # no write out of bounds
    e = 0
    for t in range(T):
        srow = sym[t]
        orow = out[t]
        rm = row_mult[t]
        hit = 0
        for c in range(C):
            s = srow[c]
            hit |= s == 255
            orow[c] = np.float32(np.int32(s) - 127) * (step[c] * rm)
        if hit:
            for c in range(C):
                if srow[c] == 255:
                    orow[c] = np.float32(esc[min(e, n_esc)]) * (step[c] * rm)
                    e += 1
    return e


def laplace_prior(ratio: float) -> np.ndarray:
    """Counts of a discretized Laplace of std ``ratio`` steps over the symbol alphabet (tails cut)."""
    b = max(ratio, 1e-3) / np.sqrt(2.0)
    q = np.arange(-CENTER, CENTER + 1, dtype=np.float64)
    cdf = lambda x: np.where(x < 0, 0.5 * np.exp(np.minimum(x, 0) / b), 1 - 0.5 * np.exp(-np.maximum(x, 0) / b))
    p = cdf(q + 0.5) - cdf(q - 0.5)
    p[p < 2.0**-13] = 0.0
    out = np.zeros(ALPHABET, dtype=np.float64)
    out[: 2 * CENTER + 1] = p
    return out


def histogram_classes(
    sym: np.ndarray, cls: np.ndarray, counts: np.ndarray, row_shift: np.ndarray | None = None
) -> None:
    """Accumulate ``counts[class, symbol]`` from sym (T, C); the class of ``(t, c)`` is
    ``cls[c] + row_shift[t]`` clipped to the table range."""
    if row_shift is None:
        row_shift = np.zeros(sym.shape[0], dtype=np.int64)
    k2 = np.clip(cls[None, :] + row_shift[:, None], 0, N_CLASSES - 1)
    idx = k2.ravel() * ALPHABET + sym.ravel().astype(np.int64)
    counts += np.bincount(idx, minlength=N_CLASSES * ALPHABET).reshape(N_CLASSES, ALPHABET)


def tables_from_counts(counts: np.ndarray, precision: int = 12, prior_weight: float = 0.002) -> np.ndarray:
    """Frequencies (N_CLASSES, ALPHABET) from class histograms, smoothed by a Laplace prior, escape >= 1."""
    from cachegen.codec.rans import quantize_counts

    freqs = np.zeros((N_CLASSES, ALPHABET), dtype=np.int64)
    for k in range(N_CLASSES):
        c = counts[k].astype(np.float64).copy()
        ratio = 2.0 ** ((k - CLASS_OFFSET) / 2.0)
        total = c.sum()
        prior = laplace_prior(ratio)
        c += prior / prior.sum() * (prior_weight * total + 64.0)
        c[ESCAPE] = max(c[ESCAPE], 1e-9 * max(total, 1.0), 1e-12)
        freqs[k] = quantize_counts(c, precision)
    return freqs
