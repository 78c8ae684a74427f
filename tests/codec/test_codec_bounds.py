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
from cachegen.codec.container import (
    FORMAT_VERSION,
    MAX_POSITION,
    ChunkHeader,
    LayerShape,
    key_digest,
    pack_header,
    parse_header,
)
from cachegen.errors import CodecError, ConfigError, CorruptChunk, KeyMismatch, ProfileMismatch
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


# -- the codec's own argument and consistency checks, each at its bound ----------------------------


def test_codec_arguments(profile):
    for bad in (0, -1, MAX_POSITION + 1):
        with pytest.raises(ConfigError, match="max_tokens must be"):
            Codec(max_tokens=bad)
    assert Codec(max_tokens=1).max_tokens == 1 and Codec(max_tokens=MAX_POSITION).max_tokens == MAX_POSITION
    assert (
        Codec(profile).model_fingerprint
        == "fp-bounds"
        == Codec(profile, model_fingerprint="fp-bounds").model_fingerprint
    )
    assert Codec(None, model_fingerprint="m").model_fingerprint == "m" and Codec().model_fingerprint == ""
    with pytest.raises(ProfileMismatch, match="profile is for model fp-bounds, codec for other"):
        Codec(profile, model_fingerprint="other")
    anon = calibrate([_kv(10)], "")
    assert Codec(anon, model_fingerprint="any").model_fingerprint == "any"  # a profile without a model: no check
    assert Codec(profile).levels == (0, 1, 2, 3, 4, 5, 6, 7) == Codec().levels
    assert Codec(calibrate([_kv(10)], "fp", levels=[5, 2])).levels == (0, 2, 5)
    for threads in (0, 1, 3):  # any thread count gives the same bytes
        assert Codec(profile, threads=threads).encode(_kv(1), 3) == Codec(profile).encode(_kv(1), 3)


def test_encoder_checks_at_their_bounds(profile):
    codec = Codec(profile, threads=1, max_tokens=40)
    codec.encode(_kv(3, tokens=40), 2)  # exactly max_tokens
    with pytest.raises(ConfigError, match="a chunk of 41 tokens is over this codec's max_tokens \\(40\\)"):
        codec.encode(_kv(3, tokens=41), 2)
    assert parse_header(codec.encode(_kv(3, start=MAX_POSITION - 40), 2)).start == MAX_POSITION - 40
    for start in (MAX_POSITION - 39, -1):
        with pytest.raises(ConfigError, match=f"chunk start {start} out of range"):
            codec.encode(_kv(3, start=start), 2)
    with pytest.raises(ConfigError, match=r"unsupported dtype torch\.float64"):
        codec.encode(_kv(3, dtype=torch.float64), 2)
    mixed = _kv(3)
    mixed.layers[1] = KVLayer(mixed.layers[1].k.half(), mixed.layers[1].v.half(), LayerKind.FULL, None)
    with pytest.raises(ConfigError, match="share one dtype"):
        codec.encode(mixed, 2)
    half_v = _kv(3)
    half_v.layers[0] = KVLayer(half_v.layers[0].k, half_v.layers[0].v.half(), LayerKind.FULL, None)
    with pytest.raises(ConfigError, match="share one dtype"):
        codec.encode(half_v, 2)
    with pytest.raises(ConfigError, match="level 4 not in the profile"):
        Codec(calibrate([_kv(10)], "fp-bounds", levels=[3])).encode(_kv(3), 4)
    for level in (8, -1):
        with pytest.raises(ConfigError, match=f"unknown level {level}"):
            Codec().encode(_kv(3), level)
    for bad_kv in (_kv(3, heads=2), _kv(3, layers=3)):
        with pytest.raises(ConfigError, match="does not match the profile"):
            codec.encode(bad_kv, 2)


