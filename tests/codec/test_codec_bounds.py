"""Bounded decoding, chunks bound to their keys, finite values (issue 14, items 1 and 2)."""

from __future__ import annotations

import dataclasses
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

from cachegen.codec import LOSSLESS, Codec, calibrate
from cachegen.codec.codec import LOSSLESS_MAX_FREQ
from cachegen.codec.container import FORMAT_VERSION, ChunkHeader, LayerShape, key_digest, pack_header, parse_header
from cachegen.errors import CodecError, ConfigError, CorruptChunk, KeyMismatch
from cachegen.kv import KVCache, KVLayer, LayerKind

KEY = "0123456789abcdef" * 2


def _kv(seed=0, layers=2, heads=3, tokens=40, dim=16, start=0, dtype=torch.float32) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache(
        [
            KVLayer(
                (torch.randn(heads, tokens, dim, generator=g) + i).to(dtype),
                (torch.randn(heads, tokens, dim, generator=g) * 0.3).to(dtype),
                LayerKind.FULL,
                None,
            )
            for i in range(layers)
        ],
        start=start,
    )


@pytest.fixture(scope="module")
def profile():
    return calibrate([_kv(10), _kv(11)], "fp-bounds")


def _lossless_bomb(tokens: int, layers: int = 1, heads: int = 3, dim: int = 64, freq_top: int = 4096) -> bytes:
    """A VALID lossless chunk (correct checksums, consistent streams) claiming ``tokens`` tokens of fp32: every byte
    plane's table gives symbol 0 probability ``freq_top / 4096`` (1 by default), so each stream is its 2-word initial
    state, which decodes to any number of zeros."""
    c = heads * dim
    f = np.zeros(256, dtype="<u2")
    f[0], f[1] = freq_top, 4096 - freq_top
    plane = (
        f.tobytes()
        + struct.pack("<I", 2 * c)
        + np.full(c, 2, "<u4").tobytes()
        + np.tile(np.array([1, 0], "<u2"), c).tobytes()
    )
    sec = struct.pack("<B", 4) + plane * 4
    secs = [sec] * (2 * layers)
    h = ChunkHeader(
        FORMAT_VERSION,
        "",
        "",
        LOSSLESS,
        key_digest(KEY),
        0,
        tokens,
        torch.float32,
        tuple(LayerShape(LayerKind.FULL, None, heads, dim, dim) for _ in range(layers)),
        0,
        False,
        tuple(len(s) for s in secs),
        tuple(zlib.crc32(s) for s in secs),
        0,
    )
    return pack_header(h) + b"".join(secs)


def _peak_mb(fn) -> float:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 2**20


def test_decompression_bomb_is_refused_from_the_header_with_little_memory(profile):
    bomb = _lossless_bomb(4_194_304)
    assert len(bomb) < 30_000 and parse_header(bomb).num_tokens == 4_194_304  # valid: its checksums hold
    smol_like = calibrate([_kv(12, layers=1, heads=3, dim=64)], "fp-bounds")
    for codec in (Codec(None, threads=1), Codec(smol_like, threads=1), Codec(None, threads=1, max_tokens=1 << 24)):

        def dec(codec=codec):
            with pytest.raises(CorruptChunk):
                codec.decode(bomb, key=KEY)

        assert _peak_mb(dec) < 50


def test_lossless_size_is_bounded_independently_of_the_chunks_own_table():
    codec = Codec(None, threads=1)
    for tokens in (codec.max_tokens, 4096):  # within max_tokens: the table itself is refused
        with pytest.raises(CorruptChunk, match="lossless table"):
            codec.decode(_lossless_bomb(tokens))
    # the most skewed table an encoder writes still bounds the size by the payload
    with pytest.raises(CorruptChunk, match="payload size"):
        codec.decode(_lossless_bomb(codec.max_tokens, freq_top=LOSSLESS_MAX_FREQ))

    def skewed():
        with pytest.raises(CorruptChunk):
            codec.decode(_lossless_bomb(codec.max_tokens, freq_top=LOSSLESS_MAX_FREQ))

    assert _peak_mb(skewed) < 50


def test_constant_planes_still_round_trip_under_the_table_cap():
    kv = _kv(1)
    for layer in kv.layers:
        layer.k.zero_()  # constant planes: the top symbol is capped, still bit-exact
    codec = Codec(None, threads=1)
    out = codec.decode(codec.encode(kv, LOSSLESS))
    assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(kv.layers, out.layers))


def _with_header(data: bytes, **changes) -> bytes:
    h = parse_header(data)
    secs = [data[o : o + n] for o, n in zip(h.section_offsets(), h.section_lengths)]
    return pack_header(dataclasses.replace(h, **changes)) + b"".join(secs)


@pytest.mark.parametrize("level", [LOSSLESS, 3])
def test_header_fields_are_bounded(profile, level):
    codec = Codec(profile, threads=1)
    data = codec.encode(_kv(2, start=5), level, key=KEY)
    for start in (1 << 63, (1 << 64) - 1, (1 << 24) - 10, 1 << 40):
        with pytest.raises(CorruptChunk):
            codec.decode(_with_header(data, start=start), key=KEY)
    with pytest.raises(CorruptChunk, match="tokens"):
        Codec(profile, threads=1, max_tokens=16).decode(data)
    shape = parse_header(data).layers[0]
    for bad in (
        dataclasses.replace(shape, heads=4),
        dataclasses.replace(shape, k_dim=8),
        dataclasses.replace(shape, v_dim=32),
    ):
        with pytest.raises(CorruptChunk, match="layout"):
            codec.decode(_with_header(data, layers=(bad, *parse_header(data).layers[1:])))


