"""The codec's less travelled paths, each held exactly: decoding into a preallocated cache, the
thread pool, keys coded before RoPE at every sink split, the token multipliers' stream at its
bounds, the lossless tables of degenerate planes, one-value tensors, the value cap at its edge
and every refusal's exact message.

Oracles: plain-numpy transforms (rotate_half RoPE, mean, basis) in float64, hand-computed tables,
the float32 quantizer rule, bit-exact round trips and the bounds' own arithmetic. These are the
behaviours the codec's mutation run found unchecked (docs/testing.md)."""

from __future__ import annotations

import dataclasses
import gc
import re
import struct
import sys
import threading
import zlib

import numpy as np
import pytest
import torch

from cachegen.codec import LOSSLESS, Codec, Profile, calibrate, importance, rans
from cachegen.codec import codec as codec_mod
from cachegen.codec.codec import (
    LOSSLESS_MAX_FREQ,
    MAX_VALUES_NO_PROFILE,
    _encode_section,
    _lossless_tables,
    layer_inputs,
    section_symbols,
)
from cachegen.codec.container import (
    FORMAT_VERSION,
    MAX_POSITION,
    ChunkHeader,
    LayerShape,
    key_digest,
    pack_header,
    parse_header,
    section_bytes,
)
from cachegen.codec.profile import TABLE_PAD, SectionParams
from cachegen.codec.rope import RopeSpec
from cachegen.codec.transform import forward_section, inverse_section
from cachegen.errors import CodecError, ConfigError, CorruptChunk, KeyMismatch, ProfileMismatch
from cachegen.kv import KVCache, KVLayer, LayerKind
from codec.samples import planted_sensitivity

KEY = "chunk-key-for-the-paths-tests"


def _kv(seed=0, layers=2, heads=2, tokens=24, dim=8, vdim=4, start=0, dtype=torch.float32, sliding=False) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        k = torch.randn(heads, tokens, dim, generator=g) * (1 + i) + 0.5
        v = torch.randn(heads, tokens, vdim, generator=g) * 0.3
        kind, window = (LayerKind.SLIDING, 16) if sliding and i % 2 else (LayerKind.FULL, None)
        out.append(KVLayer(k.to(dtype), v.to(dtype), kind, window))
    return KVCache(out, start=start)


def _exact(msg: str) -> str:
    """A ``pytest.raises(match=)`` pattern for exactly this message (after CorruptChunk's "corrupt chunk: ")."""
    return f"^(corrupt chunk: )?{re.escape(msg)}$"


def _sections(data: bytes) -> tuple[ChunkHeader, list[bytearray]]:
    h = parse_header(data)
    return h, [bytearray(data[o : o + n]) for o, n in zip(h.section_offsets(), h.section_lengths)]


def _rebuild(h: ChunkHeader, secs, **changes) -> bytes:
    """A chunk of these sections (lengths and checksums recomputed) and header fields."""
    secs = [bytes(s) for s in secs]
    h = dataclasses.replace(
        h, section_lengths=tuple(map(len, secs)), section_crcs=tuple(zlib.crc32(s) for s in secs), **changes
    )
    return pack_header(h) + b"".join(secs)


def _with_header(data: bytes, **changes) -> bytes:
    h, secs = _sections(data)
    return _rebuild(h, secs, **changes)


def _u_offset(sec) -> int:
    """Offset of a lossy section's multiplier count: after its sink bytes and its escapes."""
    ns = struct.unpack_from("<I", sec, 0)[0]
    ne = struct.unpack_from("<I", sec, 4 + ns)[0]
    return 8 + ns + 4 * ne


@pytest.fixture(scope="module")
def profile() -> Profile:
    """Two layers (K 8 wide, V 4 wide), no token importance."""
    return calibrate([_kv(10, tokens=64), _kv(11, tokens=64)], "fp-paths")


@pytest.fixture(scope="module")
def imp_profile() -> Profile:
    """One layer with token importance: each section carries a multiplier stream."""
    imp = _kv(300, layers=1, tokens=400)
    return calibrate(
        [_kv(100 + i, layers=1, tokens=96) for i in range(2)],
        "fp-imp",
        importance_data=[(imp, planted_sensitivity(imp))],
    )


# -- decode_into -------------------------------------------------------------------------------


def _filled(like: KVCache, tokens: int, start: int, dtype=None, value: float = 7.0) -> KVCache:
    out = KVCache.allocate(like, tokens, start=start, dtype=dtype)
    for l in out.layers:
        l.k.fill_(value)
        l.v.fill_(value)
    return out


def _untouched(cache: KVCache, lo: int, hi: int, value: float = 7.0) -> bool:
    """Every value outside positions [lo, hi) of ``cache`` (from 0) still holds ``value``."""
    return all(
        bool((x[:, :lo] == value).all() and (x[:, hi:] == value).all()) for l in cache.layers for x in (l.k, l.v)
    )