def test_decoder_checks_the_header_against_codec_and_profile(profile):
    codec = Codec(profile, threads=1)
    kv = _kv(8, start=2)
    lossy = codec.encode(kv, 3)
    out = codec.decode(lossy)
    assert out.start == 2 and out.meta == {"model_fingerprint": "fp-bounds"}
    # exactly max_tokens decodes; one more is refused from the header
    assert Codec(profile, max_tokens=40).decode(lossy).num_tokens == 40
    with pytest.raises(CorruptChunk, match="chunk claims 40 tokens, this codec takes at most 39"):
        Codec(profile, max_tokens=39).decode(lossy)
    # model fingerprints: both set and different is a mismatch; an empty one on either side is not
    with pytest.raises(ProfileMismatch, match="chunk is for model other, this codec for fp-bounds"):
        codec.decode(_with_header(lossy, model_fingerprint="other"))
    lossless = Codec(None, model_fingerprint="a").encode(kv, LOSSLESS)
    assert Codec(None, model_fingerprint="").decode(lossless).num_tokens == 40
    assert Codec(None, model_fingerprint="b").decode(_with_header(lossless, model_fingerprint="")).num_tokens == 40
    with pytest.raises(ProfileMismatch):
        Codec(None, model_fingerprint="b").decode(lossless)
    with pytest.raises(CorruptChunk, match="lossless chunk names a profile"):
        codec.decode(_with_header(Codec(profile).encode(kv, LOSSLESS), profile_id=profile.id))
    with pytest.raises(CorruptChunk, match="lossy chunk names no profile"):
        codec.decode(_with_header(lossy, profile_id=""))
    with pytest.raises(ProfileMismatch, match="pass that profile to Codec"):
        Codec().decode(lossy)
    small = calibrate([_kv(10), _kv(11)], "fp-bounds", levels=[3])
    with pytest.raises(CorruptChunk, match="level 5 not in the profile"):
        Codec(small).decode(_with_header(Codec(small).encode(kv, 3), level=5))
    with pytest.raises(CorruptChunk, match="sink token count inconsistent"):
        codec.decode(_with_header(Codec(profile).encode(_kv(8, start=0), 3), sink_tokens=3))
    assert parse_header(Codec(profile).encode(_kv(8, start=0), 3)).sink_tokens == 4
    assert parse_header(Codec(profile).encode(_kv(8, start=3), 3)).sink_tokens == 1
    assert parse_header(Codec(profile).encode(_kv(8, start=4), 3)).sink_tokens == 0
    assert parse_header(Codec(profile).encode(_kv(8, start=0, tokens=2), 3)).sink_tokens == 2


def test_inline_profile_chunks_are_checked_against_their_own_tables():
    codec = Codec(None, threads=1)
    kv = _kv(9)
    data = codec.encode(kv, 4)
    h = parse_header(data)
    assert h.inline_profile and h.profile_id == "" and len(h.section_lengths) == 2 * len(kv.layers) + 1
    with pytest.raises(CorruptChunk, match="inline profile lacks the chunk's level"):
        codec.decode(_with_header(data, level=5))
    shape = h.layers[0]
    wide = dataclasses.replace(shape, heads=shape.heads + 1)
    with pytest.raises(CorruptChunk, match="chunk layout does not match its profile"):
        codec.decode(_with_header(data, layers=(wide, *h.layers[1:])))
    with pytest.raises(CorruptChunk, match="chunk claims 536870912 values, over 134217728"):
        Codec(None, max_tokens=1 << 22).decode(_lossless_bomb(1 << 16, heads=64, dim=64))  # no profile: a value cap