def test_encoder_refuses_what_a_decoder_would(profile):
    codec = Codec(profile, threads=1, max_tokens=32)
    with pytest.raises(ConfigError):
        codec.encode(_kv(3, tokens=40), 2)
    with pytest.raises(ConfigError):
        Codec(profile).encode(_kv(3, start=(1 << 24) - 8), 2)
    kv = _kv(3)
    kv.layers[1].v[0, 3, 2] = float("inf")
    for level in (LOSSLESS, 2):
        with pytest.raises(CodecError):
            Codec(profile).encode(kv, level)


@pytest.mark.parametrize("level", [LOSSLESS, 1, 5])
def test_chunks_are_bound_to_their_keys(profile, level):
    codec = Codec(profile, threads=1)
    kv = _kv(4)
    data = codec.encode(kv, level, key=KEY)
    assert codec.decode(data, key=KEY).num_tokens == kv.num_tokens
    assert codec.decode(data).num_tokens == kv.num_tokens  # no key given: no check
    for other in ("f" * 32, KEY[:-1] + "e", ""):
        with pytest.raises(KeyMismatch):
            codec.decode(data, key=other)
    with pytest.raises(KeyMismatch):  # a chunk written without a key is not any key's chunk
        codec.decode(codec.encode(kv, level), key=KEY)
    # the digest is covered by the header checksum: a flipped digest byte is a corrupt chunk
    h = parse_header(data)
    off = 8 + 4 + len(h.model_fingerprint) + 16  # magic, version, length; fixed fields; fingerprint; profile id
    b = bytearray(data)
    b[off] ^= 1
    with pytest.raises(CorruptChunk):
        codec.decode(bytes(b), key=KEY)
    assert codec.peek(data).key_digest == key_digest(KEY)


def _section_edit(data: bytes, i: int, edit) -> bytes:
    h = parse_header(data)
    secs = [bytearray(data[o : o + n]) for o, n in zip(h.section_offsets(), h.section_lengths)]
    edit(secs[i])
    secs = [bytes(s) for s in secs]
    h = dataclasses.replace(h, section_lengths=tuple(map(len, secs)), section_crcs=tuple(zlib.crc32(s) for s in secs))
    return pack_header(h) + b"".join(secs)


@pytest.mark.parametrize(
    "dtype,nan", [(torch.float32, b"\x00\x00\xc0\x7f"), (torch.float16, b"\x00\x7c"), (torch.bfloat16, b"\x80\x7f")]
)
def test_non_finite_values_are_corrupt(profile, dtype, nan):
    codec = Codec(profile, threads=1)
    kv = _kv(5, start=0, dtype=dtype)
    lossy = codec.encode(kv, 2)

    def sink_nan(s):  # the first raw sink value of the section (after its u32 length)
        s[4 : 4 + len(nan)] = nan

    with pytest.raises(CorruptChunk, match="non-finite"):
        codec.decode(_section_edit(lossy, 1, sink_nan))

    def huge_escape(s):  # every escape of a section at +2^31-1
        ns = struct.unpack_from("<I", s, 0)[0]
        ne = struct.unpack_from("<I", s, 4 + ns)[0]
        for j in range(ne):
            struct.pack_into("<i", s, 8 + ns + 4 * j, 2**31 - 1)

    kv2 = _kv(6, dtype=dtype)
    kv2.layers[0].k[:, 10:, :] *= 1e3  # values far outside the profile's range: escapes
    esc = codec.encode(kv2, 7)
    n_esc = [
        struct.unpack_from("<I", s, 4 + struct.unpack_from("<I", s, 0)[0])[0]
        for s in (
            esc[o : o + n] for o, n in zip(parse_header(esc).section_offsets(), parse_header(esc).section_lengths)
        )
    ]
    assert n_esc[0] > 0
    if dtype == torch.float16:  # 2^31 steps overflow fp16 (fp32 and bf16 hold them: finite, only wrong)
        with pytest.raises(CorruptChunk, match="non-finite"):
            codec.decode(_section_edit(esc, 0, huge_escape))
    else:
        out = codec.decode(_section_edit(esc, 0, huge_escape))
        assert all(bool(torch.isfinite(layer.k).all()) for layer in out.layers)


def test_lossless_nan_payload_is_corrupt(profile):
    """A lossless chunk whose (re-encoded) payload holds a NaN: valid streams, non-finite value."""
    codec = Codec(profile, threads=1)
    kv = _kv(7)
    good = codec.encode(kv, LOSSLESS)
    bad_kv = _kv(7)
    bad_kv.layers[0].v[1, 2, 3] = float("nan")
    from cachegen.codec.codec import _encode_lossless

    h = parse_header(good)
    secs = [good[o : o + n] for o, n in zip(h.section_offsets(), h.section_lengths)]
    secs[1] = _encode_lossless(bad_kv.layers[0].v)
    h = dataclasses.replace(h, section_lengths=tuple(map(len, secs)), section_crcs=tuple(zlib.crc32(s) for s in secs))
    with pytest.raises(CorruptChunk, match="non-finite"):
        codec.decode(pack_header(h) + b"".join(secs))