@pytest.mark.parametrize("level", [LOSSLESS, 3])
def test_decode_into_writes_decodes_values_into_its_range_only(profile, level):
    codec = Codec(profile, threads=1)
    kv = _kv(1, tokens=20, start=30, sliding=True)
    data = codec.encode(kv, level, key=KEY)
    ref = codec.decode(data, key=KEY)
    whole = _filled(kv, 60, start=0)
    view = whole.slice(30, 50)
    assert codec.decode_into(data, view, key=KEY) is view
    for a, b in zip(view.layers, ref.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert _untouched(whole, 30, 50)
    if level == LOSSLESS:
        assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(view.layers, kv.layers))


def test_decode_into_casts_to_the_caches_dtype():
    codec = Codec(None, threads=1)
    kv = _kv(2, tokens=12, start=5, dtype=torch.bfloat16)
    out = _filled(kv, 12, start=5, dtype=torch.float32)
    codec.decode_into(codec.encode(kv, LOSSLESS), out)
    for a, b in zip(out.layers, kv.layers):
        assert a.k.dtype == a.v.dtype == torch.float32
        assert torch.equal(a.k, b.k.float()) and torch.equal(a.v, b.v.float())


def test_decode_into_refuses_another_range_layout_or_key_before_writing(profile):
    codec = Codec(profile, threads=1)
    kv = _kv(3, tokens=20, start=30, sliding=True)
    data = codec.encode(kv, 3, key=KEY)
    whole = _filled(kv, 80, start=0)
    for a, b in ((31, 51), (30, 49), (30, 51), (29, 50), (0, 20)):
        with pytest.raises(CorruptChunk, match=_exact(f"chunk holds tokens [30, 50), expected [{a}, {b})")):
            codec.decode_into(data, whole.slice(a, b), key=KEY)
    view = whole.slice(30, 50)

    def changed(i: int, **fields) -> KVCache:
        layers = list(view.layers)
        layers[i] = dataclasses.replace(layers[i], **fields)
        return KVCache(layers, start=30)

    for bad in (
        changed(1, kind=LayerKind.FULL, window=None),  # another kind
        changed(1, window=8),  # another window
        changed(0, k=torch.zeros(3, 20, 8), v=torch.zeros(3, 20, 4)),  # heads
        changed(0, k=torch.zeros(2, 20, 16)),  # key width
        changed(0, v=torch.zeros(2, 20, 8)),  # value width
        KVCache(list(view.layers[:1]), start=30),  # a layer fewer
    ):
        with pytest.raises(CorruptChunk, match=_exact("chunk layout differs from the cache it is decoded into")):
            codec.decode_into(data, bad, key=KEY)
    with pytest.raises(KeyMismatch):
        codec.decode_into(data, view, key="another chunk's key")
    assert _untouched(whole, 80, 80)  # nothing was written anywhere
    codec.decode_into(data, view)  # no key given: no check


# -- threads -----------------------------------------------------------------------------------


def test_threads_decide_where_sections_are_coded(monkeypatch):
    """``threads`` > 1: every section is coded on the pool's threads (at most ``threads`` of them),
    never the caller's; 0 or 1: all on the caller's thread, no pool. The bytes are the same."""
    caller = threading.get_ident()
    ran: list[int] = []
    enc, dec = codec_mod._encode_lossless, codec_mod._decode_job
    monkeypatch.setattr(codec_mod, "_encode_lossless", lambda x: (ran.append(threading.get_ident()), enc(x))[1])
    monkeypatch.setattr(codec_mod, "_decode_job", lambda j: (ran.append(threading.get_ident()), dec(j))[1])
    kv = _kv(4, layers=3, tokens=8)
    assert Codec().threads == 2  # the default
    ref = None
    for threads, pooled in ((0, False), (1, False), (2, True), (3, True)):
        c = Codec(threads=threads)
        ran.clear()
        data = c.encode(kv, LOSSLESS)
        out = c.decode(data)
        assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(kv.layers, out.layers))
        assert ref is None or data == ref
        ref = data
        assert c.threads == max(1, threads) and len(ran) == 12  # 6 sections encoded, 6 decoded
        if pooled:
            assert caller not in ran and len(set(ran)) <= threads
            assert c._pool is not None and c._pool._max_workers == threads
        else:
            assert set(ran) == {caller} and c._pool is None
        c.close()


