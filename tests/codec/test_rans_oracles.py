"""rANS against independent oracles: a plain-Python coder, hand-computed tables, exact messages.

``test_rans.py`` holds the round trips and the refusals by kind; this file pins the values: the
exact words and blob bytes (from a plain-Python rANS coder written from the documented stream
format), the tables of :meth:`Tables.build` and the frequencies of :func:`quantize_counts` worked
out by hand, every refusal's whole message, and each bound at its value and one past it.
"""

from __future__ import annotations

import math
import re
import struct

import numba
import numpy as np
import pytest

from cachegen.codec import rans
from cachegen.errors import CodecError, CorruptChunk

L = 1 << 16  # the state's lower bound; a stream starts and ends in state L


def exactly(msg: str) -> str:
    """A ``match=`` pattern for the whole message and nothing else (a CorruptChunk's starts with "corrupt chunk: ")."""
    return "^(?:corrupt chunk: )?" + re.escape(msg) + "$"


# -- a plain-Python rANS coder: the documented format, one symbol at a time ------------------------


def _step(x: int, f: int, c: int, prec: int, emit: list[int]) -> int:
    """Code one symbol of frequency ``f`` and cumulative ``c``: renormalise (16 bits), then code."""
    if x >= f << (32 - prec):
        emit.append(x & 0xFFFF)
        x >>= 16
    return (x // f << prec) + x % f + c


def _cum(freqs) -> list[int]:
    out, acc = [], 0
    for f in freqs:
        out.append(acc)
        acc += int(f)
    return out


def ref_stream(column, freqs, prec: int) -> list[int]:
    """One column stream: the final state (high word first), then the renormalisation words in decode order."""
    cum = _cum(freqs)
    x, emit = L, []
    for y in reversed([int(v) for v in column]):
        x = _step(x, int(freqs[y]), cum[y], prec, emit)
    return [x >> 16, x & 0xFFFF, *reversed(emit)]


def ref_interleaved(sym, table_index, models, prec: int, row_shift=None) -> list[int]:
    """One word stream for a token-major block: lane ``c % 16`` codes column ``c`` with model ``table_index[c] + row_shift[t]``."""
    n, S = len(sym), len(sym[0]) if len(sym) else 0
    shift = [0] * n if row_shift is None else [int(r) for r in row_shift]
    cums = [_cum(m) for m in models]
    states, emit = [L] * 16, []
    for t in range(n - 1, -1, -1):
        for c in range(S - 1, -1, -1):
            k = int(table_index[c]) + shift[t]
            y = int(sym[t][c])
            states[c % 16] = _step(states[c % 16], int(models[k][y]), cums[k][y], prec, emit)
    head = []
    for j in range(min(16, S)):
        head += [states[j] >> 16, states[j] & 0xFFFF]
    return head + list(reversed(emit))


def ref_blob(sym, models, prec: int, table_index=None) -> bytes:
    """``b"RANS" | u32 n_streams | u32 n | u8 precision | u32 lengths[] | u16 words[]``, little endian."""
    S, n = len(sym), len(sym[0])
    idx = [0] * S if table_index is None else list(table_index)
    streams = [ref_stream(sym[s], models[idx[s]], prec) for s in range(S)]
    out = b"RANS" + struct.pack("<IIB", S, n, prec)
    out += b"".join(struct.pack("<I", len(w)) for w in streams)
    return out + b"".join(struct.pack("<H", v) for w in streams for v in w)


# -- the coder against the reference --------------------------------------------------------------


def test_the_reference_coder_on_a_hand_worked_stream():
    """Two symbols of a 2-bit model [2, 1, 1] (cum [0, 2, 3]), worked out by hand.

    Backwards: y=1 (f=1, c=2): x = 65536 < 1 << 30, x = (65536 << 2) + 0 + 2 = 262146;
    then y=0 (f=2, c=0): 262146 < 2 << 30, x = (131073 << 2) + 0 + 0 = 524292 = 0x00080004."""
    assert ref_stream([0, 1], [2, 1, 1], 2) == [0x0008, 0x0004]
    t = rans.Tables.build([rans.Categorical(np.array([2, 1, 1]), 2)])
    words, lengths = rans.encode_columns(np.array([[0], [1]], np.uint8), np.zeros(1, np.int64), t)
    assert words.dtype == np.uint16 and words.tolist() == [8, 4] and lengths.tolist() == [2]


@pytest.mark.parametrize("prec", [1, 2, 8, 12, 13, 14])
def test_column_words_equal_the_reference(prec):
    """Each column stream word for word, lengths exact, on both table layouts and every group width."""
    rng = np.random.default_rng(prec)
    a = 300 if prec >= 13 else min(1 << prec, 20)
    models = [rans.Categorical.from_counts(rng.integers(1, 40, a), prec) for _ in range(3)]
    t = rans.Tables.build(models)
    for n, S in ((1, 1), (5, 3), (40, 17), (0, 2)):
        sym = rng.integers(0, a, size=(n, S)).astype(t.symbol_dtype)
        idx = rng.integers(0, 3, S)
        words, lengths = rans.encode_columns(sym, idx, t)
        ref = [ref_stream(sym[:, s], models[idx[s]].freqs, prec) for s in range(S)]
        assert lengths.dtype == np.int64 and lengths.tolist() == [len(w) for w in ref]
        assert words.dtype == np.uint16 and words.tolist() == [v for w in ref for v in w]
        back = rans.decode_columns(words, lengths, n, idx, t)
        assert back.dtype == t.symbol_dtype and back.shape == (n, S) and np.array_equal(back, sym)


def test_a_stream_that_renormalises_at_every_symbol():
    """A symbol of frequency 1 in 2**12 costs 12 bits: most symbols write a renormalisation word."""
    m = rans.Categorical(np.array([4095, 1]), 12)
    sym = np.ones((6, 1), np.uint8)
    words, lengths = rans.encode_columns(sym, np.zeros(1, np.int64), rans.Tables.build([m]))
    ref = ref_stream(sym[:, 0], m.freqs, 12)
    assert ref == [271, 65535, 65535, 4095, 4095, 4095]  # the state, then 4 words for 6 symbols
    assert words.tolist() == ref and lengths.tolist() == [6]


@pytest.mark.parametrize("prec", [2, 12, 14])
def test_interleaved_words_equal_the_reference(prec):
    rng = np.random.default_rng(100 + prec)
    a = 300 if prec == 14 else min(1 << prec, 30)
    models = [rans.Categorical.from_counts(rng.integers(1, 40, a), prec) for _ in range(4)]
    t = rans.Tables.build(models)
    freqs = [m.freqs for m in models]
    for n, S in ((1, 1), (3, 5), (9, 16), (7, 17), (4, 35)):
        sym = rng.integers(0, a, size=(n, S)).astype(t.symbol_dtype)
        idx = rng.integers(1, 3, S)
        shift = rng.integers(-1, 2, n)
        for rs in (None, shift):
            words = rans.encode_interleaved(sym, idx, t, row_shift=rs)
            assert words.dtype == np.uint16 and words.tolist() == ref_interleaved(sym, idx, freqs, prec, rs)
            back = rans.decode_interleaved(words, n, idx, t, row_shift=rs)
            assert back.dtype == t.symbol_dtype and np.array_equal(back, sym)


def test_blob_bytes_equal_the_reference():
    m0 = rans.Categorical.from_counts(np.array([5, 3, 1, 1]), 12)
    m1 = rans.Categorical(np.array([1024] * 4), 12)
    sym = np.random.default_rng(5).integers(0, 4, size=(3, 30)).astype(np.uint8)
    assert rans.encode(sym, [m0]) == ref_blob(sym, [m0.freqs], 12)
    blob = rans.encode(sym, [m0, m1], [1, 0, 1])
    assert blob == ref_blob(sym, [m0.freqs, m1.freqs], 12, [1, 0, 1])
    back = rans.decode(blob, [m0, m1], [1, 0, 1])
    assert back.dtype == np.uint8 and back.flags.c_contiguous and np.array_equal(back, sym)
    # a 1-D input is one stream; int64 symbols code like uint8 ones; a tuple or a generator of models is taken
    assert rans.encode(sym[0], [m0]) == ref_blob(sym[:1], [m0.freqs], 12)
    assert rans.encode(sym.astype(np.int64), (m0,)) == ref_blob(sym, [m0.freqs], 12)
    assert np.array_equal(rans.decode(rans.encode(sym, (m for m in [m0])), (m for m in [m0])), sym)
    # no table index: every stream uses the first model
    assert np.array_equal(rans.decode(rans.encode(sym, [m0, m1]), [m0, m1]), sym)
    assert rans.encode(sym, [m0, m1]) == ref_blob(sym, [m0.freqs], 12)


def test_blob_of_wide_symbols():
    m = rans.Categorical.from_counts(np.arange(1, 301), 14)
    sym = np.random.default_rng(9).integers(0, 300, size=(2, 25)).astype(np.uint16)
    blob = rans.encode(sym, [m])
    assert blob == ref_blob(sym, [m.freqs], 14)
    back = rans.decode(blob, [m])
    assert back.dtype == np.uint16 and np.array_equal(back, sym)


def test_blob_refuses_a_stream_too_long_for_its_u32_length(monkeypatch):
    """A length must fit the u32 stream table: 2**32 - 1 words is written, 2**32 refused (column coder stubbed)."""
    from cachegen.codec.rans import blob

    m = rans.Categorical(np.array([2048, 2048]), 12)
    for length, ok in ((2**32 - 1, True), (2**32, False), (2**33, False)):
        monkeypatch.setattr(
            blob, "encode_columns", lambda *a, n=length, **k: (np.zeros(0, np.uint16), np.array([7, n]))
        )
        if ok:
            out = rans.encode(np.zeros((2, 1), np.uint8), [m])
            assert out == b"RANS" + struct.pack("<IIBII", 2, 1, 12, 7, length)
        else:
            with pytest.raises(CodecError, match=exactly("stream too long")):
                rans.encode(np.zeros((2, 1), np.uint8), [m])


def test_blob_empty_shapes():
    m = rans.Categorical(np.array([2048, 2048]), 12)
    none = rans.encode(np.zeros((0, 5), np.uint8), [m])
    assert none == b"RANS" + struct.pack("<IIB", 0, 5, 12)  # the header alone: 13 bytes
    assert rans.decode(none, [m]).shape == (0, 5)
    empty = rans.encode(np.zeros((2, 0), np.uint8), [m])
    assert empty == b"RANS" + struct.pack("<IIB", 2, 0, 12) + struct.pack("<II", 2, 2) + struct.pack("<4H", 1, 0, 1, 0)
    assert rans.decode(empty, [m]).shape == (2, 0)


def test_blob_symbol_at_the_alphabet_bound():
    """A 256-symbol model: 255 is coded, 256 (given as int64) is refused, not wrapped to 0 by a uint8 cast."""
    m = rans.Categorical(np.full(256, 16), 12)
    ok = np.array([[255, 0, 7]], np.int64)
    assert rans.encode(ok, [m]) == ref_blob(ok, [m.freqs], 12)
    with pytest.raises(CodecError, match=exactly("symbol outside the alphabet")):
        rans.encode(np.array([[256, 0, 7]], np.int64), [m])
    with pytest.raises(CodecError, match=exactly("negative symbol")):
        rans.encode(np.array([[0, -1]], np.int64), [m])
    assert rans.encode(np.array([[0, 0]], np.int64), [m]) == ref_blob([[0, 0]], [m.freqs], 12)  # 0 is no negative
    for bad in (np.zeros((1, 2), np.float32), np.zeros((1, 2), bool), np.zeros((1, 1, 2), np.uint8)):
        with pytest.raises(CodecError, match=exactly("symbols must be a 2-D integer array (n_streams, n)")):
            rans.encode(bad, [m])


def test_blob_refusals_have_exact_messages():
    m = rans.Categorical.from_counts(np.array([5, 3, 1, 1]), 12)
    row = np.array([[0, 1, 2, 3, 0, 0]], np.uint8)
    good = rans.encode(row, [m])
    S = 1
    wrong = rans.Categorical.from_counts(np.array([5, 3, 1, 1]), 11)
    cases = (
        (good[:12], "rANS blob too short"),
        (b"", "rANS blob too short"),
        (b"RANZ" + good[4:], "bad rANS magic"),
        (good, "blob precision 12 != model precision 11", [wrong]),
        (good[: 13 + 4 * S - 1], "rANS blob truncated in its stream table"),
        (good + b"\0", "odd payload length"),
        (
            good[:4] + struct.pack("<I", 1) + struct.pack("<I", 1 << 30) + good[12:],
            "rANS blob: symbol count inconsistent with payload size",
        ),
        (good[:-2], "rANS stream lengths do not add up to the payload"),
        (good[:17], "rANS stream lengths do not add up to the payload"),  # the stream table complete, no words
    )
    for data, msg, *models in cases:
        with pytest.raises(CorruptChunk, match=exactly(msg)):
            rans.decode(data, models[0] if models else [m])
    # the header alone (13 bytes) is a valid blob of no streams
    assert rans.decode(b"RANS" + struct.pack("<IIB", 0, 3, 12), [m]).shape == (0, 3)


def test_blob_decode_bounds_n_by_the_payload():
    """check_budget gets n, the stream count and the word count: at its bound accepted, one more refused."""
    half = rans.Categorical(np.array([2048, 2048]), 12)  # every symbol costs exactly 1 bit
    # 2 streams of n symbols, 4 words: n * 2 * 1 <= 16 * 4 + 64 * 2 + 64 = 256 bits  <=>  n <= 128
    sym = np.zeros((2, 128), np.uint8)
    blob = rans.encode(sym, [half])
    nw = (len(blob) - 13 - 8) // 2
    hdr = lambda n: b"RANS" + struct.pack("<IIB", 2, n, 12)
    budget = (16 * nw + 64 * 2 + 64) // 2
    assert np.array_equal(rans.decode(blob, [half]), sym) and budget >= 128
    with pytest.raises(CorruptChunk, match=exactly("rANS blob: symbol count inconsistent with payload size")):
        rans.decode(hdr(budget + 1) + blob[13:], [half])
    with pytest.raises(CorruptChunk, match=exactly("2 rANS stream(s) did not end in the initial state")):
        rans.decode(hdr(budget) + blob[13:], [half])  # passes the bound, then fails to decode


# -- columns ----------------------------------------------------------------------------------------


def test_column_refusals_have_exact_messages():
    t = rans.Tables.build([rans.Categorical.from_counts(np.array(c), 12) for c in ([5, 3, 1, 1], [1, 1, 1, 1])])
    sym = np.array([[0, 1, 3], [2, 0, 0]], np.uint8)
    idx = np.array([0, 1, 1])
    words, lengths = rans.encode_columns(sym, idx, t)
    enc = (
        ((sym[0], idx), "symbols must be 2-D"),
        ((sym, idx[:2]), "need one table index per stream"),
        ((sym, np.array([0, 2, 1])), "table index out of range"),
        ((sym, np.array([-1, 0, 0])), "table index out of range"),
        ((sym + 1, idx), "symbol outside the alphabet"),
    )
    for (s, i), msg in enc:
        with pytest.raises(CodecError, match=exactly(msg)):
            rans.encode_columns(s, i, t)
    # the highest table and the highest symbol are accepted
    rans.encode_columns(np.array([[3, 3, 3]], np.uint8), np.array([0, 1, 1]), t)
    zero = rans.Tables.build([rans.Categorical(np.array([4096, 0]), 12)])
    for check in (True, False):
        with pytest.raises(CodecError, match=exactly("a symbol has probability 0 in its model")):
            rans.encode_columns(np.array([[1]], np.uint8), np.zeros(1, np.int64), zero, check=check)
    dec = (
        ((words, lengths, 2, idx[:2]), CorruptChunk, "stream count does not match table indices"),
        ((words, lengths, 2, np.array([0, 2, 1])), CorruptChunk, "table index out of range"),
        ((words, lengths, 2, np.array([0, 0, -1])), CorruptChunk, "table index out of range"),
        ((words, np.array([1, 2, int(lengths.sum()) - 3]), 2, idx), CorruptChunk, "rANS stream shorter than its state"),
        ((words[:-1], lengths, 2, idx), CorruptChunk, "rANS stream lengths do not add up to the payload"),
        ((words, lengths, 1, idx), CorruptChunk, "3 rANS stream(s) did not end in the initial state"),
        ((np.zeros(7, np.uint16), np.array([2, 2, 3]), 0, idx), CorruptChunk, "empty stream with extra words"),
    )
    for args, exc, msg in dec:
        with pytest.raises(exc, match=exactly(msg)):
            rans.decode_columns(*args, t)
    for bad_out in (np.empty((3, 2), np.uint8), np.empty((2, 3), np.uint16), np.empty((2, 2), np.uint8)):
        with pytest.raises(CodecError, match=exactly("bad output buffer")):
            rans.decode_columns(words, lengths, 2, idx, t, out=bad_out)


def test_column_streams_of_exactly_their_state():
    """A stream of length 2 (its state alone) is accepted: symbols of probability ~1 write no word."""
    m = rans.Categorical(np.array([4095, 1]), 12)
    t = rans.Tables.build([m])
    sym = np.zeros((3, 2), np.uint8)
    words, lengths = rans.encode_columns(sym, np.zeros(2, np.int64), t)
    assert lengths.tolist() == [2, 2]
    assert np.array_equal(rans.decode_columns(words, lengths, 3, np.zeros(2, np.int64), t), sym)
    # no streams: any n gives an empty (n, 0); one stream per column of no symbols: length 2 each
    assert rans.decode_columns(np.zeros(0, np.uint16), np.zeros(0, np.int64), 4, np.zeros(0, np.int64), t).shape == (
        4,
        0,
    )
    w0, l0 = rans.encode_columns(np.zeros((0, 2), np.uint8), np.zeros(2, np.int64), t)
    assert w0.tolist() == [1, 0, 1, 0] and l0.tolist() == [2, 2]
    out = np.full((0, 2), 9, np.uint8)
    assert rans.decode_columns(w0, l0, 0, np.zeros(2, np.int64), t, out=out) is out
    assert rans.decode_columns(np.array([1, 0, 1, 0], np.uint16), [2, 2], 0, [0, 0], t).shape == (0, 2)  # lists taken


def test_column_decode_into_a_given_buffer_on_both_layouts():
    for t in (
        rans.Tables.build([rans.Categorical.from_counts(np.arange(1, 11), 12)]),
        rans.Tables.build([rans.Categorical.from_counts(np.arange(1, 301), 14)]),
    ):
        sym = np.random.default_rng(1).integers(0, t.alphabet_size, size=(20, 5)).astype(t.symbol_dtype)
        words, lengths = rans.encode_columns(sym, np.zeros(5, np.int64), t)
        out = np.zeros((20, 5), t.symbol_dtype)
        assert rans.decode_columns(words, lengths, 20, np.zeros(5, np.int64), t, out=out) is out
        assert np.array_equal(out, sym)
        bad = words.copy()
        bad[-1] ^= 0x10
        with pytest.raises(CorruptChunk, match=exactly("1 rANS stream(s) did not end in the initial state")):
            rans.decode_columns(bad, lengths, 20, np.zeros(5, np.int64), t)


def test_check_symbols_per_stream_model():
    """Stream s is checked against its own model table_index[s]; the highest symbol is accepted."""
    t = rans.Tables.build(
        [rans.Categorical(np.array([2048, 2048, 0]), 12), rans.Categorical(np.array([0, 2048, 2048]), 12)]
    )
    rans.check_symbols(np.array([[0, 2], [1, 1]], np.uint8), np.array([0, 1]), t)
    rans.check_symbols(np.zeros((0, 2), np.uint8), np.array([0, 1]), t)
    for sym, idx in (([[2, 2]], [0, 1]), ([[0, 0]], [0, 1]), ([[0, 1]], [1, 1])):
        with pytest.raises(CodecError, match=exactly("a symbol has probability 0 in its model")):
            rans.check_symbols(np.array(sym, np.uint8), np.array(idx), t)
    with pytest.raises(CodecError, match=exactly("symbol outside the alphabet")):
        rans.check_symbols(np.array([[0, 3]], np.uint8), np.array([0, 1]), t)
    assert rans.check_symbols(np.array([[1, 2]], np.int64), np.array([0, 1]), t) is None


# -- interleaved ------------------------------------------------------------------------------------


def test_interleaved_refusals_have_exact_messages():
    t = rans.Tables.build(
        [rans.Categorical.from_counts(np.array(c), 12) for c in ([5, 3, 1, 1], [1, 1, 1, 1], [2, 1, 0, 1])]
    )
    sym = np.array([[0, 1, 3], [2, 0, 0]], np.uint8)
    idx = np.array([0, 1, 1])
    words = rans.encode_interleaved(sym, idx, t)
    enc = (
        ((sym[0], idx, None), "symbols must be 2-D"),
        ((sym, idx[:2], None), "need one table index per column"),
        ((sym, idx, np.zeros(3, np.int64)), "need one row shift per row"),
        ((sym, idx, np.array([2, 0])), "table index out of range"),
        ((sym, np.array([-1, 0, 0]), None), "table index out of range"),
        ((sym, np.array([0, 3, 0]), None), "table index out of range"),
        ((sym + 1, idx, None), "symbol outside the alphabet"),
        ((np.array([[2]], np.uint8), np.array([2]), None), "a symbol has probability 0 in its model"),
    )
    for (s, i, rs), msg in enc:
        with pytest.raises(CodecError, match=exactly(msg)):
            rans.encode_interleaved(s, i, t, row_shift=rs)
    dec = (
        ((words, 2, idx[None, :]), {}, CorruptChunk, "need one table index per column"),  # S is its first axis
        ((words, 2, idx), {"row_shift": np.zeros(3, np.int64)}, CorruptChunk, "need one row shift per row"),
        ((words, 2, idx), {"row_shift": np.array([0, -1])}, CorruptChunk, "table index out of range"),
        ((words, 2, idx), {"row_shift": np.array([0, 2])}, CorruptChunk, "table index out of range"),
        ((words, 2, np.array([3, 0, 0])), {}, CorruptChunk, "table index out of range"),
        ((np.zeros(1, np.uint16), 0, idx), {}, CorruptChunk, "empty block with a non-empty rANS stream"),
        ((words[:5], 2, idx), {}, CorruptChunk, "rANS stream shorter than its states"),
        (
            (np.append(words, 0).astype(np.uint16), 2, idx),
            {},
            CorruptChunk,
            "rANS stream did not end in the initial state",
        ),
        ((words, 2, idx), {"out": np.empty((2, 4), np.uint8)}, CodecError, "bad output buffer"),
        ((words, 2, idx), {"out": np.empty((2, 3), np.uint16)}, CodecError, "bad output buffer"),
        ((words, 2, idx), {"out": np.empty((3, 2), np.uint8).T}, CodecError, "output buffer must be C-contiguous"),
    )
    for args, kw, exc, msg in dec:
        with pytest.raises(exc, match=exactly(msg)):
            rans.decode_interleaved(*args, t, **kw)
    # the highest model (index 1 + shift 1 = 2) and the lowest (0) are accepted
    rs = np.array([1, 0])
    assert np.array_equal(
        rans.decode_interleaved(rans.encode_interleaved(sym, idx, t, rs), 2, idx, t, row_shift=rs), sym
    )


def test_interleaved_shortest_stream_is_its_states():
    """Symbols of probability ~1 write no word: the stream is exactly 2 * min(16, S) words, and it decodes."""
    m = rans.Categorical(np.array([4095, 1]), 12)
    for t in (
        rans.Tables.build([m]),
        rans.Tables.build([rans.Categorical(np.r_[16383, np.ones(1, np.int64), np.zeros(298, np.int64)], 14)]),
    ):
        for S in (3, 16, 20):
            sym = np.zeros((1, S), t.symbol_dtype)
            words = rans.encode_interleaved(sym, np.zeros(S, np.int64), t)
            assert words.size == 2 * min(16, S)
            assert np.array_equal(rans.decode_interleaved(words, 1, np.zeros(S, np.int64), t), sym)
            with pytest.raises(CorruptChunk, match=exactly("rANS stream shorter than its states")):
                rans.decode_interleaved(words[:-1], 1, np.zeros(S, np.int64), t)


def test_interleaved_empty_blocks():
    t = rans.Tables.build([rans.Categorical(np.array([2048, 2048]), 12)])
    for n, S in ((0, 3), (4, 0), (0, 0)):
        w = rans.encode_interleaved(np.zeros((n, S), np.uint8), np.zeros(S, np.int64), t)
        assert w.dtype == np.uint16 and w.size == 0
        out = rans.decode_interleaved(w, n, np.zeros(S, np.int64), t)
        assert out.shape == (n, S) and out.dtype == np.uint8
    # a row shift of the right length is taken even when the block is empty; a shift of no rows for no rows
    assert (
        rans.encode_interleaved(np.zeros((2, 0), np.uint8), np.zeros(0, np.int64), t, row_shift=np.array([5, -5])).size
        == 0
    )
    assert rans.decode_interleaved(
        np.zeros(0, np.uint16), 0, np.zeros(3, np.int64), t, row_shift=np.zeros(0)
    ).shape == (0, 3)


def test_interleaved_row_shift_negative_and_positive():
    """Models table_index[c] + row_shift[t] with negative shifts: the smallest reaches model 0, the largest the last."""
    rng = np.random.default_rng(4)
    models = [rans.Categorical.from_counts(rng.integers(1, 9, 6), 12) for _ in range(5)]
    t = rans.Tables.build(models)
    sym = rng.integers(0, 6, size=(4, 3)).astype(np.uint8)
    idx = np.array([2, 3, 2])
    shift = np.array([-2, 1, 0, -1])  # models 0..4 all used
    words = rans.encode_interleaved(sym, idx, t, row_shift=shift)
    assert words.tolist() == ref_interleaved(sym, idx, [m.freqs for m in models], 12, shift)
    assert np.array_equal(rans.decode_interleaved(words, 4, idx, t, row_shift=shift), sym)
    assert np.array_equal(rans.decode_interleaved(words, 4, idx, t, row_shift=list(shift)), sym)  # a list is taken
    wide = rans.Tables.build([rans.Categorical.from_counts(rng.integers(1, 9, 300), 14) for _ in range(5)])
    wsym = rng.integers(0, 300, size=(4, 3)).astype(np.uint16)
    ww = rans.encode_interleaved(wsym, idx, wide, row_shift=shift)
    assert np.array_equal(rans.decode_interleaved(ww, 4, idx, wide, row_shift=shift), wsym)
    out = np.zeros((4, 3), np.uint16)
    assert rans.decode_interleaved(ww.astype(np.int64), 4, idx, wide, out=out, row_shift=shift) is out
    assert np.array_equal(out, wsym)


# -- models -------------------------------------------------------------------------------------------


def test_tables_build_by_hand():
    """Two 2-bit models, [2, 1, 1] and [0, 4] (padded to three symbols), every array worked out by hand."""
    t = rans.Tables.build([rans.Categorical(np.array([2, 1, 1]), 2), rans.Categorical(np.array([0, 4]), 2)])
    assert t.precision == 2 and t.n_tables == 2 and t.alphabet_size == 3 and t.symbol_dtype == np.uint8
    assert t.freq.dtype == np.int64 and t.freq.tolist() == [[2, 1, 1], [0, 4, 0]]
    assert t.cum.dtype == np.int64 and t.cum.tolist() == [[0, 2, 3], [0, 0, 4]]
    assert t.inv.dtype == np.float64 and t.inv.tolist() == [[0.5, 1.0, 1.0], [0.0, 0.25, 0.0]]
    assert t.lut.dtype == np.uint8 and t.lut.tolist() == [[0, 0, 1, 2], [1, 1, 1, 1]]
    # packed slot entry: symbol << 24 | (freq - 1) << 12 | (slot - cum)
    assert t.packed.dtype == np.int32
    assert t.packed.tolist() == [
        [1 << 12, (1 << 12) | 1, 1 << 24, 2 << 24],
        [(1 << 24) | (3 << 12) | 0, (1 << 24) | (3 << 12) | 1, (1 << 24) | (3 << 12) | 2, (1 << 24) | (3 << 12) | 3],
    ]
    # encoder table: freq | cum << 16
    assert t.fc.dtype == np.int64 and t.fc.flags.c_contiguous
    assert t.fc.tolist() == [[2, 1 | 2 << 16, 1 | 3 << 16], [0, 4, 4 << 16]]


def test_tables_layout_bounds():
    """uint8 symbols and the packed table up to 256 symbols and precision 12; uint16 and no packed table past them."""

    def flat(a, prec):
        f = np.zeros(a, np.int64)
        f[: min(a, 1 << prec)] = 1
        f[0] += (1 << prec) - f.sum()
        return rans.Categorical(f, prec)

    for a, prec, dtype, packed in (
        (256, 12, np.uint8, True),
        (257, 12, np.uint16, False),
        (256, 13, np.uint8, False),
        (2, 1, np.uint8, True),
    ):
        t = rans.Tables.build([flat(a, prec)])
        assert t.symbol_dtype == dtype and t.lut.shape == (1, 1 << prec) and (t.packed is not None) == packed
        sym = np.zeros((3, 2), dtype)
        sym[1, 1] = min(a, 1 << prec) - 1
        words, lengths = rans.encode_columns(sym, np.zeros(2, np.int64), t)
        assert np.array_equal(rans.decode_columns(words, lengths, 3, np.zeros(2, np.int64), t), sym)
    t = rans.Tables.build([flat(65536, 12)])  # the largest alphabet
    assert t.alphabet_size == 65536 and t.symbol_dtype == np.uint16
    with pytest.raises(CodecError, match=exactly("alphabet larger than 65536")):
        rans.Tables.build([flat(65537, 12)])
    # the alphabet is the largest model's; a tuple of models is taken
    t = rans.Tables.build((rans.Categorical(np.array([4096]), 12), flat(300, 12)))
    assert t.alphabet_size == 300 and t.freq[0].tolist() == [4096] + [0] * 299


def test_tables_build_refusals():
    with pytest.raises(CodecError, match=exactly("need at least one model")):
        rans.Tables.build([])
    with pytest.raises(CodecError, match=exactly("all models of one Tables must share a precision")):
        rans.Tables.build([rans.Categorical(np.array([4096]), 12), rans.Categorical(np.array([2048]), 11)])
    with pytest.raises(CodecError, match=exactly("all models of one Tables must share a precision")):
        rans.Tables.build(
            [
                rans.Categorical(np.array([4096]), 12),
                rans.Categorical(np.array([4096]), 12),
                rans.Categorical(np.array([2048]), 11),
            ]
        )


def test_categorical_refusals_and_bounds():
    cases = (
        ([], 12, "Categorical freqs must be a non-empty 1-D array"),
        ([[4096]], 12, "Categorical freqs must be a non-empty 1-D array"),
        ([1], 0, "precision must be 1..14"),
        ([1 << 15], 15, "precision must be 1..14"),
        ([4097, -1], 12, "freqs must be >= 0 and sum to 2**12, sum is 4096"),
        ([4000], 12, "freqs must be >= 0 and sum to 2**12, sum is 4000"),
        ([4095, 2], 12, "freqs must be >= 0 and sum to 2**12, sum is 4097"),
    )
    for freqs, prec, msg in cases:
        with pytest.raises(CodecError, match=exactly(msg)):
            rans.Categorical(np.array(freqs, dtype=np.int64), prec)
    for prec in (1, 14):  # both ends of the precision range
        m = rans.Categorical(np.array([(1 << prec) - 1, 1, 0]), prec)
        assert m.precision == prec and m.alphabet_size == 3
    m = rans.Categorical([4096, 0])  # a list and the default precision 12
    assert isinstance(m.freqs, np.ndarray) and m.freqs.dtype == np.int64 and m.precision == 12
    assert rans.Categorical(np.array([4096], np.int32)).freqs.dtype == np.int64


def test_categorical_equality_and_hash():
    m = rans.Categorical(np.array([1024, 3072]), 12)
    same = rans.Categorical(np.array([1024, 3072], np.int32), 12)
    assert m == same and (m != same) is False and hash(m) == hash(same)
    assert m != rans.Categorical(np.array([3072, 1024]), 12)
    assert m != rans.Categorical(np.array([512, 1536]), 11)
    assert m != rans.Categorical(np.array([1024, 3072, 0]), 12)  # the alphabet size counts
    assert m != (12, [1024, 3072]) and m != "m" and m is not None and m != None  # noqa: E711
    assert hash(m) == hash((12, np.array([1024, 3072], np.int64).tobytes()))
    assert len({m, same, rans.Categorical(np.array([3072, 1024]), 12)}) == 2


def test_entropy_bits_by_hand():
    m = rans.Categorical(np.array([1024, 3072, 0]), 12)  # p = 1/4, 3/4 and a symbol of probability 0
    assert m.entropy_bits() == pytest.approx(0.25 * 2 + 0.75 * math.log2(4 / 3), rel=1e-15)
    assert rans.Categorical(np.array([4096, 0]), 12).entropy_bits() == 0.0
    assert rans.Categorical(np.array([1, 1]), 1).entropy_bits() == 1.0
    assert rans.Categorical(np.full(16, 1024), 14).entropy_bits() == 4.0


def test_from_counts():
    m = rans.Categorical.from_counts(np.array([1, 1, 2]))
    assert m.precision == 12 and m.freqs.tolist() == [1024, 1024, 2048]
    m = rans.Categorical.from_counts([3, 1], 2)
    assert m.precision == 2 and m.freqs.tolist() == [3, 1] and m.freqs.dtype == np.int64


def ref_quantize(counts, prec: int) -> list[int]:
    """The documented rule in plain Python: round each share of 2**prec to nearest (at least 1 where
    the count is > 0), then fix the total over the largest entries in turn, in order of size (ties
    by position), never taking one below 1: one unit at a time while the error is at most the
    number of symbols k (always, for counts >= 0: rounding moves each of them by less than one),
    in steps of up to an eighth of the entry beyond that (reached only with negative counts)."""
    m = 1 << prec
    c = [float(x) for x in counts]
    total = sum(c)
    f = [max(1, math.floor(x / total * m + 0.5)) if x > 0 else 0 for x in c]
    k = sum(1 for x in c if x > 0)
    order = sorted(range(len(f)), key=lambda i: -f[i])[:k]
    diff, i = m - sum(f), 0
    while diff:
        j = order[i % k]
        if diff > 0:
            step = max(1, min(diff, f[j] // 8 + 1)) if diff > k else 1
            f[j] += step
            diff -= step
        elif f[j] > 1:
            step = min(-diff, f[j] - 1, max(1, (f[j] - 1) // 8)) if -diff > k else 1
            f[j] -= step
            diff += step
        i += 1
    return f


def test_quantize_counts_by_hand():
    # [1e9, 1, 0, 3] at 12 bits: rounded 4096, 1 (raised from 0), 0, 1: 2 too many, taken from the largest
    assert rans.quantize_counts(np.array([1e9, 1, 0, 3]), 12).tolist() == [4094, 1, 0, 1]
    # [1, 1, 1] at 2 bits: 4/3 rounds to 1 each, one unit more goes to the first of the (tied) largest
    assert rans.quantize_counts(np.array([1, 1, 1]), 2).tolist() == [2, 1, 1]
    # [5, 1, 1, 1] at 2 bits: 2.5 rounds up to 3, the rest 0.5 up to 1: two too many, both from the 3
    f = rans.quantize_counts(np.array([5, 1, 1, 1]), 2)
    assert f.tolist() == [1, 1, 1, 1] and f.dtype == np.int64
    # exact shares stay: [1, 3] of 4
    assert rans.quantize_counts(np.array([1, 3]), 2).tolist() == [1, 3]
    # 0.5 rounds up: [1, 7] at 2 bits is 0.5 -> 1 and 3.5 -> 4: one too many, taken from the 4
    assert rans.quantize_counts(np.array([1, 7]), 2).tolist() == [1, 3]
    # [3, 5] at 3 bits: 3 and 5 exactly
    assert rans.quantize_counts(np.array([3, 5]), 3).tolist() == [3, 5]
    # only entries above 1 give: [6, 1, 1, 1, 1, 1, 1] at 3 bits rounds to 4, 1, ...: 2 too many, from the 4
    assert rans.quantize_counts(np.array([6, 1, 1, 1, 1, 1, 1]), 3).tolist() == [2, 1, 1, 1, 1, 1, 1]
    # 11 equal counts at 12 bits: 4096 / 11 = 372.36 rounds to 372, 4 short: one more each to the first four
    assert rans.quantize_counts(np.ones(11), 12).tolist() == [373] * 4 + [372] * 7
    # 6 equal counts: 682.67 rounds to 683, 2 too many: one less each from the first two
    assert rans.quantize_counts(np.full(6, 5), 12).tolist() == [682, 682] + [683] * 4
    # as many symbols as slots: every one gets 1
    assert rans.quantize_counts(np.array([100, 1, 1, 1]), 2).tolist() == [1, 1, 1, 1]
    assert rans.quantize_counts(np.array([0, 2, 0, 2]), 1).tolist() == [0, 1, 0, 1]


def test_quantize_counts_refusals():
    with pytest.raises(CodecError, match=exactly("cannot build a model from all-zero counts")):
        rans.quantize_counts(np.zeros(3), 12)
    with pytest.raises(CodecError, match=exactly("cannot build a model from all-zero counts")):
        rans.quantize_counts(np.array([0, -1]), 12)
    with pytest.raises(CodecError, match=exactly("5 symbols do not fit precision 2")):
        rans.quantize_counts(np.ones(5), 2)
    for bad in (np.nan, np.inf, -np.inf):  # a NaN share would cast to a huge int64 and the total never fix
        with pytest.raises(CodecError, match=exactly("counts must be finite numbers")):
            rans.quantize_counts(np.array([3.0, bad, 1.0]), 12)
    assert rans.quantize_counts(np.ones(4), 2).tolist() == [1, 1, 1, 1]  # exactly as many as fit
    assert rans.quantize_counts([2, -3, 2], 1).tolist() == [1, 0, 1]  # negatives count as absent, a list is taken


@pytest.mark.parametrize("seed", range(12))
def test_quantize_counts_equals_the_reference(seed):
    rng = np.random.default_rng(seed)
    a = int(rng.integers(2, 400))
    prec = int(rng.integers(max(1, math.ceil(math.log2(a))), 15))
    counts = rng.integers(0, 3, a) * rng.geometric(0.01, a) * (rng.random(a) < 0.7)
    counts[int(rng.integers(0, a))] = int(rng.integers(1, 10**6))
    if seed % 3 == 0:  # many ties among the largest
        counts[: a // 2] = 7
    f = rans.quantize_counts(counts, prec)
    assert f.dtype == np.int64 and f.tolist() == ref_quantize(counts, prec)
    assert int(f.sum()) == 1 << prec and ((f > 0) == (counts > 0)).all()


@pytest.mark.parametrize(
    ("counts", "prec"),
    [
        ([1000, -999, 1000], 12),
        ([50, 3, -40, 9, 1, 1], 10),
        ([7, -6, 1, 0, 2], 14),
        ([30, -7, -14, 11, -19], 5),
        ([22, -8, -1, -2, 17], 6),
    ],
)
def test_quantize_counts_with_negative_counts(counts, prec):
    """A negative count is absent but shrinks the total: the rounded shares overshoot 2**prec by more than k."""
    f = rans.quantize_counts(np.array(counts), prec)
    assert f.tolist() == ref_quantize(counts, prec)
    assert int(f.sum()) == 1 << prec and ((f > 0) == (np.array(counts) > 0)).all()


def test_min_bits_by_hand():
    # one table: max p = 3/4; two tables: the larger max p (4095/4096) gives the bound
    assert rans.min_bits(rans.Tables.build([rans.Categorical(np.array([1024, 3072]), 12)])) == -math.log2(0.75)
    two = rans.Tables.build(
        [rans.Categorical(np.array([2048, 1024, 1024]), 12), rans.Categorical(np.array([1, 4095]), 12)]
    )
    assert rans.min_bits(two) == -math.log2(4095 / 4096)
    # the max is over each table's own symbols (per row), not over a symbol across tables
    rows = rans.Tables.build([rans.Categorical(np.array([8, 8]), 4), rans.Categorical(np.array([12, 4]), 4)])
    assert rans.min_bits(rows) == -math.log2(12 / 16)
    assert rans.min_bits(rans.Tables.build([rans.Categorical(np.array([1, 1, 2]), 2)])) == 1.0
    assert isinstance(rans.min_bits(rows), float)


def test_check_budget_messages_and_bounds():
    half = rans.Tables.build([rans.Categorical(np.array([2048, 1024, 1024]), 12)])
    # n * streams * 1 bit <= 16 * words + 64 * streams + 64
    rans.check_budget(16 * 3 + 64 + 64, 1, 3, half, "x")  # 1 stream, 3 words: 176 symbols, at the bound
    with pytest.raises(CorruptChunk, match=exactly("x: symbol count inconsistent with payload size")):
        rans.check_budget(16 * 3 + 64 + 64 + 1, 1, 3, half, "x")
    rans.check_budget((16 * 3 + 64 * 3 + 64) // 3, 3, 3, half, "x")  # 3 streams of 101 symbols: 303 <= 304 bits
    with pytest.raises(CorruptChunk, match=exactly("blk: symbol count inconsistent with payload size")):
        rans.check_budget((16 * 3 + 64 * 3 + 64) // 3 + 1, 3, 3, half, "blk")
    rans.check_budget(0, 0, 0, half, "x")
    rans.check_budget(64, 1, 0, half, "x")
    rans.check_budget(128, 0, 0, half, "x")  # no streams: nothing to decode
    with pytest.raises(CorruptChunk, match=exactly("x: symbol count inconsistent with payload size")):
        rans.check_budget(129, 1, 0, half, "x")


@pytest.mark.parametrize(("configured", "expected"), [(1, 1), (2, 2), (3, 2), (16, 2), (0, 1)])
def test_num_threads_default(monkeypatch, configured, expected):
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", configured)
    assert rans.num_threads_default() == expected


# -- the entry points cast their index arrays (the codec passes float64 row shifts and indexes) --------


def test_entry_points_take_integral_float_indexes_lengths_and_shifts():
    """Table indexes, stream lengths and row shifts are cast to int64: integral float64 arrays work alike."""
    for prec, a in ((12, 10), (14, 300)):  # the packed and the generic kernels
        rng = np.random.default_rng(a)
        models = [rans.Categorical.from_counts(rng.integers(1, 9, a), prec) for _ in range(3)]
        t = rans.Tables.build(models)
        sym = rng.integers(0, a, size=(6, 4)).astype(t.symbol_dtype)
        idx = np.array([0, 2, 1, 1])
        words, lengths = rans.encode_columns(sym, idx.astype(np.float64), t)
        assert words.tolist() == rans.encode_columns(sym, idx, t)[0].tolist()
        back = rans.decode_columns(words, lengths.astype(np.float64), 6, idx.astype(np.float64), t)
        assert np.array_equal(back, sym)
        shift = np.array([0, 1, -1, 0, 1, 0])
        il = rans.encode_interleaved(sym, np.ones(4), t, row_shift=shift.astype(np.float64))
        assert il.tolist() == ref_interleaved(sym, [1, 1, 1, 1], [m.freqs for m in models], prec, shift)
        back = rans.decode_interleaved(il, 6, np.ones(4), t, row_shift=shift.astype(np.float64))
        assert np.array_equal(back, sym)


def test_interleaved_words_are_taken_modulo_2_16_on_both_decoders():
    """Words given as int64 are cut to 16 bits (as the uint16 stream they stand for) by either decoder."""
    for prec, a in ((12, 10), (14, 300)):
        t = rans.Tables.build([rans.Categorical.from_counts(np.arange(1, a + 1), prec)])
        sym = np.random.default_rng(2).integers(0, a, size=(8, 5)).astype(t.symbol_dtype)
        words = rans.encode_interleaved(sym, np.zeros(5, np.int64), t)
        wide = words.astype(np.int64) + (1 << 16)
        assert np.array_equal(rans.decode_interleaved(wide, 8, np.zeros(5, np.int64), t), sym)


def test_tables_without_an_encoder_table():
    """A Tables built by hand without ``fc``: the encoder computes freq | cum << 16 itself."""
    import dataclasses

    rng = np.random.default_rng(6)
    models = [rans.Categorical.from_counts(rng.integers(1, 9, 12), 12) for _ in range(2)]
    t = dataclasses.replace(rans.Tables.build(models), fc=None)
    sym = rng.integers(0, 12, size=(5, 3)).astype(np.uint8)
    words = rans.encode_interleaved(sym, np.array([0, 1, 1]), t)
    assert words.tolist() == ref_interleaved(sym, [0, 1, 1], [m.freqs for m in models], 12)
    assert np.array_equal(rans.decode_interleaved(words, 5, np.array([0, 1, 1]), t), sym)
