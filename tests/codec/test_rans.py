import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
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


def _blob_case():
    m = rans.Categorical.from_counts(np.array([5, 3, 1, 1]), 12)
    sym = np.random.default_rng(0).integers(0, 4, size=(3, 50)).astype(np.uint8)
    return m, sym, rans.encode(sym, [m])


def test_every_damaged_byte_and_every_cut_of_a_blob_is_refused():
    """Exhaustive over one blob: each bit pattern flipped at each byte, and each truncation.

    The header fields are checked against the payload, and a changed word leaves some stream
    in a state other than its initial one (or not at its end), which the decoder refuses."""
    m, sym, good = _blob_case()
    assert np.array_equal(rans.decode(good, [m]), sym)
    for pos in range(len(good)):
        for mask in (0x01, 0x41, 0x80, 0xFF):
            b = bytearray(good)
            b[pos] ^= mask
            with pytest.raises(CorruptChunk):
                rans.decode(bytes(b), [m])
    for cut in range(len(good)):
        with pytest.raises(CorruptChunk):
            rans.decode(good[:cut], [m])
    with pytest.raises(CorruptChunk):  # a trailing word more
        rans.decode(good + b"\0\0", [m])


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_junk_blobs_are_refused(junk):
    m, _sym, good = _blob_case()
    for blob in (junk, b"RANS" + junk, good[:13] + junk):
        with pytest.raises(CorruptChunk):
            rans.decode(blob, [m])


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
@example(pos=305, junk=b"/", dlen=0)  # word 152 off by 2^12: one lane still ends in its initial state
def test_interleaved_hostile_words(pos, junk, dlen):
    m = rans.Categorical.from_counts(np.array([50, 30, 10, 5, 1, 1]), 12)
    t = rans.Tables.build([m])
    sym = np.random.default_rng(0).integers(0, 6, size=(40, 20)).astype(np.uint8)
    w = bytearray(rans.encode_interleaved(sym, np.zeros(20, dtype=np.int64), t).tobytes())
    p = pos % len(w)
    w[p : p + len(junk)] = junk
    w = w[: max(0, len(w) + 2 * dlen)] if dlen < 0 else w + bytes(2 * dlen)
    words = np.frombuffer(bytes(w[: len(w) // 2 * 2]), dtype=np.uint16)
    if words.tobytes() == rans.encode_interleaved(sym, np.zeros(20, dtype=np.int64), t).tobytes():
        # the junk equalled the bytes it replaced: the original stream
        assert np.array_equal(rans.decode_interleaved(words, 40, np.zeros(20, dtype=np.int64), t), sym)
        return
    # Another stream never decodes to the original symbols: given the symbols and the end state the
    # encoder's words are the only ones. Nearly every change leaves a lane off its initial state or the
    # words not used up (CorruptChunk), but not every one: rANS carries no checksum, so a change can
    # decode to other symbols and end in the initial state. The container's CRC32 per section is what
    # refuses those (test_codec.py::test_corrupt_inputs_raise_corruptchunk).
    try:
        out = rans.decode_interleaved(words, 40, np.zeros(20, dtype=np.int64), t)
    except CorruptChunk:
        return
    assert not np.array_equal(out, sym)


def test_nearly_every_flipped_bit_of_an_interleaved_stream_is_refused():
    """Exhaustive over one stream: every single-bit flip. The end-state check alone refuses all but
    25 of its 3,584 (0.7%); those decode to other symbols, never to the original ones."""
    m = rans.Categorical.from_counts(np.array([50, 30, 10, 5, 1, 1]), 12)
    t = rans.Tables.build([m])
    sym = np.random.default_rng(0).integers(0, 6, size=(40, 20)).astype(np.uint8)
    good = rans.encode_interleaved(sym, np.zeros(20, dtype=np.int64), t).tobytes()
    silent = 0
    for i in range(len(good) * 8):
        b = bytearray(good)
        b[i // 8] ^= 1 << (i % 8)
        try:
            out = rans.decode_interleaved(np.frombuffer(bytes(b), dtype=np.uint16), 40, np.zeros(20, dtype=np.int64), t)
        except CorruptChunk:
            continue
        silent += 1
        assert not np.array_equal(out, sym)
    assert silent <= len(good) * 8 // 50  # under 2%


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


# -- the Python-level API: every argument check, at its bounds --------------------------------------


def _tables(*counts, precision=12):
    return rans.Tables.build([rans.Categorical.from_counts(np.asarray(c), precision) for c in counts])


def test_blob_api_checks_its_arguments():
    m = rans.Categorical.from_counts(np.array([5, 3, 1, 1]), 12)
    row = np.array([0, 1, 2, 3, 0, 0], dtype=np.uint8)
    assert np.array_equal(rans.decode(rans.encode(row, [m]), [m]), row[None, :])  # 1-D: one stream
    assert rans.decode(rans.encode(row[None, :], [m]), rans.Tables.build([m])).shape == (1, 6)
    with pytest.raises(CodecError, match="2-D integer"):
        rans.encode(row.astype(np.float32), [m])
    with pytest.raises(CodecError, match="2-D integer"):
        rans.encode(row.reshape(1, 2, 3), [m])
    with pytest.raises(CodecError, match="negative symbol"):
        rans.encode(np.array([[0, -1]]), [m])
    with pytest.raises(CodecError, match="outside the alphabet"):
        rans.encode(np.array([[0, 4]]), [m])
    assert rans.encode(np.array([[3, 0]], dtype=np.int64), [m]) == rans.encode(np.array([[3, 0]], np.uint8), [m])
    empty = rans.encode(np.zeros((2, 0), np.uint8), [m])
    assert rans.decode(empty, [m]).shape == (2, 0)
    blob = rans.encode(np.stack([row, row[::-1]]), [m, rans.Categorical(np.array([1024] * 4), 12)], [1, 0])
    assert np.array_equal(rans.decode(blob, [m, rans.Categorical(np.array([1024] * 4), 12)], [1, 0])[1], row[::-1])
    wrong = rans.Categorical.from_counts(np.array([5, 3, 1, 1]), 11)
    with pytest.raises(CorruptChunk, match="precision 12 != model precision 11"):
        rans.decode(rans.encode(row, [m]), [wrong])
    good = rans.encode(row, [m])
    for data, match in (
        (good[:12], "too short"),
        (b"RANZ" + good[4:], "bad rANS magic"),
        (good[:15], "stream table"),
        (good + b"\0", "odd payload"),
        (good[:4] + struct.pack("<I", 1) + struct.pack("<I", 1 << 30) + good[12:], "symbol count"),
    ):
        with pytest.raises(CorruptChunk, match=match):
            rans.decode(data, [m])


def test_check_symbols():
    t = _tables([5, 0, 1, 1])
    rans.check_symbols(np.zeros((0, 2), np.uint8), np.zeros(2, np.int64), t)
    rans.check_symbols(np.array([[0, 2], [3, 0]], np.uint8), np.zeros(2, np.int64), t)
    with pytest.raises(CodecError, match="probability 0"):
        rans.check_symbols(np.array([[0, 1]], np.uint8), np.zeros(2, np.int64), t)
    with pytest.raises(CodecError, match="outside the alphabet"):
        rans.check_symbols(np.array([[0, 4]], np.uint8), np.zeros(2, np.int64), t)


def test_column_api_checks_its_arguments():
    t = _tables([5, 3, 1, 1], [1, 1, 1, 1])
    sym = np.array([[0, 1, 3], [2, 0, 0]], np.uint8)  # (n=2, S=3)
    idx = np.array([0, 1, 1])
    words, lengths = rans.encode_columns(sym, idx, t)
    assert int(lengths.sum()) == words.size and (lengths >= 2).all()
    assert np.array_equal(rans.decode_columns(words, lengths, 2, idx, t), sym)
    out = np.empty((2, 3), np.uint8)
    assert rans.decode_columns(words, lengths, 2, idx, t, out=out) is out and np.array_equal(out, sym)
    for bad_out in (np.empty((3, 2), np.uint8), np.empty((2, 3), np.uint16)):
        with pytest.raises(CodecError, match="bad output buffer"):
            rans.decode_columns(words, lengths, 2, idx, t, out=bad_out)
    with pytest.raises(CodecError, match="2-D"):
        rans.encode_columns(sym[0], idx, t)
    with pytest.raises(CodecError, match="one table index per stream"):
        rans.encode_columns(sym, idx[:2], t)
    for bad in ([0, 2, 1], [-1, 0, 0]):
        with pytest.raises(CodecError, match="table index out of range"):
            rans.encode_columns(sym, np.array(bad), t)
        with pytest.raises(CorruptChunk, match="table index out of range"):
            rans.decode_columns(words, lengths, 2, np.array(bad), t)
    with pytest.raises(CodecError, match="outside the alphabet"):
        rans.encode_columns(sym + 4, idx, t)
    with pytest.raises(CodecError, match="probability 0"):  # unchecked: the kernel still refuses
        rans.encode_columns(np.array([[1]], np.uint8), np.zeros(1, np.int64), _tables([1, 0]), check=False)
    with pytest.raises(CorruptChunk, match="stream count"):
        rans.decode_columns(words, lengths, 2, idx[:2], t)
    with pytest.raises(CorruptChunk, match="shorter than its state"):
        rans.decode_columns(words, np.array([1, int(lengths[1]), int(lengths[2]) + int(lengths[0]) - 1]), 2, idx, t)
    with pytest.raises(CorruptChunk, match="do not add up"):
        rans.decode_columns(words[:-1], lengths, 2, idx, t)
    with pytest.raises(CorruptChunk, match="did not end in the initial state"):
        rans.decode_columns(words, lengths, 1, idx, t)  # one symbol fewer than coded
    # empty blocks: no symbols, or no streams
    w0, l0 = rans.encode_columns(np.zeros((0, 3), np.uint8), idx, t)
    assert l0.tolist() == [2, 2, 2] and rans.decode_columns(w0, l0, 0, idx, t).shape == (0, 3)
    with pytest.raises(CorruptChunk, match="extra words"):
        rans.decode_columns(np.zeros(7, np.uint16), np.array([2, 2, 3]), 0, idx, t)
    assert rans.decode_columns(np.zeros(0, np.uint16), np.zeros(0, np.int64), 5, np.zeros(0), t).shape == (5, 0)


def test_column_decoders_agree_on_both_table_layouts():
    """The packed kernel (12-bit, bytes) and the generic one (wider alphabets, 14-bit) decode alike."""
    rng = np.random.default_rng(7)
    for t in (_tables(rng.integers(1, 9, 20), precision=12), _tables(rng.integers(1, 9, 300), precision=14)):
        assert (t.packed is not None) == (t.alphabet_size <= 256)
        sym = rng.integers(0, t.alphabet_size, size=(33, 18)).astype(t.symbol_dtype)
        words, lengths = rans.encode_columns(sym, np.zeros(18, np.int64), t)
        assert np.array_equal(rans.decode_columns(words, lengths, 33, np.zeros(18, np.int64), t), sym)
        bad = words.copy()
        bad[0] ^= 1  # the first stream's state
        with pytest.raises(CorruptChunk, match="1 rANS stream"):
            rans.decode_columns(bad, lengths, 33, np.zeros(18, np.int64), t)


def test_interleaved_api_checks_its_arguments():
    t = _tables([5, 3, 1, 1], [1, 1, 1, 1], [2, 1, 0, 1])
    sym = np.array([[0, 1, 3], [2, 0, 0]], np.uint8)
    idx = np.array([0, 1, 1])
    words = rans.encode_interleaved(sym, idx, t)
    assert words.size >= 2 * 3  # three lanes' states, then the renormalisation words
    out = np.empty((2, 3), np.uint8)
    assert rans.decode_interleaved(words, 2, idx, t, out=out) is out and np.array_equal(out, sym)
    with pytest.raises(CodecError, match="bad output buffer"):
        rans.decode_interleaved(words, 2, idx, t, out=np.empty((2, 4), np.uint8))
    with pytest.raises(CodecError, match="C-contiguous"):
        rans.decode_interleaved(words, 2, idx, t, out=np.empty((3, 2), np.uint8).T)
    with pytest.raises(CodecError, match="2-D"):
        rans.encode_interleaved(sym[0], idx, t)
    with pytest.raises(CodecError, match="one table index per column"):
        rans.encode_interleaved(sym, idx[:2], t)
    with pytest.raises(CodecError, match="one row shift per row"):
        rans.encode_interleaved(sym, idx, t, row_shift=np.zeros(3, np.int64))
    with pytest.raises(CodecError, match="outside the alphabet"):
        rans.encode_interleaved(sym + 4, idx, t)
    with pytest.raises(CodecError, match="probability 0"):
        rans.encode_interleaved(np.array([[2]], np.uint8), np.array([2]), t)
    # the models table_index[c] + row_shift[t] must all exist: 0..2 here
    shifted = rans.encode_interleaved(sym, idx, t, row_shift=np.array([1, 0]))
    assert np.array_equal(rans.decode_interleaved(shifted, 2, idx, t, row_shift=np.array([1, 0])), sym)
    with pytest.raises(CodecError, match="table index out of range"):
        rans.encode_interleaved(sym, idx, t, row_shift=np.array([2, 0]))  # 1 + 2 = 3 tables up
    with pytest.raises(CorruptChunk, match="table index out of range"):
        rans.decode_interleaved(words, 2, idx, t, row_shift=np.array([0, -1]))  # 0 - 1 < 0
    with pytest.raises(CorruptChunk, match="table index out of range"):
        rans.decode_interleaved(words, 2, np.array([-1, 0, 0]), t)
    # empty blocks carry no words at all
    assert rans.encode_interleaved(np.zeros((0, 3), np.uint8), idx, t).size == 0
    assert rans.decode_interleaved(np.zeros(0, np.uint16), 0, idx, t).shape == (0, 3)
    with pytest.raises(CorruptChunk, match="non-empty rANS stream"):
        rans.decode_interleaved(np.zeros(1, np.uint16), 0, idx, t)
    with pytest.raises(CorruptChunk, match="shorter than its states"):
        rans.decode_interleaved(words[:5], 2, idx, t)


def test_interleaved_generic_decoder_refuses_damage_like_the_unrolled_one():
    t = _tables(np.arange(1, 301), precision=14)  # 300 symbols: no packed table, the generic kernel
    assert t.packed is None
    rng = np.random.default_rng(3)
    sym = rng.integers(0, 300, size=(25, 20)).astype(np.uint16)
    idx = np.zeros(20, np.int64)
    words = rans.encode_interleaved(sym, idx, t)
    assert np.array_equal(rans.decode_interleaved(words, 25, idx, t), sym)
    for cut in (words[:-1], np.concatenate([words, [0]]).astype(np.uint16)):
        with pytest.raises(CorruptChunk, match="initial state"):
            rans.decode_interleaved(cut, 25, idx, t)


def test_min_bits_and_the_allocation_bound():
    t = _tables([2048, 1024, 1024], [1, 4095])  # max p: 1/2 and 4095/4096
    assert rans.min_bits(t) == pytest.approx(-math.log2(4095 / 4096))
    half = _tables([2048, 1024, 1024])
    assert rans.min_bits(half) == 1.0
    # a symbol costs >= 1 bit: 16 * words + 64 * streams + 64 bits hold at most that many symbols
    rans.check_budget(16 * 10 + 64 + 64, 1, 10, half, "x")  # exactly at the bound: accepted
    rans.check_budget(176, 2, 10, half, "x")
    with pytest.raises(CorruptChunk, match=r": y: symbol count inconsistent with payload size$"):
        rans.check_budget(16 * 10 + 64 + 65, 1, 10, half, "y")
    with pytest.raises(CorruptChunk):
        rans.check_budget(177, 2, 10, half, "x")
    free = _tables([1, 4095])
    rans.check_budget(rans.MAX_SYMBOLS, 1, 10**9, free, "x")
    with pytest.raises(CorruptChunk):  # whatever the tables allow, at most MAX_SYMBOLS per call
        rans.check_budget(rans.MAX_SYMBOLS + 1, 1, 10**12, free, "x")


def test_models_refuse_what_they_cannot_represent():
    for freqs, precision in (([], 12), ([[4096]], 12), ([4096], 0), ([4096], 15), ([4097, -1], 12), ([4000], 12)):
        with pytest.raises(CodecError):
            rans.Categorical(np.array(freqs, dtype=np.int64), precision)
    with pytest.raises(CodecError, match="all-zero counts"):
        rans.quantize_counts(np.zeros(4), 12)
    with pytest.raises(CodecError, match="do not fit precision 2"):
        rans.quantize_counts(np.ones(5), 2)
    with pytest.raises(CodecError, match="at least one model"):
        rans.Tables.build([])
    with pytest.raises(CodecError, match="share a precision"):
        rans.Tables.build([rans.Categorical(np.array([4096]), 12), rans.Categorical(np.array([2048]), 11)])
    with pytest.raises(CodecError, match="larger than 65536"):
        rans.Tables.build([rans.Categorical(np.r_[np.ones(4096, np.int64), np.zeros(70000, np.int64)], 12)])
    m = rans.Categorical(np.array([1024, 3072]), 12)
    assert m == rans.Categorical(np.array([1024, 3072]), 12) and hash(m) == hash(
        rans.Categorical(np.array([1024, 3072]))
    )
    assert m != rans.Categorical(np.array([512, 1536]), 11) and m.alphabet_size == 2
    assert 1 <= rans.num_threads_default() <= 2
