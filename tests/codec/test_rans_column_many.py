"""``rans.decode_column_many``: many one-column streams (a chunk's step multipliers) in one call,
against :func:`rans.decode_interleaved` of each stream, which the oracle tests check."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachegen.codec import rans
from cachegen.errors import CodecError, CorruptChunk

ZERO = np.zeros(1, np.int64)


def _tables(rng, alphabet: int, prec: int) -> rans.Tables:
    counts = 1 + (rng.dirichlet(np.full(alphabet, rng.uniform(0.1, 3))) * 4000).astype(np.int64)
    return rans.Tables.build([rans.Categorical.from_counts(counts, prec)])


def _streams(rng, tables: rans.Tables, counts: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    f = tables.freq[0].astype(np.float64)
    syms = [rng.choice(f.size, size=n, p=f / f.sum()).astype(tables.symbol_dtype) for n in counts]
    return [rans.encode_interleaved(s[:, None], ZERO, tables) for s in syms], syms


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=40), st.integers(0, 2**31), st.sampled_from([9, 12, 14]))
def test_every_stream_decodes_as_decode_interleaved_decodes_it(counts, seed, prec):
    """Any number of streams of any length, empty ones among them, at any precision."""
    rng = np.random.default_rng(seed)
    tables = _tables(rng, int(rng.integers(2, 40)), prec)
    words, syms = _streams(rng, tables, counts)
    out = rans.decode_column_many(words, counts, tables)
    assert len(out) == len(counts)
    for o, w, s, n in zip(out, words, syms, counts, strict=True):
        assert o.shape == (n,) and o.dtype == tables.symbol_dtype
        assert np.array_equal(o, s)
        assert np.array_equal(o, rans.decode_interleaved(w, n, ZERO, tables)[:, 0])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31))
def test_a_damaged_stream_is_refused_exactly_when_decode_interleaved_refuses_it(seed):
    """One stream among others replaced, cut or lengthened: refused (naming that stream) iff the
    one-stream decoder refuses it; otherwise its symbols are that decoder's."""
    rng = np.random.default_rng(seed)
    tables = _tables(rng, 7, 12)
    counts = [int(n) for n in rng.integers(1, 60, int(rng.integers(1, 8)))]
    words, syms = _streams(rng, tables, counts)
    hit = int(rng.integers(0, len(words)))
    w = words[hit].copy()
    kind = int(rng.integers(0, 3))
    if kind == 0:
        w[int(rng.integers(0, w.size))] ^= np.uint16(1 + rng.integers(0, 0xFFFF))
    elif kind == 1:
        w = w[: max(2, w.size - int(rng.integers(1, 4)))]
    else:
        w = np.append(w, np.uint16(rng.integers(0, 1 << 16)))
    words[hit] = w
    try:
        want = rans.decode_interleaved(w, counts[hit], ZERO, tables)[:, 0]
    except CorruptChunk:
        with pytest.raises(CorruptChunk, match=f"^corrupt chunk: rANS stream {hit} did not end in the initial state$"):
            rans.decode_column_many(words, counts, tables)
        return
    out = rans.decode_column_many(words, counts, tables)
    assert np.array_equal(out[hit], want)
    assert all(np.array_equal(o, s) for k, (o, s) in enumerate(zip(out, syms)) if k != hit)


def test_the_first_bad_stream_is_named_when_several_are():
    rng = np.random.default_rng(3)
    tables = _tables(rng, 5, 12)
    words, _ = _streams(rng, tables, [30, 30, 30, 30])
    words[1] = np.append(words[1], np.uint16(9))
    words[3] = np.append(words[3], np.uint16(9))
    with pytest.raises(CorruptChunk, match="rANS stream 1 did not end"):
        rans.decode_column_many(words, [30] * 4, tables)
    # an empty stream before it does not shift the index
    with pytest.raises(CorruptChunk, match="rANS stream 2 did not end"):
        rans.decode_column_many([np.empty(0, np.uint16), words[0], words[1]], [0, 30, 30], tables)


def test_inconsistent_sizes_are_refused_before_anything_is_decoded():
    rng = np.random.default_rng(4)
    tables = _tables(rng, 5, 12)
    words, _ = _streams(rng, tables, [10, 10])
    with pytest.raises(CorruptChunk, match=r"^corrupt chunk: empty block with a non-empty rANS stream$"):
        rans.decode_column_many(words, [10, 0], tables)
    with pytest.raises(CorruptChunk, match=r"^corrupt chunk: empty block with a non-empty rANS stream$"):
        rans.decode_column_many([words[0][:1]], [0], tables)  # one word is not empty either
    with pytest.raises(CorruptChunk, match=r"^corrupt chunk: rANS stream shorter than its states$"):
        rans.decode_column_many([words[0], words[1][:1]], [10, 10], tables)
    with pytest.raises(CorruptChunk, match=r"^corrupt chunk: rANS stream shorter than its states$"):
        rans.decode_column_many([words[0][:1]], [1], tables)  # a state is two words, whatever the count
    with pytest.raises(CodecError, match=r"^need one symbol count per stream$"):
        rans.decode_column_many(words, [10], tables)
    with pytest.raises(CodecError, match=r"^negative symbol count$"):
        rans.decode_column_many(words, [10, -1], tables)
    assert rans.decode_column_many([], [], tables) == []
