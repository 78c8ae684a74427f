import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from cachegen.codec import rans
from cachegen.errors import CodecError, CorruptChunk


@st.composite
def streams(draw):
    a = draw(st.integers(2, 300))
    s = draw(st.integers(1, 40))
    n = draw(st.integers(0, 60))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    skew = draw(st.floats(0.01, 5))
    p = rng.dirichlet(np.full(a, skew))
    sym = rng.choice(a, size=(s, n), p=p).astype(np.uint16 if a > 256 else np.uint8)
    return sym, a


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.integers(8, 14))
def test_roundtrip_exact(data, prec):
    sym, a = data
    counts = np.bincount(sym.ravel().astype(np.int64), minlength=a) + (np.arange(a) % 3 == 0)
    if a > (1 << prec):
        prec = 14
    m = rans.Categorical.from_counts(counts, prec)
    blob = rans.encode(sym, [m])
    assert np.array_equal(rans.decode(blob, [m]), sym)


def test_several_tables_and_size_near_entropy():
    rng = np.random.default_rng(1)
    sym = np.vstack([rng.geometric(0.3, size=(8, 5000)) % 16, rng.integers(0, 16, size=(8, 5000))]).astype(np.uint8)
    models = [rans.Categorical.from_counts(np.bincount(sym[:8].ravel(), minlength=16)), rans.Categorical.from_counts(np.bincount(sym[8:].ravel(), minlength=16))]
    idx = [0] * 8 + [1] * 8
    blob = rans.encode(sym, models, idx)
    assert np.array_equal(rans.decode(blob, models, idx), sym)
    ideal = 8 * 5000 * (models[0].entropy_bits() + models[1].entropy_bits()) / 8
    assert len(blob) < ideal * 1.02 + 200


def test_zero_frequency_symbol_rejected():
    m = rans.Categorical(np.array([4096, 0]), 12)
    with pytest.raises(CodecError):
        rans.encode(np.array([[0, 1]], dtype=np.uint8), [m])


def test_quantize_counts_keeps_support():
    f = rans.quantize_counts(np.array([1e9, 1, 0, 3]), 12)
    assert f.sum() == 4096 and f[1] >= 1 and f[2] == 0 and f[3] >= 1


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 1000))
def test_hostile_blobs(junk, pos):
    m = rans.Categorical.from_counts(np.array([5, 3, 1, 1]), 12)
    sym = np.random.default_rng(0).integers(0, 4, size=(3, 50)).astype(np.uint8)
    good = bytearray(rans.encode(sym, [m]))
    for blob in (junk, bytes(good[: pos % len(good)]), bytes(good[:13]) + junk):
        try:
            rans.decode(blob, [m])
        except CorruptChunk:
            pass
    good[pos % len(good)] ^= 0x41
    try:
        rans.decode(bytes(good), [m])
    except CorruptChunk:
        pass
