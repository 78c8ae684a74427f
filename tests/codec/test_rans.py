import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    models = [
        rans.Categorical.from_counts(np.bincount(sym[:8].ravel(), minlength=16)),
        rans.Categorical.from_counts(np.bincount(sym[8:].ravel(), minlength=16)),
    ]
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

    def decodes_or_refuses(blob):
        """CorruptChunk, or symbols of the shape the blob's header states, inside the alphabet."""
        try:
            out = rans.decode(blob, [m])
        except CorruptChunk:
            return
        s_, n_ = np.frombuffer(blob[4:12], dtype="<u4")
        assert out.shape == (s_, n_) and (out.size == 0 or int(out.max()) < 4)

    for blob in (junk, bytes(good[: pos % len(good)]), bytes(good[:13]) + junk):
        decodes_or_refuses(blob)
    good[pos % len(good)] ^= 0x41
    decodes_or_refuses(bytes(good))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.integers(8, 14), st.integers(0, 3))
def test_interleaved_roundtrip_exact(data, prec, ntab):
    sym, a = data
    if a > (1 << prec):
        prec = 14
    rng = np.random.default_rng(int(sym.sum()) + ntab)
    models = []
    for _k in range(ntab + 1):
        counts = np.bincount(sym.ravel().astype(np.int64), minlength=a) + rng.integers(0, 3, a) + (np.arange(a) == 0)
        models.append(rans.Categorical.from_counts(counts, prec))
    tables = rans.Tables.build(models)
    col = np.ascontiguousarray(sym.T)  # token-major (n, S)
    idx = rng.integers(0, ntab + 1, col.shape[1])
    words = rans.encode_interleaved(col, idx, tables)
    assert np.array_equal(rans.decode_interleaved(words, col.shape[0], idx, tables), col)
    if col.size:  # one stream, at most LANES states of overhead
        assert words.size <= 2 * min(rans.LANES, col.shape[1]) + col.size


def test_interleaved_size_near_entropy():
    rng = np.random.default_rng(3)
    sym = (rng.geometric(0.3, size=(256, 192)) % 16).astype(np.uint8)
    m = rans.Categorical.from_counts(np.bincount(sym.ravel(), minlength=16))
    words = rans.encode_interleaved(sym, np.zeros(192, dtype=np.int64), rans.Tables.build([m]))
    assert words.size * 16 < sym.size * m.entropy_bits() * 1.005 + 16 * 2 * rans.LANES + 32


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**9), st.binary(min_size=1, max_size=6), st.integers(-3, 3))
def test_interleaved_hostile_words(pos, junk, dlen):
    m = rans.Categorical.from_counts(np.array([50, 30, 10, 5, 1, 1]), 12)
    t = rans.Tables.build([m])
    sym = np.random.default_rng(0).integers(0, 6, size=(40, 20)).astype(np.uint8)
    w = bytearray(rans.encode_interleaved(sym, np.zeros(20, dtype=np.int64), t).tobytes())
    p = pos % len(w)
    w[p : p + len(junk)] = junk
    w = w[: max(0, len(w) + 2 * dlen)] if dlen < 0 else w + bytes(2 * dlen)
    words = np.frombuffer(bytes(w[: len(w) // 2 * 2]), dtype=np.uint16)
    try:
        out = rans.decode_interleaved(words, 40, np.zeros(20, dtype=np.int64), t)
    except CorruptChunk:
        return
    assert out.shape == (40, 20) and int(out.max()) < 6  # no checksum here: a decode is one of the alphabet's blocks
    if words.tobytes() == rans.encode_interleaved(sym, np.zeros(20, dtype=np.int64), t).tobytes():
        assert np.array_equal(out, sym)


@pytest.mark.parametrize("S", [1, 7, 15, 16, 17, 33, 192])
def test_interleaved_unrolled_lanes_every_width(S):
    """The unrolled decoder handles whole groups of 16 lanes and every remainder width."""
    rng = np.random.default_rng(S)
    tables = rans.Tables.build([rans.Categorical.from_counts(rng.integers(1, 50, 40), 12) for _ in range(3)])
    assert tables.packed is not None  # the unrolled fast path
    sym = rng.integers(0, 40, size=(37, S)).astype(np.uint8)
    idx = rng.integers(0, 3, S)
    words = rans.encode_interleaved(sym, idx, tables)
    assert np.array_equal(rans.decode_interleaved(words, 37, idx, tables), sym)
    with pytest.raises(CorruptChunk):
        rans.decode_interleaved(words[:-1], 37, idx, tables)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 10**6))
def test_interleaved_row_shift_round_trip(n, S, seed):
    """Symbol (t, c) coded with model ``table_index[c] + row_shift[t]``, on both decoders."""
    rng = np.random.default_rng(seed)
    models = [rans.Categorical.from_counts(rng.integers(1, 30, 20), 12) for _ in range(6)]
    wide = [rans.Categorical.from_counts(rng.integers(1, 30, 300), 12) for _ in range(6)]  # the generic decoder
    for tables, a in ((rans.Tables.build(models), 20), (rans.Tables.build(wide), 300)):
        sym = rng.integers(0, a, size=(n, S)).astype(tables.symbol_dtype)
        idx = rng.integers(2, 4, S)
        shift = rng.integers(-2, 3, n)
        words = rans.encode_interleaved(sym, idx, tables, row_shift=shift)
        assert np.array_equal(rans.decode_interleaved(words, n, idx, tables, row_shift=shift), sym)
        with pytest.raises(CorruptChunk):  # a shift that leaves the tables
            rans.decode_interleaved(words, n, idx, tables, row_shift=shift + 10)


def _generator():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("gen_rans_lanes", root / "tools" / "gen_rans_lanes.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return root, gen


def test_generated_lanes_module_is_current():
    import subprocess
    import sys

    root, _ = _generator()
    r = subprocess.run(
        [sys.executable, str(root / "tools" / "gen_rans_lanes.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_generator_check_mode_reports_stale_and_never_writes(tmp_path, monkeypatch):
    _, gen = _generator()
    target = tmp_path / "_lanes.py"
    monkeypatch.setattr(gen, "TARGET", target)
    target.write_text("stale")
    assert gen.main(["--check"]) == 1
    assert target.read_text() == "stale"
    assert gen.main([]) == 0 and target.read_text() == gen.source()
    mtime = target.stat().st_mtime_ns
    assert gen.main([]) == 0 and target.stat().st_mtime_ns == mtime  # unchanged text: not rewritten