@pytest.mark.parametrize("level", [LOSSLESS, 3])
def test_pool_threads_write_into_a_cache_made_in_inference_mode(profile, level):
    """A serving engine makes its cache under ``torch.inference_mode()`` and decodes into it there;
    the pool's threads are not in that mode by themselves, and an in-place write from outside it
    into such a tensor is refused by torch (the vLLM connector's loads all failed so)."""
    codec = Codec(profile, threads=2)
    kv = _kv(6, tokens=20, start=30, sliding=True)
    data = codec.encode(kv, level, key=KEY)
    ref = codec.decode(data, key=KEY)
    with torch.inference_mode():
        whole = _filled(kv, 60, start=0)
        assert whole.layers[0].k.is_inference()
        codec.decode_into(data, whole.slice(30, 50), key=KEY)
        again = codec.decode(data, key=KEY)
    for a, b, c in zip(whole.slice(30, 50).layers, ref.layers, again.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(c.k, b.k)
    codec.close()


@pytest.mark.parametrize("stop", ["fails", "abandoned"])
def test_no_section_is_written_after_a_decode_ends(monkeypatch, stop):
    """Sections are decoded straight into the caller's cache on the pool's threads: when one
    fails (or a ``decode_layers`` caller stops early), every other section is cancelled or has
    finished before control returns, so a recompute written into that range afterwards is never
    overwritten by a late section."""
    running: set[int] = set()
    lock = threading.Lock()
    dec = codec_mod._decode_job

    def slow(job):
        i = job.sections[0][0]  # the job's first section (lossless: one per job)
        with lock:
            running.add(i)
        try:
            if i == 0 and stop == "fails":
                raise CorruptChunk("section 0: planted")
            threading.Event().wait(0.02)
            return dec(job)
        finally:
            with lock:
                running.discard(i)

    monkeypatch.setattr(codec_mod, "_decode_job", slow)
    c = Codec(threads=2)
    kv = _kv(5, layers=4, tokens=8)
    data = c.encode(kv, LOSSLESS)
    if stop == "fails":
        with pytest.raises(CorruptChunk, match="planted"):
            c.decode_into(data, _filled(kv, 8, start=0))
    else:
        layers = c.decode_layers(data)
        next(layers)
        layers.close()
    with lock:
        assert running == set()
    c.close()


def test_a_codec_whose_arguments_were_refused_is_collected_silently(monkeypatch):
    caught: list = []
    monkeypatch.setattr(sys, "unraisablehook", caught.append)
    for bad in (0, MAX_POSITION + 1):
        with pytest.raises(ConfigError):
            Codec(max_tokens=bad)
    gc.collect()
    assert [u.exc_value for u in caught] == []


def test_a_collected_codec_shuts_its_pool_down(profile):
    codec = Codec(profile, threads=2)
    codec.decode(codec.encode(_kv(3, tokens=20), 3))  # the pool's threads are running
    pool = codec._pool
    assert pool is not None and not pool._shutdown
    del codec
    gc.collect()
    assert pool._shutdown  # its threads exit once idle


# -- keys coded before RoPE --------------------------------------------------------------------


def _spec(r: int = 8, scale: float = 1.0) -> RopeSpec:
    return RopeSpec((1.0 / 10000.0 ** (np.arange(0, r, 2) / r)).astype(np.float32), scale)


def _rotate_ref(x: np.ndarray, spec: RopeSpec, start: int, inverse: bool) -> np.ndarray:
    """Hugging Face's rotate_half RoPE in float64: pairs (j, j + r/2), angles position * inv_freq
    (float32, as transformers computes them), cos and sin times ``scale``; the inverse is R^T / scale^2."""
    x = np.asarray(x, dtype=np.float64)
    t = x.shape[1]
    r2 = spec.inv_freq.size
    ang = (np.arange(start, start + t).astype(np.float32)[:, None] * spec.inv_freq[None, :]).astype(np.float64)
    c, s = np.cos(ang) * spec.scale, np.sin(ang) * spec.scale
    a, b = x[..., :r2], x[..., r2 : 2 * r2]
    out = x.copy()
    if inverse:
        out[..., :r2] = (a * c + b * s) / spec.scale**2
        out[..., r2 : 2 * r2] = (b * c - a * s) / spec.scale**2
    else:
        out[..., :r2] = a * c - b * s
        out[..., r2 : 2 * r2] = b * c + a * s
    return out


def _section(seed: int, kind: str, spec: RopeSpec | None, heads: int = 2, dim: int = 8) -> SectionParams:
    g = np.random.default_rng(seed)
    mean = g.standard_normal(heads * dim).astype(np.float32)
    std = np.ones(heads * dim, dtype=np.float32)
    if kind == "identity":
        return SectionParams(heads, dim, mean, std, rope=spec)
    if kind == "orthonormal":
        basis = np.linalg.qr(g.standard_normal((heads, dim, dim)))[0].astype(np.float32)
        return SectionParams(heads, dim, mean, std, basis=basis, rope=spec)
    basis = (g.standard_normal((heads, dim, dim)) + 3 * np.eye(dim)).astype(np.float32)  # not orthonormal
    return SectionParams(heads, dim, mean, std, basis=basis, inv=np.linalg.inv(basis).astype(np.float32), rope=spec)


def _matrix(sp: SectionParams, inverse: bool) -> np.ndarray | None:
    if sp.basis is None:
        return None
    if not inverse:
        return sp.basis.astype(np.float64)
    return (sp.inv if sp.inv is not None else np.swapaxes(sp.basis, 1, 2)).astype(np.float64)


@pytest.mark.parametrize("kind", ["identity", "orthonormal", "inverse"])
@pytest.mark.parametrize("r,scale", [(8, 1.0), (4, 1.25)])  # full and partial rotary width, scaled cos/sin
def test_forward_section_is_unrope_minus_mean_times_basis(kind, r, scale):
    spec = _spec(r, scale)
    sp = _section(1, kind, spec)
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(2))
    m = _matrix(sp, inverse=False)
    for start in (0, 37):
        xc = _rotate_ref(x.numpy(), spec, start, inverse=True) - sp.mean.astype(np.float64).reshape(2, 1, 8)
        want = (xc if m is None else xc @ m).transpose(1, 0, 2).reshape(12, 16)
        got = forward_section(sp, x, start)
        assert got.dtype == np.float32 and got.shape == (12, 16)
        assert np.allclose(got, want, atol=1e-4), (kind, start)
    assert np.array_equal(forward_section(sp, x), forward_section(sp, x, 0))  # positions from 0 by default
    assert not np.allclose(forward_section(sp, x, 0), forward_section(sp, x, 1), atol=1e-3)


