"""Each baseline's round trip and size accounting on small random KV caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachegen.bench import baselines as B
from cachegen.codec import ChunkCodec
from cachegen.codec.container import Reader
from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import KVCache, KVLayer, LayerKind


def _kv(layers=3, heads=2, tokens=70, dk=64, dv=64, start=0, seed=0, sliding=False) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        # channels of very different scales, like real keys
        k = torch.randn(heads, tokens, dk, generator=g) * (0.1 + 4 * torch.rand(1, 1, dk, generator=g))
        v = torch.randn(heads, tokens, dv, generator=g)
        kind = LayerKind.SLIDING if sliding and i % 2 else LayerKind.FULL
        out.append(KVLayer(k, v, kind, 8 if kind == LayerKind.SLIDING else None))
    return KVCache(out, start=start)


def _layout_equal(a: KVCache, b: KVCache) -> None:
    assert b.start == a.start and b.num_tokens == a.num_tokens and b.same_layout(a)
    for x, y in zip(a.layers, b.layers):
        assert y.k.shape == x.k.shape and y.v.shape == x.v.shape and y.k.dtype == torch.float32


def _maxerr(a: KVCache, b: KVCache) -> float:
    return max(max(float((x.k - y.k).abs().max()), float((x.v - y.v).abs().max())) for x, y in zip(a.layers, b.layers))


ALL = ["fp16", "bf16", "uniform8", "uniform4", "kivi2", "kivi4", "cachegen-released"]


@pytest.mark.parametrize("v", B.make_codecs(ALL), ids=lambda v: v.label)
def test_roundtrip_keeps_layout_and_start(v):
    kv = _kv(start=512, sliding=True)
    data = v.codec.encode(kv, v.level)
    assert isinstance(data, bytes)
    back = v.codec.decode(data)
    _layout_equal(kv, back)
    assert [l.kind for l in back.layers] == [l.kind for l in kv.layers]
    assert [l.window for l in back.layers] == [l.window for l in kv.layers]


def test_raw_is_exact_cast_and_sized():
    kv = _kv()
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        c = B.RawCodec(name)
        data = c.encode(kv)
        assert len(data) == B.header_size(name, kv.num_layers) + 2 * kv.num_values
        back = c.decode(data)
        for x, y in zip(kv.layers, back.layers):
            assert torch.equal(y.k, x.k.to(dt).float()) and torch.equal(y.v, x.v.to(dt).float())


@pytest.mark.parametrize("bits", [8, 4])
def test_uniform_error_and_size(bits):
    kv = _kv(tokens=37)
    c = B.UniformCodec(bits)
    data = c.encode(kv)
    per = 0
    for l in kv.layers:
        for t in (l.k, l.v):
            h, n, d = t.shape
            per += h * d * 2 * 2 + B.packed_len(h * n * d, bits)  # fp16 min + step per channel, packed codes
    assert len(data) == B.header_size(c.name, kv.num_layers) + per
    back = c.decode(data)
    for x, y in zip(kv.layers, back.layers):
        for a, b in ((x.k, y.k), (x.v, y.v)):
            rng = a.amax(dim=1, keepdim=True) - a.amin(dim=1, keepdim=True)
            step = rng / (2**bits - 1)
            assert bool(((a - b).abs() <= step * 0.5 + 2e-3 * rng + 1e-3).all())


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("tokens,dim", [(64, 64), (45, 48)])
def test_kivi_groups_error_and_size(bits, tokens, dim):
    kv = _kv(tokens=tokens, dk=dim, dv=dim)
    c = B.KiviCodec(bits)
    data = c.encode(kv)
    per = 0
    for l in kv.layers:
        h, n, d = l.k.shape
        per += h * -(-n // 32) * d * 4 + B.packed_len(h * n * d, bits)  # K: groups of 32 tokens per channel
        per += h * n * -(-d // 32) * 4 + B.packed_len(h * n * d, bits)  # V: groups of 32 channels per token
    assert len(data) == B.header_size(c.name, kv.num_layers) + per
    back = c.decode(data)
    levels = 2**bits - 1
    for x, y in zip(kv.layers, back.layers):
        h, n, d = x.k.shape
        # K: per channel within 32-token groups
        for a in range(0, n, 32):
            g, r = x.k[:, a : a + 32], y.k[:, a : a + 32]
            step = (g.amax(1, keepdim=True) - g.amin(1, keepdim=True)) / levels
            assert bool(((g - r).abs() <= step * 0.5 * 1.01 + 2e-2).all())
        # V: per token within 32-channel groups
        for a in range(0, d, 32):
            g, r = x.v[:, :, a : a + 32], y.v[:, :, a : a + 32]
            step = (g.amax(2, keepdim=True) - g.amin(2, keepdim=True)) / levels
            assert bool(((g - r).abs() <= step * 0.5 * 1.01 + 2e-2).all())
    # KIVI-4 is finer than KIVI-2
    if bits == 4:
        assert _maxerr(kv, back) < _maxerr(kv, B.KiviCodec(2).decode(B.KiviCodec(2).encode(kv, 0)))


def test_released_bins_per_level_and_layer():
    l1, l2, l3 = (B.RELEASED_LEVELS[i] for i in (1, 2, 3))
    assert [l2.key_bins(i) for i in (0, 9, 10, 19, 20, 29)] == [32, 32, 16, 16, 16, 16]
    assert [l2.value_bins(i) for i in (0, 1, 2, 29)] == [32, 32, 16, 16]
    assert [l1.key_bins(i) for i in (0, 9, 10, 19, 20, 29)] == [16, 16, 16, 16, 12, 12]
    assert [l1.value_bins(i) for i in (0, 1, 2, 29)] == [16, 16, 12, 12]
    assert {l3.key_bins(i) for i in range(40)} == {l3.value_bins(i) for i in range(40)} == {32}


def test_released_quantizer_is_symmetric_absmax_per_token():
    x = np.array([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    q, mx = B.released_quantize(x, 32)  # C = 15
    assert mx.tolist() == [2.0, 0.0]
    assert (
        q[0].tolist() == [15 + 8, 0, 15 + 4, 15] and q[1].tolist() == [15] * 4
    )  # round(1*15/2)=8 (half to even: 7.5->8)
    back = B.released_dequantize(q, mx, 32)
    assert np.allclose(back[0], [8 / 15 * 2, -2, 4 / 15 * 2, 0]) and (back[1] == 0).all()


def test_released_cdf_table_format():
    q = np.array([[0, 3], [0, 3], [1, 3], [30, 3]], np.uint8)
    cdf = B.released_cdf(q)
    assert cdf.shape == (2, 33) and cdf.dtype == np.uint16
    assert (np.diff(cdf.astype(int), axis=1) >= 1).all()  # every symbol codable
    assert cdf[:, 0].tolist() == [0, 0] and cdf[:, -1].tolist() == [65535, 65535]
    f = B._cdf_to_freqs(cdf)
    assert (f.sum(axis=1) == 1 << B.RANS_PRECISION).all() and (f >= 1).all()
    assert f[0, 0] > f[0, 1] > f[0, 2] and f[1, 3] == f[1].max()


@pytest.mark.parametrize("level", [1, 2, 3])
def test_released_size_counts_tables_scales_and_streams(level):
    kv = _kv(layers=2, heads=3, tokens=300, dk=64, dv=64)  # one full 256-token chunk and a 44-token one
    c = B.CacheGenReleasedCodec()
    data = c.encode(kv, level)
    # walk the format: header, then per chunk, layer, K/V: CDFs, scales, stream lengths, words
    r = Reader(memoryview(data), "test")
    B._read_header(r, c.name)
    tables = 0
    for n in (256, 44):
        for _ in range(kv.num_layers * 2):
            ch = 3 * 64
            r.take(ch * 33 * 2)
            tables += ch * 33 * 2
            r.take(4 * n)
            lengths = r.array("<u2", ch).astype(int)
            r.take(2 * int(lengths.sum()))
    r.done()
    # a full 256-token chunk's tables alone cost 33 * 16 / 256 = 2.06 bits per value
    one = c.encode(kv.slice(0, 256), level)
    assert 8 * len(one) / kv.slice(0, 256).num_values > 33 * 16 / 256
    back = c.decode(data)
    _layout_equal(kv, back)
    # error bound: half a step of the per-token absmax grid
    for i, (x, y) in enumerate(zip(kv.layers, back.layers)):
        for is_key, a, b in ((True, x.k, y.k), (False, x.v, y.v)):
            bins = c._bins(level, i, is_key)
            mx = a.abs().amax(dim=(0, 2))  # per token over all heads and channels
            step = mx / (bins // 2 - 1)
            assert bool(((a - b).abs() <= step[None, :, None] * 0.5 + 1e-5).all())


def test_released_levels_order_size_and_error():
    kv = _kv(layers=24, heads=3, tokens=256)
    sizes, errs = [], []
    for lv in (1, 2, 3):
        c = B.CacheGenReleasedCodec()
        d = c.encode(kv, lv)
        sizes.append(len(d))
        errs.append(_maxerr(kv, c.decode(d)))
    assert sizes[0] < sizes[1] < sizes[2]
    assert errs[0] > errs[2]


def test_decode_rejects_bad_bytes():
    kv = _kv(tokens=40)
    for c, lv in ((B.RawCodec("fp16"), 0), (B.UniformCodec(4), 0), (B.KiviCodec(2), 0), (B.CacheGenReleasedCodec(), 2)):
        data = c.encode(kv, lv)
        with pytest.raises(CorruptChunk):
            c.decode(data[:-3])
        with pytest.raises(CorruptChunk):
            c.decode(b"XXXX" + data[4:])
        with pytest.raises(CorruptChunk):
            c.decode(data + b"\0")
    with pytest.raises(CorruptChunk):  # another codec's chunk
        B.UniformCodec(8).decode(B.UniformCodec(4).encode(kv))
    data = bytearray(B.CacheGenReleasedCodec().encode(kv, 2))
    data[6 + len(b"cachegen-released") + 16] = 9  # the level byte (after the key digest): no such level
    with pytest.raises(CorruptChunk):
        B.CacheGenReleasedCodec().decode(bytes(data))


@pytest.mark.parametrize("name", ALL)
def test_chunks_are_bound_to_their_keys(name):
    from cachegen.errors import KeyMismatch

    codec = B.baseline(name)
    kv = _kv(tokens=20)
    data = codec.encode(kv, codec.levels[-1], key="ab" * 16)
    assert codec.decode(data, key="ab" * 16).num_tokens == 20 and codec.decode(data).num_tokens == 20
    with pytest.raises(KeyMismatch):
        codec.decode(data, key="cd" * 16)


def test_registry_and_names():
    names = [v.label for v in B.make_codecs(["fp16", "uniform8", "kivi2", "cachegen-released:2", "cachegen-released"])]
    assert names == [
        "fp16",
        "uniform8",
        "kivi2",
        "cachegen-released/L2",
        "cachegen-released/L1",
        "cachegen-released/L2",
        "cachegen-released/L3",
    ]
    for v in B.make_codecs(["fp16", "kivi4", "cachegen-released"]):
        assert isinstance(v.codec, ChunkCodec)
    assert [v.row_level for v in B.make_codecs(["fp16", "cachegen-released:3"])] == [None, 3]
    with pytest.raises(ConfigError):
        B.baseline("nope")
    with pytest.raises(ConfigError):
        B.CacheGenReleasedCodec().encode(_kv(tokens=8), 4)
    with pytest.raises(ConfigError):
        B.make_codecs(["cachegen-released:4"])
    with pytest.raises(ConfigError):
        B.RawCodec("fp16").encode(_kv(tokens=8), 3)
    with pytest.raises(ConfigError):
        B.make_codecs(["cachegen"])  # the project codec needs the model


def test_roundtrip_chunks_and_bits_per_value():
    kv = _kv(tokens=600)
    back, size, blobs = B.roundtrip_chunks(B.Variant(B.RawCodec("fp16"), 0), kv)
    assert len(blobs) == 3 and size == sum(map(len, blobs))
    assert 16 < 8 * size / kv.num_values < 16.01
    _layout_equal(kv, back)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(0, 100), st.integers(0, 2**31))
def test_pack_bits_roundtrip(bits, n, seed):
    q = np.random.default_rng(seed).integers(0, 2**bits, n).astype(np.uint8)
    b = B.pack_bits(q, bits)
    assert len(b) == B.packed_len(n, bits)
    assert np.array_equal(B.unpack_bits(b, bits, n), q)


INTO = ["fp16", "bf16", "uniform8", "uniform4", "uniform2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", INTO)
def test_decode_into_gives_decode_then_write_bit_for_bit(name, dtype):
    """The raw and uniform codecs write into a preallocated cache (the loader's fixed 8-bit method
    and the adaptive ladder's raw rungs): the same values, in every dtype, as decoding and copying."""
    from cachegen.codec.protocol import DecodesInto

    codec = B.baseline(name)
    assert isinstance(codec, DecodesInto)
    kv = _kv(layers=2, heads=3, tokens=96, start=0, sliding=True)
    chunk = kv.slice(32, 64)
    data = codec.encode(chunk, 0, key="k" * 8)
    want = KVCache.allocate(kv, 96, dtype=dtype)
    got = KVCache.allocate(kv, 96, dtype=dtype)
    for c in (want, got):
        for l in c.layers:
            l.k.fill_(7.0)
            l.v.fill_(7.0)
    want.write(codec.decode(data, key="k" * 8))  # the part's range only: [32, 64) relative to start 0
    assert codec.decode_into(data, got.slice(32, 64), key="k" * 8).start == 32
    for a, b in zip(want.layers, got.layers):
        assert (
            torch.equal(a.k.view(torch.int16), b.k.view(torch.int16))
            if dtype != torch.float32
            else torch.equal(a.k, b.k)
        )
        assert torch.equal(a.v.float(), b.v.float())
        assert float(b.k[:, :32].float().sub(7).abs().max()) == 0 and float(b.v[:, 64:].float().sub(7).abs().max()) == 0


def test_uniform_bf16_rounding_is_torchs_on_ties():
    """bfloat16 rounds to nearest even, as torch's cast: values half-way between two bfloat16s."""
    codec = B.UniformCodec(8)
    heads, tokens, dim = 1, 256, 8
    # lo 1.0 and step 2**-8: q / 256 + 1 hits every bfloat16 tie (1 + odd/256) and the values between
    k = torch.arange(tokens, dtype=torch.float32).div(256).add(1).view(1, tokens, 1).expand(heads, tokens, dim).clone()
    kv = KVCache([KVLayer(k, k.clone())])
    data = codec.encode(kv)
    out = KVCache.allocate(kv, tokens, dtype=torch.bfloat16)
    codec.decode_into(data, out)
    assert torch.equal(out.layers[0].k, codec.decode(data).layers[0].k.to(torch.bfloat16))


@pytest.mark.parametrize("name", INTO)
def test_decode_into_refuses_the_wrong_slot_and_bad_bytes_before_writing(name):
    from cachegen.errors import KeyMismatch

    codec = B.baseline(name)
    kv = _kv(layers=2, tokens=64)
    data = codec.encode(kv.slice(0, 32), 0, key="k" * 8)
    out = KVCache.allocate(kv, 64)
    for l in out.layers:
        l.k.zero_()
        l.v.zero_()

    def untouched() -> bool:
        return all(float(l.k.abs().max()) == 0 and float(l.v.abs().max()) == 0 for l in out.layers)

    with pytest.raises(CorruptChunk, match="tokens"):
        codec.decode_into(data, out.slice(32, 64))  # another range
    with pytest.raises(CorruptChunk, match="tokens"):
        codec.decode_into(data, out)  # a longer slot
    with pytest.raises(CorruptChunk, match="layout"):
        codec.decode_into(data, KVCache.allocate(_kv(layers=2, heads=3, tokens=32), 32))
    with pytest.raises(CorruptChunk, match="layout"):
        codec.decode_into(data, KVCache.allocate(_kv(layers=2, tokens=32, sliding=True), 32))
    with pytest.raises(KeyMismatch):
        codec.decode_into(data, out.slice(0, 32), key="x" * 8)
    for bad in (data[:-1], data + b"\0"):
        with pytest.raises(CorruptChunk, match="bytes after the header"):
            codec.decode_into(bad, out.slice(0, 32))
    assert untouched()


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 40),
    st.sampled_from([(8, 8), (16, 8), (4, 12)]),
    st.integers(0, 20),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**31),
)
def test_uniform8_one_call_decode_matches_decode(layers, heads, tokens, dims, at, dtype, seed):
    """The 8-bit decode's one compiled call (every layer's K and V at the destinations' addresses)
    writes what decoding and casting gives, bit for bit, into any range of a larger cache, with K
    and V of different widths, and nothing outside that range."""
    from cachegen.bench.baselines._format import _read_header, dequant8_chunk_into

    codec = B.UniformCodec(8)
    dk, dv = dims
    kv = _kv(layers=layers, heads=heads, tokens=tokens, dk=dk, dv=dv, start=at, seed=seed % 1000)
    data = codec.encode(kv, key="k")
    out = KVCache.allocate(kv, at + tokens + 7, start=0, dtype=dtype)
    for l in out.layers:
        l.k.fill_(7.0)
        l.v.fill_(7.0)
    r = Reader(memoryview(data), "chunk")
    _, _, shapes = _read_header(r, "uniform8", "k")
    assert dequant8_chunk_into(r.rest(), shapes, out.slice(at, at + tokens))  # the compiled path is taken
    want = KVCache.allocate(kv, at + tokens + 7, start=0, dtype=dtype)
    for l in want.layers:
        l.k.fill_(7.0)
        l.v.fill_(7.0)
    want.write(codec.decode(data, key="k"))
    for a, b in zip(want.layers, out.layers):
        for x, y in ((a.k, b.k), (a.v, b.v)):  # bit patterns: -0.0 and 0.0 differ
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_uniform8_one_call_decode_leaves_other_caches_to_the_layer_loop():
    """Caches the compiled call cannot write (float16; rows that are not contiguous) decline it, and
    the per-layer path still decodes them exactly."""
    from cachegen.bench.baselines._format import _read_header, dequant8_chunk_into

    codec = B.UniformCodec(8)
    kv = _kv(layers=2, heads=2, tokens=24, dk=8, dv=8)
    data = codec.encode(kv)
    want = codec.decode(data)
    transposed = KVCache(
        [
            KVLayer(torch.empty(2, 8, 24).transpose(1, 2), torch.empty(2, 8, 24).transpose(1, 2), l.kind, l.window)
            for l in kv.layers
        ]
    )
    for out in (KVCache.allocate(kv, 24, dtype=torch.float16), transposed):
        r = Reader(memoryview(data), "chunk")
        _, _, shapes = _read_header(r, "uniform8", None)
        assert not dequant8_chunk_into(r.rest(), shapes, out)
        codec.decode_into(data, out)
        for a, b in zip(want.to(out.dtype).layers, out.layers):
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_half_to_float_is_numpys_for_every_finite_half():
    """The compiled decode reads fp16 mins and steps itself (numba has no float16): every finite
    bit pattern, normal and subnormal, both signs, gives numpy's float32 exactly."""
    from cachegen.bench.baselines._format import _half

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = np.isfinite(bits.view(np.float16))
    buf = bits.view(np.uint8).copy()
    got = np.array([_half(buf, 2 * int(i)) for i in np.flatnonzero(finite)], np.float32)
    assert np.array_equal(got.view(np.uint32), bits[finite].view(np.float16).astype(np.float32).view(np.uint32))


