"""The quantizer's table machinery against its definitions: classes, the Laplace prior, histograms, tables.

A wrong class or table still round-trips (encoder and decoder share them), so only these
definitions catch it before it costs bits."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from cachegen.codec import quant


def test_classes_are_half_octaves_of_std_over_step():
    step = np.full(9, 0.5, dtype=np.float32)
    ratio = np.array([1.0, 2.0, math.sqrt(2), 0.5, 2**-5, 2**-6, 2**6.5, 2**7, 2**1.2], dtype=np.float64)
    got = quant.classes_for((ratio * 0.5).astype(np.float32), step)
    # round(2 log2(ratio)) + 10, clipped to the 24 tables
    assert got.tolist() == [10, 12, 11, 8, 0, 0, 23, 23, 12]
    assert got.dtype == np.int64
    assert quant.classes_for(np.zeros(2, np.float32), np.ones(2, np.float32)).tolist() == [0, 0]  # a dead component


def _laplace_mass(q: int, ratio: float) -> float:
    """P(round(X) = q) for a Laplace X of standard deviation ``ratio`` (scale ratio / sqrt 2)."""
    b = ratio / math.sqrt(2)
    cdf = lambda x: 0.5 * math.exp(x / b) if x < 0 else 1 - 0.5 * math.exp(-x / b)
    return cdf(q + 0.5) - cdf(q - 0.5)


@pytest.mark.parametrize("ratio", [0.3, 1.0, 4.0, 40.0])
def test_laplace_prior_is_the_discretized_laplace_with_its_tails_cut(ratio):
    p = quant.laplace_prior(ratio)
    assert p.shape == (quant.ALPHABET,)
    for s in range(2 * quant.CENTER + 1):
        want = _laplace_mass(s - quant.CENTER, ratio)
        assert p[s] == pytest.approx(want if want >= 2.0**-13 else 0.0, rel=1e-9, abs=1e-15), s
    assert p[2 * quant.CENTER + 1 :].sum() == 0  # no mass on the escape symbol
    assert p[quant.CENTER] == p.max() and np.allclose(p[:255], p[:255][::-1], rtol=1e-9, atol=0)  # symmetric


def test_laplace_prior_of_a_vanishing_spread_is_a_spike():
    p = quant.laplace_prior(0.0)  # floored at 1e-3 steps: all mass on zero
    assert p[quant.CENTER] == pytest.approx(1.0) and p.sum() == pytest.approx(1.0)


def test_histogram_counts_each_symbol_in_its_shifted_clipped_class():
    rng = np.random.default_rng(0)
    sym = rng.integers(0, quant.ALPHABET, size=(7, 5)).astype(np.uint8)
    cls = np.array([0, 3, 22, 23, 10])
    shift = np.array([0, -1, 1, 2, -3, 0, 1])
    counts = np.full((quant.N_CLASSES, quant.ALPHABET), 5, dtype=np.int64)
    quant.histogram_classes(sym, cls, counts, shift)
    want = np.full((quant.N_CLASSES, quant.ALPHABET), 5, dtype=np.int64)
    for t in range(7):
        for c in range(5):
            want[min(max(cls[c] + shift[t], 0), quant.N_CLASSES - 1), sym[t, c]] += 1
    assert np.array_equal(counts, want)
    plain = np.zeros_like(counts)
    quant.histogram_classes(sym, cls, plain)  # no shift
    assert plain.sum() == sym.size and all(plain[cls[c], sym[0, c]] >= 1 for c in range(5))
    assert plain[cls[1]].sum() == 7


def _smoothed(counts: np.ndarray, k: int, weight: float) -> np.ndarray:
    """The documented smoothing of class ``k``: its counts plus ``weight * total + 64`` pseudo-counts
    spread as the class's Laplace prior (std ``2^((k - 10) / 2)`` steps), escape at least ~0, as
    shares of 4096."""
    c = counts[k].astype(np.float64).copy()
    prior = quant.laplace_prior(2.0 ** ((k - quant.CLASS_OFFSET) / 2))
    c += prior / prior.sum() * (weight * c.sum() + 64.0)
    return c / c.sum() * 4096


def test_tables_follow_the_counts_smoothed_by_the_prior():
    counts = np.zeros((quant.N_CLASSES, quant.ALPHABET))
    k = 12  # std = 2 steps
    counts[k, quant.CENTER - 3 : quant.CENTER + 4] = [1, 10, 100, 1000, 100, 10, 1]
    counts[3, quant.ESCAPE] = 50  # a class of escapes only
    for weight in (0.002, 1.0):
        f = quant.tables_from_counts(counts, 12, prior_weight=weight)
        assert f.shape == (quant.N_CLASSES, quant.ALPHABET) and f.dtype == np.int64
        assert (f.sum(axis=1) == 4096).all() and (f[:, quant.ESCAPE] >= 1).all()  # an escape is always codable
        for j in (k, 3, 4, 10, 20):  # counted classes, and classes that are their prior alone
            want = _smoothed(counts, j, weight)
            # within rounding, and the +1s that keep every supported symbol codable (taken from the top)
            assert (np.abs(f[j] - want) <= 3 + 0.05 * want).all(), (weight, j)
            assert ((f[j] > 0) == (want > 0) | (np.arange(quant.ALPHABET) == quant.ESCAPE)).all()
    strong = quant.tables_from_counts(counts, 12, prior_weight=1.0)
    weak = quant.tables_from_counts(counts, 12, prior_weight=0.002)
    assert strong[k, quant.CENTER] < weak[k, quant.CENTER]  # more weight on the prior pulls a class towards it


def test_laplace_prior_computes_without_overflow():
    """Both halves of the CDF take exponents <= 0 only (``np.where`` evaluates both): no inf on the way,
    however narrow the spread."""
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        for ratio in (0.0, 1e-3, 0.01, 0.3, 4.0, 40.0):
            assert np.isfinite(quant.laplace_prior(ratio)).all(), ratio


def _table_row(counts_k: np.ndarray, k: int, weight: float = 0.002) -> np.ndarray:
    """Class ``k``'s table as documented, in float64 in the implementation's order: the counts plus
    ``weight * total + 64`` pseudo-counts shaped as the class's prior, the escape's count at least
    1e-9 of the total (and at least 1e-9), quantized to 4096."""
    from cachegen.codec.rans import quantize_counts

    c = counts_k.astype(np.float64).copy()
    total = c.sum()
    prior = quant.laplace_prior(2.0 ** ((k - quant.CLASS_OFFSET) / 2.0))
    c += prior / prior.sum() * (weight * total + 64.0)
    c[quant.ESCAPE] = max(c[quant.ESCAPE], 1e-9 * max(total, 1.0))
    return quantize_counts(c, 12)


def test_tables_are_exactly_the_documented_smoothing():
    rng = np.random.default_rng(5)
    counts = np.zeros((quant.N_CLASSES, quant.ALPHABET))
    for k in range(quant.N_CLASSES):
        if k % 3:
            counts[k, rng.integers(0, quant.ESCAPE, 12)] = rng.integers(1, 400, 12)
    counts[7, quant.ESCAPE] = 30
    counts[23, quant.CENTER - 100 : quant.CENTER + 100] = rng.integers(0, 50, 200)  # a wide class: tails cut
    for weight in (0.002, 0.5):
        f = quant.tables_from_counts(counts, 12, prior_weight=weight)
        for k in range(quant.N_CLASSES):
            assert np.array_equal(f[k], _table_row(counts[k], k, weight)), (weight, k)
    # the defaults: 12 bits, prior weight 0.002 (what calibration uses)
    default = quant.tables_from_counts(counts)
    assert (default.sum(axis=1) == 4096).all()
    assert np.array_equal(default, quant.tables_from_counts(counts, 12, prior_weight=0.002))


def test_escape_floor_is_exact_on_a_rounding_edge():
    """The escape's pseudo-count (1e-9 of the class total, at least 1e-9) is part of the total every
    share is taken of, so on another symbol's rounding edge it decides that symbol's frequency: the
    tables follow the documented formula exactly there too (totals between 1 and 2 counts)."""
    k, j = quant.CLASS_OFFSET, quant.CENTER + 3

    def row(x: float) -> np.ndarray:
        r = np.zeros(quant.ALPHABET)
        r[j] = x
        return r

    def fj(x: float) -> int:
        return int(_table_row(row(x), k)[j])

    xs = np.linspace(1.05, 1.95, 46)
    edges = []
    for a, b in itertools.pairwise(xs):
        a, b = float(a), float(b)
        if fj(a) == fj(b):
            continue
        while np.nextafter(a, b) < b:  # bisect to adjacent floats
            m = 0.5 * (a + b)
            if fj(m) == fj(a):
                a = m
            else:
                b = m
        edges.append((a, b))
        if len(edges) == 6:
            break
    assert len(edges) >= 3
    for a, b in edges:
        for x in (a, b):
            counts = np.zeros((quant.N_CLASSES, quant.ALPHABET))
            counts[k] = row(x)
            assert np.array_equal(quant.tables_from_counts(counts, 12)[k], _table_row(row(x), k)), x


@pytest.mark.parametrize(
    "shapes",
    [
        ((4, 3), (3,), (4,), (3, 3)),  # out a row short: the last row would be written past it
        ((4, 3), (3,), (4,), (4, 2)),
        ((4, 3), (2,), (4,), (4, 3)),  # a step per column missing
        ((4, 3), (3,), (3,), (4, 3)),  # a row multiplier missing
    ],
)
def test_dequantize_refuses_arrays_that_disagree_instead_of_writing_past_them(shapes):
    """The kernel runs without bounds checks: a caller's wrong slice must be an error, never a
    write outside ``out`` (which corrupts the heap and crashes later, somewhere else)."""
    sym_s, step_s, rm_s, out_s = shapes
    sym = np.full(sym_s, quant.CENTER, np.uint8)  # every value 0
    with pytest.raises(ValueError, match="disagree on their shapes"):
        quant.dequantize(
            sym,
            np.ones(step_s, np.float32),
            np.ones(rm_s, np.float32),
            np.zeros(1, np.int32),
            0,
            np.empty(out_s, np.float32),
        )
    out = np.empty((4, 3), np.float32)
    assert quant.dequantize(sym, np.ones(3, np.float32), np.ones(4, np.float32), np.zeros(1, np.int32), 0, out) == 0
    assert not out.any()