@pytest.mark.parametrize("kind", ["identity", "orthonormal", "inverse"])
@pytest.mark.parametrize("r,scale", [(8, 1.0), (4, 1.25)])
def test_inverse_section_is_y_times_inverse_plus_mean_then_rope(kind, r, scale):
    spec = _spec(r, scale)
    sp = _section(3, kind, spec)
    y = np.random.default_rng(4).standard_normal((12, 16)).astype(np.float32)
    yh = y.astype(np.float64).reshape(12, 2, 8).transpose(1, 0, 2)
    m = _matrix(sp, inverse=True)
    for start in (0, 37):
        coded = (yh if m is None else yh @ m) + sp.mean.astype(np.float64).reshape(2, 1, 8)
        want = _rotate_ref(coded, spec, start, inverse=False)
        got = inverse_section(sp, y, 2, 8, torch.float32, start)
        assert got.dtype == torch.float32 and tuple(got.shape) == (2, 12, 8)
        assert np.allclose(got.numpy(), want, atol=1e-4), (kind, start)
        half = inverse_section(sp, y, 2, 8, torch.bfloat16, start)
        assert half.dtype == torch.bfloat16 and torch.equal(half, got.to(torch.bfloat16))
    assert torch.equal(inverse_section(sp, y, 2, 8, torch.float32), inverse_section(sp, y, 2, 8, torch.float32, 0))
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(5))
    back = inverse_section(sp, forward_section(sp, x, 901), 2, 8, torch.float32, 901)
    assert torch.allclose(back, x, atol=1e-4)  # the inverse at the same positions


@pytest.fixture(scope="module")
def rope_profile() -> Profile:
    s = _spec(8)
    return calibrate([_kv(20 + i, tokens=64) for i in range(2)], "fp-rope", levels=[1], rope=[s, s])


@pytest.mark.parametrize("start", [0, 1, 3, 50])
def test_pre_rope_keys_at_every_sink_split(rope_profile, start):
    """Keys coded before RoPE come back within the level's bound whatever the split between sink
    tokens (stored exactly) and coded ones: each coded token is rotated back at its own position."""
    assert rope_profile.sections[0].rope is not None and rope_profile.sections[1].rope is None
    codec = Codec(rope_profile, threads=1)
    kv = _kv(5, tokens=24, start=start)
    data = codec.encode(kv, 1)
    sink = parse_header(data).sink_tokens
    assert sink == max(0, rope_profile.n_sink - start)
    out = codec.decode(data)
    for li, (a, b) in enumerate(zip(kv.layers, out.layers)):
        for j, (xa, xb, d) in enumerate(((a.k, b.k, 8), (a.v, b.v, 4))):
            assert torch.equal(xa[:, :sink], xb[:, :sink])
            # a rotation keeps each token's error norm: per value <= sqrt(d) * max step / 2
            step = float(rope_profile.levels[1].steps[2 * li + j].max())
            assert float((xa - xb).abs().max()) <= step * 0.5 * np.sqrt(d) * 1.001 + 1e-4, (li, j)