def test_lossless_sections_are_parsed_strictly(profile):
    codec = Codec(None, threads=1)
    data = codec.encode(_kv(12), LOSSLESS)
    with pytest.raises(CorruptChunk, match="section 0: element size mismatch"):
        codec.decode(_with_header(data, dtype=torch.float16))
    with pytest.raises(CorruptChunk, match="section 1: 1 trailing bytes"):
        codec.decode(_section_edit(data, 1, lambda s: s.extend(b"\0")))
    with pytest.raises(CorruptChunk, match="section 1: truncated"):
        codec.decode(_section_edit(data, 1, lambda s: s.__delitem__(slice(-2, None))))
    # the tables an encoder writes: 4096 in all, no symbol above the cap, even for a constant plane
    kv = _kv(13)
    kv.layers[0].k.fill_(1.0)
    d2 = codec.encode(kv, LOSSLESS)
    h = parse_header(d2)
    sec = d2[h.section_offsets()[0] : h.section_offsets()[0] + h.section_lengths[0]]
    assert sec[0] == 4
    pos, c = 1, 3 * 16
    for _ in range(4):
        f = np.frombuffer(sec[pos : pos + 512], dtype="<u2")
        assert int(f.sum()) == 4096 and int(f.max()) <= LOSSLESS_MAX_FREQ and (f > 0).sum() >= 2
        nw = struct.unpack_from("<I", sec, pos + 512)[0]
        pos += 512 + 4 + 4 * c + 2 * nw
    assert pos == len(sec)
    assert torch.equal(codec.decode(d2).layers[0].k, kv.layers[0].k)


def _lossy_fields(sec: bytes) -> tuple[int, int]:
    """(sink bytes, escapes) of a lossy section without multipliers."""
    ns = struct.unpack_from("<I", sec, 0)[0]
    return ns, struct.unpack_from("<I", sec, 4 + ns)[0]


def test_lossy_sections_are_parsed_strictly(profile):
    codec = Codec(profile, threads=1)
    kv = _kv(14, start=1)
    kv.layers[0].k[:, 10:20] *= 1e3  # escapes in section 0
    data = codec.encode(kv, 6)
    h = parse_header(data)
    sec0 = data[h.section_offsets()[0] : h.section_offsets()[0] + h.section_lengths[0]]
    ns, ne = _lossy_fields(sec0)
    assert ns == 3 * 3 * 16 * 4 and ne > 0  # heads * sink tokens * dim * fp32 bytes

    def grow_sink(s):
        struct.pack_into("<I", s, 0, ns + 4)

    with pytest.raises(CorruptChunk, match="section 0: sink size mismatch"):
        codec.decode(_section_edit(data, 0, grow_sink))

    def count(n):
        return lambda s: struct.pack_into("<I", s, 4 + ns, n)

    t, c = 40 - 3, 3 * 16
    with pytest.raises(CorruptChunk, match="section 0: escape count out of range"):
        codec.decode(_section_edit(data, 0, count(t * c + 1)))
    with pytest.raises(CorruptChunk, match="section 0: truncated"):  # t * c escapes: allowed, but not there
        codec.decode(_section_edit(data, 0, count(t * c)))

    def one_escape_fewer(s):
        count(ne - 1)(s)
        del s[8 + ns : 12 + ns]

    with pytest.raises(CorruptChunk, match=f"section 0: {ne} escapes in the stream, {ne - 1} stored"):
        codec.decode(_section_edit(data, 0, one_escape_fewer))
    with pytest.raises(CorruptChunk, match="section 0: odd word payload"):
        codec.decode(_section_edit(data, 0, lambda s: s.extend(b"\0")))
    with pytest.raises(CorruptChunk, match=r"section 0: symbol count inconsistent|shorter than its states"):
        codec.decode(_section_edit(data, 0, lambda s: s.__delitem__(slice(8 + ns + 4 * ne, None))))


def test_lossless_size_bound_is_exact():
    """A symbol costs >= 1/8 bit under any table an encoder writes, so a section's streams of ``nw``
    words (c columns) hold at most ``8 * (16 nw + 64 c + 64) / c`` tokens: 1024 here (c = 2, each
    stream its 2-word state). One token more is refused from the sizes alone, before decoding."""
    codec = Codec(None, threads=1)
    with pytest.raises(CorruptChunk) as at_bound:
        codec.decode(_lossless_bomb(1024, heads=1, dim=2, freq_top=LOSSLESS_MAX_FREQ))
    assert "payload size" not in str(at_bound.value)  # within the bound: the streams themselves are refused
    with pytest.raises(CorruptChunk, match="section 0: symbol count inconsistent with payload size"):
        codec.decode(_lossless_bomb(1025, heads=1, dim=2, freq_top=LOSSLESS_MAX_FREQ))