def test_uniform8_non_finite_step_in_the_last_layer_writes_nothing():
    """Every min and step is checked before the first write: a bad one in the last layer's V leaves
    the earlier layers untouched too."""
    codec = B.UniformCodec(8)
    kv = _kv(layers=3, heads=2, tokens=32, dk=8, dv=8)
    data = bytearray(codec.encode(kv))
    q = 2 * 32 * 8  # the last item's codes
    step_at = len(data) - q - 2 * 2 * 8  # its fp16 steps
    data[step_at + 4 : step_at + 6] = (0x7E00).to_bytes(2, "little")  # a half NaN
    for dtype in (torch.float32, torch.bfloat16):
        out = KVCache.allocate(kv, 32, dtype=dtype)
        for l in out.layers:
            l.k.zero_()
            l.v.zero_()
        with pytest.raises(CorruptChunk, match="non-finite"):
            codec.decode_into(bytes(data), out)
        assert all(float(l.k.abs().max()) == 0 and float(l.v.abs().max()) == 0 for l in out.layers)


@pytest.mark.parametrize("name", ["fp16", "bf16", "uniform8"])
def test_decode_into_refuses_non_finite_values(name):
    codec = B.baseline(name)
    kv = _kv(layers=2, tokens=32)
    data = bytearray(codec.encode(kv))
    h = B.header_size(name, 2)
    # raw: the last value of the last layer's V; uniform: the first fp16 min of the first layer's K
    at = len(data) - 2 if name != "uniform8" else h
    data[at : at + 2] = np.array([np.inf], np.float16).view(np.uint16).tobytes()
    if name == "bf16":
        data[at : at + 2] = (0x7FC0).to_bytes(2, "little")  # a bfloat16 NaN
    with pytest.raises(CorruptChunk, match="non-finite"):
        codec.decode(bytes(data))
    with pytest.raises(CorruptChunk, match="non-finite"):
        codec.decode_into(bytes(data), KVCache.allocate(kv, 32))