# -- token multipliers -------------------------------------------------------------------------


def _imp_bound(prof: Profile, level: int, sec: int, d: int) -> float:
    return float(prof.levels[level].steps[sec].max()) * 2.0 ** (importance.U_MAX / 2) * 0.5 * np.sqrt(d) * 1.001 + 1e-5


def test_one_token_past_the_sink_carries_its_multiplier(imp_profile):
    codec = Codec(imp_profile, threads=1)
    kv = _kv(6, layers=1, tokens=imp_profile.n_sink + 1)
    out = codec.decode(codec.encode(kv, 3))
    a, b = kv.layers[0], out.layers[0]
    assert torch.equal(a.k[:, :4], b.k[:, :4]) and torch.equal(a.v[:, :4], b.v[:, :4])
    assert float((a.k - b.k).abs().max()) <= _imp_bound(imp_profile, 3, 0, 8)
    assert float((a.v - b.v).abs().max()) <= _imp_bound(imp_profile, 3, 1, 4)


def test_multiplier_stream_length_is_checked_at_its_bound(imp_profile):
    codec = Codec(imp_profile, threads=1)
    kv = _kv(7, layers=1, tokens=40, start=imp_profile.n_sink)  # no sink tokens
    data = codec.encode(kv, 3)
    h, secs = _sections(data)
    p = _u_offset(secs[0])
    nu = struct.unpack_from("<I", secs[0], p)[0]
    rem = len(secs[0]) - p - 4  # after the count: the multipliers' words, then the values' words
    assert rem % 2 == 0 and 2 <= nu < rem // 2

    def with_count(n: int) -> bytes:
        s = [bytearray(x) for x in secs]
        struct.pack_into("<I", s[0], p, n)
        return _rebuild(h, s)

    with pytest.raises(CorruptChunk, match=_exact("section 0: multiplier stream longer than the section")):
        codec.decode(with_count(rem // 2 + 1))
    with pytest.raises(CorruptChunk) as every_word:  # all the words left: this check passes, the streams do not
        codec.decode(with_count(rem // 2))
    assert "longer than the section" not in str(every_word.value)
    assert codec.decode(with_count(nu)).num_tokens == 40


def test_multiplier_stream_too_short_for_its_tokens_is_refused_by_name(imp_profile):
    mb = rans.min_bits(imp_profile.u_tables())
    t = int(128 / mb) + 16  # no words code at most (64 + 64) / min_bits multipliers
    assert t < 5000, mb
    codec = Codec(imp_profile, threads=1)
    data = codec.encode(_kv(8, layers=1, tokens=t, start=imp_profile.n_sink), 3)
    h, secs = _sections(data)
    p = _u_offset(secs[0])
    nu = struct.unpack_from("<I", secs[0], p)[0]
    struct.pack_into("<I", secs[0], p, 0)
    del secs[0][p + 4 : p + 4 + 2 * nu]
    with pytest.raises(
        CorruptChunk, match=_exact("section 0 multipliers: symbol count inconsistent with payload size")
    ):
        codec.decode(_rebuild(h, secs))


def test_a_multiplier_stream_at_its_budget_decodes(imp_profile):
    """A section whose tokens all have the likeliest multiplier: its stream costs min_bits per token
    (the least the payload bound allows) and decodes, every value within its token's half step."""
    prof = imp_profile
    u_tables = prof.u_tables()
    mb = rans.min_bits(u_tables)
    top = int(np.argmax(prof.u_freqs)) + importance.U_MIN
    t = int(400 / mb) + 64
    assert t < 8000, mb
    kv = _kv(9, layers=1, tokens=t, start=prof.n_sink)
    codec = Codec(prof, threads=1)
    h, secs = _sections(codec.encode(kv, 3))
    lp = prof.levels[3]
    ys, _ = layer_inputs(kv.layers[0], prof.sections[0:2], 0, kv.start)
    u = np.full(t, top, dtype=np.int64)
    cls = lp.classes(prof.sections)[0]
    sec = _encode_section(kv.layers[0].k, ys[0], u, True, lp.steps[0], cls, lp.padded_tables(), u_tables, 0)
    secs[0] = bytearray(sec)
    nu = struct.unpack_from("<I", secs[0], _u_offset(secs[0]))[0]
    assert 16 * nu <= 1.05 * t * mb + 64  # about min_bits per multiplier, and the state
    out = codec.decode(_rebuild(h, secs))
    yb = forward_section(prof.sections[0], out.layers[0].k, kv.start)
    step = lp.steps[0][None, :].astype(np.float64) * 2.0 ** (top / 2)
    assert (np.abs(ys[0] - yb) <= step * 0.5 * 1.0001 + 1e-5).all()


def test_value_stream_too_short_for_its_tokens_is_refused_by_name(profile):
    """A chunk claiming more values than its (empty) words could code at the most skewed table's rate."""
    mb = rans.min_bits(profile.levels[3].padded_tables())
    heads, kd, _ = profile.layer_dims[0]
    c = heads * kd
    t = int((64 * c + 64) / (c * mb)) + 16
    start = profile.n_sink  # no sink tokens
    assert start + t <= MAX_POSITION
    empty = struct.pack("<II", 0, 0)  # no sink bytes, no escapes, no words
    secs = [empty] * (2 * len(profile.layer_dims))
    layers = tuple(LayerShape(LayerKind.FULL, None, *d) for d in profile.layer_dims)
    fields = (FORMAT_VERSION, profile.model_fingerprint, profile.id, 3, key_digest(None), start, t, torch.float32)
    h = ChunkHeader(*fields, layers, 0, False, (), (), 0)
    codec = Codec(profile, threads=1, max_tokens=MAX_POSITION)
    with pytest.raises(CorruptChunk, match=_exact("section 0: symbol count inconsistent with payload size")):
        codec.decode(_rebuild(h, secs))


# -- the quantizer's symbols -------------------------------------------------------------------


def _float32_edge(inv: np.float32) -> tuple[np.float32, int]:
    """A float32 ``y`` and ``k`` with ``float32(y * inv) == k + 1/2`` exactly while the exact product is below it."""
    for k in range(3, 60):
        y0 = np.float32((k + 0.5) / float(inv))
        for d in range(-4, 5):
            y = np.float32(y0 + np.float32(d) * np.spacing(y0))
            if np.float32(y * inv) == np.float32(k + 0.5) and float(y) * float(inv) < k + 0.5:
                return y, k
    raise AssertionError("no float32 rounding edge found")


def test_section_symbols_follow_the_float32_quantizer(profile):
    """``q = floor(y * (1/step * 2^(-u/2)) + 1/2)`` in float32 arithmetic (as the decoder multiplies
    back), symbol ``q + 127`` where its table (``cls + TABLE_PAD - u``) codes it, else an escape
    carrying ``q``. A value on a float32 rounding edge rounds up."""
    lp = profile.levels[3]
    tables = lp.padded_tables()
    rng = np.random.default_rng(6)
    T, C = 9, 5
    step = np.array([3.0, 0.5, 0.7, 2.0, 0.05], dtype=np.float32)
    cls = np.array([20, 12, 0, 23, 10], dtype=np.int64)
    u = np.array([0, 0, -2, 4, 1, -1, 0, 3, 2], dtype=np.int64)
    y = (rng.standard_normal((T, C)) * 8).astype(np.float32)
    y[2, 1] = 300.0  # far outside any table: an escape
    y[5, 4] = -1e12  # beyond the clip at 2^30 steps
    inv = np.float32(1.0) / step
    y_edge, k = _float32_edge(inv[0])
    y[0, 0] = y_edge
    sym, esc, n_esc = section_symbols(y, u, step, cls, tables)
    assert sym.dtype == np.uint8 and sym.shape == (T, C) and esc.dtype == np.int32
    ri = (1.0 / importance.row_scale(u)).astype(np.float32)
    v = y * (inv[None, :] * ri[:, None])  # float32 throughout
    q = np.floor(np.clip(v.astype(np.float64), -(2.0**30), 2.0**30) + 0.5).astype(np.int64)
    want_esc = []
    for t in range(T):
        for c in range(C):
            s = q[t, c] + 127
            if 0 <= s < 255 and tables.freq[cls[c] + TABLE_PAD - u[t], s] > 0:
                assert sym[t, c] == s, (t, c)
            else:
                assert sym[t, c] == 255, (t, c)
                want_esc.append(q[t, c])
    assert n_esc == len(want_esc) >= 2 and esc[:n_esc].tolist() == want_esc
    assert q[0, 0] == k + 1 and sym[0, 0] == 127 + k + 1  # the edge rounded up


# -- lossless tables ---------------------------------------------------------------------------


def _plane(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint8).reshape(1, -1)


def _table(entries: dict[int, int]) -> np.ndarray:
    f = np.zeros(256, dtype=np.int64)
    for s, n in entries.items():
        f[s] = n
    return f


def test_lossless_tables_of_degenerate_planes_are_exact():
    cap = LOSSLESS_MAX_FREQ
    assert cap == 3756 == int(4096 * 2 ** (-1 / 8))
    # one symbol: it gets the cap, the dummy symbol (0, or 1 when the plane's symbol is 0) the rest
    for v, dummy in ((9, 0), (255, 0), (2, 0), (1, 0), (0, 1)):
        assert np.array_equal(_lossless_tables(_plane([v] * 50)), _table({v: cap, dummy: 4096 - cap})), v
    assert np.array_equal(_lossless_tables(np.zeros((0, 3), dtype=np.uint8)), _table({0: cap, 1: 4096 - cap}))
    # two symbols: no dummy; 1:100 quantizes to 41:4055, capped to 340:3756
    assert np.array_equal(_lossless_tables(_plane([5] + [7] * 100)), _table({5: 340, 7: cap}))
    # below the cap: the counts' own quantization (30:70 -> 1229:2867, 1:1:2 -> 1024:1024:2048)
    assert np.array_equal(_lossless_tables(_plane([3] * 30 + [4] * 70)), _table({3: 1229, 4: 2867}))
    assert np.array_equal(_lossless_tables(_plane([0, 1, 2, 2])), _table({0: 1024, 1: 1024, 2: 2048}))


# -- small tensors, empty chunks, mixed layer shapes -------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_lossless_one_channel_tensors_are_bit_exact(dtype, tokens):
    """Sections of 1 or 3 values: a one-value tensor, and 6 bytes in 16 bits (not whole 8-byte words)."""
    g = torch.Generator().manual_seed(tokens)
    k = [(torch.randn(1, tokens, 1, generator=g) * 3).to(dtype) for _ in range(2)]
    v = [torch.randn(1, tokens, 1, generator=g).to(dtype) for _ in range(2)]
    kv = KVCache([KVLayer(a, b) for a, b in zip(k, v)], start=11)
    codec = Codec(None, threads=1)
    out = codec.decode(codec.encode(kv, LOSSLESS))
    iv = torch.int32 if dtype == torch.float32 else torch.int16
    for a, b in zip(kv.layers, out.layers):
        assert b.k.dtype == b.v.dtype == dtype
        assert torch.equal(a.k.view(iv), b.k.view(iv)) and torch.equal(a.v.view(iv), b.v.view(iv))


def test_a_one_value_sink_is_stored_exactly():
    g = torch.Generator().manual_seed(12)
    kv = KVCache([KVLayer(torch.randn(1, 6, 1, generator=g) * 3, torch.randn(1, 6, 1, generator=g))], start=3)
    codec = Codec(None, threads=1)
    data = codec.encode(kv, 4)
    assert parse_header(data).sink_tokens == 1
    out = codec.decode(data)
    assert torch.equal(out.layers[0].k[:, :1], kv.layers[0].k[:, :1])
    assert torch.equal(out.layers[0].v[:, :1], kv.layers[0].v[:, :1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_empty_lossless_chunk_keeps_its_dtype(dtype):
    codec = Codec(None, threads=1)
    kv = _kv(12, tokens=0, start=10, dtype=dtype)
    out = codec.decode(codec.encode(kv, LOSSLESS))
    assert out.start == 10 and out.num_tokens == 0
    for a, b in zip(kv.layers, out.layers):
        assert b.k.dtype == b.v.dtype == dtype and b.k.shape == a.k.shape and b.v.shape == a.v.shape


def test_layers_of_different_shapes_round_trip_exactly():
    g = torch.Generator().manual_seed(13)
    shapes = [(2, 8, 4), (3, 16, 8), (1, 4, 12)]
    kv = KVCache(
        [KVLayer(torch.randn(h, 10, dk, generator=g), torch.randn(h, 10, dv, generator=g)) for h, dk, dv in shapes]
    )
    codec = Codec(None, threads=1)
    data = codec.encode(kv, LOSSLESS)
    assert [(l.heads, l.k_dim, l.v_dim) for l in parse_header(data).layers] == shapes
    out = codec.decode(data)
    assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(kv.layers, out.layers))
    lossy = codec.decode(codec.encode(kv, 5))
    assert [(tuple(l.k.shape), tuple(l.v.shape)) for l in lossy.layers] == [
        ((h, 10, dk), (h, 10, dv)) for h, dk, dv in shapes
    ]


# -- self-contained chunks, the value cap, refusals ---------------------------------------------


def test_a_self_contained_chunk_carries_a_plain_profile_of_its_own():
    kv = _kv(16, tokens=24)
    data = Codec(None, model_fingerprint="m-inline", threads=1).encode(kv, 4)
    h = parse_header(data)
    prof = Profile.from_bytes(bytes(section_bytes(data, h, 0)))
    assert prof.model_fingerprint == "m-inline"
    assert sorted(prof.levels) == [4] and prof.n_sink == 4 == h.sink_tokens
    assert prof.meta.get("use_pca") is False
    assert all(sp.basis is None and sp.inv is None and sp.rope is None and sp.imp is None for sp in prof.sections)


def _lossless_bomb(tokens: int, heads: int, dim: int) -> bytes:
    """A lossless fp32 chunk of one layer whose planes' tables give symbol 0 probability 1 (valid checksums)."""
    c = heads * dim
    f = np.zeros(256, dtype="<u2")
    f[0] = 4096
    lengths, words = np.full(c, 2, "<u4"), np.tile(np.array([1, 0], "<u2"), c)  # each stream its 2-word state
    plane = f.tobytes() + struct.pack("<I", 2 * c) + lengths.tobytes() + words.tobytes()
    sec = struct.pack("<B", 4) + plane * 4
    layer = LayerShape(LayerKind.FULL, None, heads, dim, dim)
    fields = (FORMAT_VERSION, "", "", LOSSLESS, key_digest(None), 0, tokens, torch.float32)
    h = ChunkHeader(*fields, (layer,), 0, False, (), (), 0)
    return _rebuild(h, [sec, sec])


def test_value_cap_without_a_profile_is_exact():
    codec = Codec(None, threads=1)
    per_token = 64 * (64 + 64)
    n = MAX_VALUES_NO_PROFILE // per_token  # exactly the cap
    assert n * per_token == MAX_VALUES_NO_PROFILE and n <= codec.max_tokens
    with pytest.raises(CorruptChunk, match=_exact("section 0: bad lossless table")):  # the header passes
        codec.decode(_lossless_bomb(n, 64, 64))
    with pytest.raises(
        CorruptChunk, match=_exact(f"chunk claims {(n + 1) * per_token} values, over {MAX_VALUES_NO_PROFILE}")
    ):
        codec.decode(_lossless_bomb(n + 1, 64, 64))


def test_refusals_name_their_reason_exactly(profile):
    codec = Codec(profile, threads=1)
    kv = _kv(14, tokens=20, start=2)
    nan = _kv(14, tokens=20)
    nan.layers[1].k[0, 3, 1] = float("nan")
    with pytest.raises(
        CodecError, match=_exact("the KV holds NaN or Inf: no chunk carries non-finite values (a decoder refuses them)")
    ):
        codec.encode(nan, 3)
    mixed = _kv(14, tokens=20)
    mixed.layers[0] = KVLayer(mixed.layers[0].k.half(), mixed.layers[0].v.half())
    with pytest.raises(ConfigError, match=_exact("all layers must share one dtype")):
        codec.encode(mixed, 3)

    lossy = codec.encode(kv, 3)
    h = parse_header(lossy)
    wide = (dataclasses.replace(h.layers[0], heads=3), *h.layers[1:])
    with pytest.raises(CorruptChunk, match=_exact("chunk layout does not match the model's (the profile's)")):
        codec.decode(_with_header(lossy, layers=wide))
    with pytest.raises(CorruptChunk, match=_exact("lossless chunk names a profile")):
        codec.decode(_with_header(codec.encode(kv, LOSSLESS), profile_id=profile.id))
    with pytest.raises(CorruptChunk, match=_exact("lossy chunk names no profile")):
        codec.decode(_with_header(lossy, profile_id=""))
    with pytest.raises(CorruptChunk, match=_exact("sink token count inconsistent")):
        codec.decode(_with_header(lossy, sink_tokens=1))
    other = calibrate([_kv(15, tokens=64)], "fp-paths")
    with pytest.raises(ProfileMismatch, match=_exact(f"chunk needs profile {profile.id}, this codec has {other.id}")):
        Codec(other, threads=1).decode(lossy)

    inline = Codec(None, threads=1).encode(kv, 4)
    hi = parse_header(inline)
    with pytest.raises(CorruptChunk, match=_exact("inline profile lacks the chunk's level")):
        Codec(None, threads=1).decode(_with_header(inline, level=5))
    wide = (dataclasses.replace(hi.layers[0], heads=3), *hi.layers[1:])
    with pytest.raises(CorruptChunk, match=_exact("chunk layout does not match its profile")):
        Codec(None, threads=1).decode(_with_header(inline, layers=wide))


@pytest.mark.parametrize("level", [LOSSLESS, 2])
def test_non_finite_values_name_their_section(profile, level):
    """A NaN in section 3 (layer 1's values): raw bytes of a lossless section, or a lossy section's sink."""
    codec = Codec(profile, threads=1)
    kv = _kv(17, tokens=20)
    data = codec.encode(kv, level)
    h, secs = _sections(data)
    if level == LOSSLESS:
        bad = _kv(17, tokens=20)
        bad.layers[1].v[1, 2, 3] = float("nan")
        secs[3] = bytearray(codec_mod._encode_lossless(bad.layers[1].v))
    else:
        secs[3][4:8] = b"\x00\x00\xc0\x7f"  # the first sink value (after the u32 sink size): a NaN
    with pytest.raises(CorruptChunk, match=_exact("section 3: non-finite values")):
        codec.decode(_rebuild(h, secs))