@pytest.mark.parametrize("name", INTO)
def test_layout_is_decodes_layout_and_the_body_must_hold_it(name):
    """The raw and uniform codecs read a chunk's layout from its header (a ReadsLayout, for the
    loader's first chunk): decode's start, kinds, windows and widths in float32, no token. The
    bytes after the header must be what those layers need, so a header cannot size an allocation
    past the chunk's own bytes."""
    from cachegen.codec.protocol import ReadsLayout

    codec = B.baseline(name)
    assert isinstance(codec, ReadsLayout)
    data = codec.encode(_kv(layers=3, heads=2, tokens=24, dk=8, dv=16, start=40, sliding=True), 0)
    got, want = codec.layout(data), codec.decode(data)
    assert got.num_tokens == 0 and got.start == 40 and got.same_layout(want) and got.dtype == torch.float32
    for bad in (data[:-1], data + b"\0"):
        with pytest.raises(CorruptChunk, match="bytes after the header"):
            codec.layout(bad)
    with pytest.raises(CorruptChunk):
        B.baseline("fp16" if name != "fp16" else "bf16").layout(data)


def test_a_ladder_reads_the_layout_of_its_rungs_that_can():
    from cachegen.stream import FormatLadder, Rung

    ladder = FormatLadder([Rung("uniform8", B.UniformCodec(8), 0), Rung("kivi2", B.baseline("kivi2"), 0)])
    kv = _kv(layers=2, tokens=32, start=64)
    assert ladder.layout(ladder.encode(kv, 0)).same_layout(kv)
    assert ladder.layout(ladder.encode(kv, 0)).start == 64
    assert ladder.layout(ladder.encode(kv, 1)) is None  # KIVI reads no layout: the loader decodes first
