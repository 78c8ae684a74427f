"""Decoding consecutive chunks in one call (``Codec.decode_many_into``): bit for bit what one
``decode_into`` per chunk gives, at mixed levels, with sink tokens, RoPE'd keys, token
multipliers and a cast; every chunk's header, range and key checked before anything is written;
lossless and mixed-dtype runs decoded chunk by chunk; the protocol helper's fallback for codecs
without it. Oracle: the per-chunk ``decode_into`` (itself held against ``decode``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachegen.codec import LOSSLESS, Codec, Profile, calibrate
from cachegen.codec.protocol import DecodesManyInto, decode_many_into
from cachegen.codec.rope import RopeSpec
from cachegen.errors import ConfigError, CorruptChunk, KeyMismatch
from cachegen.kv import KVCache, KVLayer, LayerKind
from codec.samples import planted_sensitivity


def _kv(seed: int, tokens: int, start: int = 0, layers: int = 2, dtype=torch.float32) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        k = torch.randn(2, tokens, 8, generator=g) * (1 + i) + 0.5
        v = torch.randn(2, tokens, 4, generator=g) * 0.3
        kind, window = (LayerKind.SLIDING, 16) if i % 2 else (LayerKind.FULL, None)
        out.append(KVLayer(k.to(dtype), v.to(dtype), kind, window))
    return KVCache(out, start=start)


@pytest.fixture(scope="module")
def profile() -> Profile:
    """RoPE'd keys and token importance: the rotation and the multipliers see every chunk's positions."""
    r = 8
    spec = RopeSpec((1.0 / 10000.0 ** (np.arange(0, r, 2) / r)).astype(np.float32), 1.0)
    imp = _kv(300, 400)
    return calibrate(
        [_kv(100 + i, 96) for i in range(2)],
        "fp-many",
        rope=[spec, spec],
        importance_data=[(imp, planted_sensitivity(imp))],
    )


def _filled(like: KVCache, tokens: int, dtype=None) -> KVCache:
    out = KVCache.allocate(like, tokens, dtype=dtype)
    for l in out.layers:
        l.k.fill_(7.0)
        l.v.fill_(7.0)
    return out


def _one_by_one(codec: Codec, blobs: list[bytes], like: KVCache, sizes: list[int], keys, dtype=None) -> KVCache:
    out = _filled(like, sum(sizes), dtype)
    pos = 0
    for b, n, k in zip(blobs, sizes, keys, strict=True):
        codec.decode_into(b, out.slice(pos, pos + n), key=k)
        pos += n
    return out


def _same(a: KVCache, b: KVCache) -> None:
    assert (a.start, a.end, a.dtype) == (b.start, b.end, b.dtype)
    for x, y in zip(a.layers, b.layers, strict=True):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


def _untouched(out: KVCache) -> bool:
    return all(bool((x == 7.0).all()) for l in out.layers for x in (l.k, l.v))


def _chunks(seed: int, sizes: list[int], levels: list[int], codec: Codec) -> tuple[KVCache, list[bytes], list[str]]:
    whole = _kv(seed, sum(sizes))
    blobs, keys, pos = [], [], 0
    for j, (n, level) in enumerate(zip(sizes, levels, strict=True)):
        keys.append(f"key-{seed}-{j}")
        blobs.append(codec.encode(whole.slice(pos, pos + n), level, key=keys[-1], context_end=whole.end))
        pos += n
    return whole, blobs, keys


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_many_equals_one_by_one_at_mixed_levels_with_sinks(profile, threads, dtype):
    codec = Codec(profile, threads=threads)
    assert isinstance(codec, DecodesManyInto)
    sizes, levels = [2, 3, 20, 17, 1], [3, 5, 1, 3, 7]  # the first two chunks hold the four sink tokens
    whole, blobs, keys = _chunks(1, sizes, levels, codec)
    ref = _one_by_one(codec, blobs, whole, sizes, keys, dtype)
    out = _filled(whole, whole.num_tokens, dtype)
    assert codec.decode_many_into(blobs, out, sizes, keys=keys) is out
    _same(out, ref)
    codec.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    start=st.sampled_from([0, 3, 70]),
    data=st.data(),
)
def test_many_equals_one_by_one_for_any_split(profile, sizes, seed, start, data):
    codec = Codec(profile, threads=1)
    levels = data.draw(st.lists(st.sampled_from(sorted(profile.levels)), min_size=len(sizes), max_size=len(sizes)))
    whole = _kv(seed, start + sum(sizes)).slice(start, start + sum(sizes))
    blobs, pos = [], start
    for n, level in zip(sizes, levels, strict=True):
        blobs.append(codec.encode(whole.slice(pos, pos + n), level))
        pos += n
    ref = KVCache.allocate(whole, sum(sizes), start=start)
    pos = start
    for b, n in zip(blobs, sizes, strict=True):
        codec.decode_into(b, ref.slice(pos, pos + n))
        pos += n
    out = KVCache.allocate(whole, sum(sizes), start=start)
    codec.decode_many_into(blobs, out, sizes)
    _same(out, ref)


def test_lossless_and_mixed_dtype_runs_decode_chunk_by_chunk(profile):
    codec = Codec(profile, threads=2)
    sizes = [6, 10, 9]
    whole = _kv(2, sum(sizes))
    half = whole.to(torch.bfloat16)
    blobs = [
        codec.encode(whole.slice(0, 6), LOSSLESS, key="a"),
        codec.encode(whole.slice(6, 16), 3, key="b"),
        codec.encode(half.slice(16, 25), 3, key="c"),  # another dtype
    ]
    ref = _one_by_one(codec, blobs, whole, sizes, ["a", "b", "c"])
    out = _filled(whole, whole.num_tokens)
    codec.decode_many_into(blobs, out, sizes, keys=["a", "b", "c"])
    _same(out, ref)
    _same(out.slice(0, 6), whole.slice(0, 6))  # lossless is exact


def test_a_run_of_lossless_chunks_decodes_chunk_by_chunk(profile):
    """Lossless chunks only (no profile to share): each decodes on its own, exactly."""
    codec = Codec(profile, threads=2)
    sizes = [5, 8, 7]
    whole = _kv(4, sum(sizes)).to(torch.bfloat16)
    blobs, pos = [], 0
    for n in sizes:
        blobs.append(codec.encode(whole.slice(pos, pos + n), LOSSLESS))
        pos += n
    out = _filled(whole, whole.num_tokens)
    codec.decode_many_into(blobs, out, sizes)
    _same(out, whole)


def test_every_chunk_is_checked_before_anything_is_written(profile):
    codec = Codec(profile, threads=2)
    sizes = [10, 12, 8]
    whole, blobs, keys = _chunks(3, sizes, [3, 3, 3], codec)
    out = _filled(whole, whole.num_tokens)
    with pytest.raises(KeyMismatch):  # the last chunk's key is wrong: nothing is decoded
        codec.decode_many_into(blobs, out, sizes, keys=[keys[0], keys[1], "another"])
    assert _untouched(out)
    with pytest.raises(CorruptChunk, match="expected"):  # out of order: chunk 1 holds other tokens
        codec.decode_many_into([blobs[0], blobs[2], blobs[1]], out, [10, 8, 12])
    assert _untouched(out)
    with pytest.raises(CorruptChunk, match="expected"):  # sizes that lie about a chunk
        codec.decode_many_into(blobs, out, [11, 11, 8])
    assert _untouched(out)
    with pytest.raises(ConfigError, match="do not tile"):
        codec.decode_many_into(blobs[:2], out, sizes[:2])
    with pytest.raises(ConfigError, match="keys"):
        codec.decode_many_into(blobs, out, sizes, keys=keys[:2])
    damaged = bytearray(blobs[1])
    damaged[len(damaged) // 2] ^= 0x40
    with pytest.raises(CorruptChunk):  # a section's checksum, found mid-way: ``out`` may be partly written
        codec.decode_many_into([blobs[0], bytes(damaged), blobs[2]], out, sizes, keys=keys)


def test_no_chunks_is_an_empty_range(profile):
    codec = Codec(profile, threads=1)
    out = KVCache.allocate(_kv(4, 4), 0, start=9)
    assert codec.decode_many_into([], out, []) is out


class _OneAtATime:
    """A codec without decode_many_into (or decode_into): the helper decodes and copies each chunk."""

    def __init__(self, codec: Codec):
        self.codec, self.levels, self.calls = codec, codec.levels, 0

    def encode(self, kv, level, *, key=None):
        return self.codec.encode(kv, level, key=key)

    def decode(self, data, *, key=None):
        self.calls += 1
        return self.codec.decode(data, key=key)


def test_the_helper_falls_back_to_one_chunk_at_a_time(profile):
    codec = Codec(profile, threads=1)
    plain = _OneAtATime(codec)
    assert not isinstance(plain, DecodesManyInto)
    sizes = [5, 9, 7]
    whole, blobs, keys = _chunks(5, sizes, [1, 4, 6], codec)
    out = _filled(whole, whole.num_tokens)
    decode_many_into(plain, blobs, out, sizes, keys=keys)
    assert plain.calls == 3
    _same(out, _one_by_one(codec, blobs, whole, sizes, keys))
    with pytest.raises(CorruptChunk):  # a chunk that is not where the sizes put it
        decode_many_into(plain, [blobs[1], blobs[0], blobs[2]], out, [9, 5, 7])
    with pytest.raises(ConfigError, match="do not tile"):
        decode_many_into(plain, blobs, out, [5, 9, 8])


def test_lossy_chunks_of_two_dtypes_keep_each_chunks_rounding(profile):
    """A bf16 chunk's values are bf16 values in a float32 cache too, next to a float32 chunk's."""
    codec = Codec(profile, threads=2)
    whole = _kv(6, 40)
    blobs = [codec.encode(whole.slice(0, 20), 4), codec.encode(whole.slice(20, 40).to(torch.bfloat16), 4)]
    ref = _one_by_one(codec, blobs, whole, [20, 20], [None, None])
    out = _filled(whole, 40)
    codec.decode_many_into(blobs, out, [20, 20])
    _same(out, ref)
    alone = codec.decode(blobs[1])  # the bf16 chunk decoded on its own, then widened
    for a, b in zip(out.slice(20, 40).layers, alone.layers, strict=True):
        assert torch.equal(a.k, b.k.float()) and torch.equal(a.v, b.v.float())


def test_self_contained_chunks_decode_with_their_own_profiles():
    """Chunks that carry their profile (no shared one) decode into a cache one or several at a time."""
    codec = Codec(None, threads=1)
    whole = _kv(7, 30)
    blobs = [codec.encode(whole.slice(0, 10), 4), codec.encode(whole.slice(10, 30), 6)]
    ref = _filled(whole, 30)
    codec.decode_into(blobs[0], ref.slice(0, 10))
    codec.decode_into(blobs[1], ref.slice(10, 30))
    for a, b in zip(ref.slice(10, 30).layers, codec.decode(blobs[1]).layers, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    out = _filled(whole, 30)
    codec.decode_many_into(blobs, out, [10, 20])
    _same(out, ref)


@pytest.mark.parametrize(
    ("n", "threads", "per_thread", "sizes"),
    [
        (60, 2, 2, [15] * 4),
        (61, 2, 2, [15, 15, 15, 16]),
        (60, 2, 8, [3, 4, 4, 4] * 4),
        (60, 3, 2, [10] * 6),
        (60, 1, 2, [60]),
        (60, 1, 8, [60]),
        (3, 2, 2, [1, 1, 1]),
        (1, 2, 2, [1]),
        (5, 2, 0, [2, 3]),
        (0, 2, 2, []),
    ],
)
def test_decode_jobs_split_sections_into_runs_the_threads_share_evenly(n, threads, per_thread, sizes):
    """``per_thread`` jobs per thread (at least one; one job on one thread, none for no sections),
    never more than the sections, each a run of consecutive sections, sizes differing by at most one."""
    from cachegen.codec.codec import decode_jobs

    sections = list(range(n))
    jobs = decode_jobs(sections, threads, per_thread)
    assert [len(j) for j in jobs] == sizes and [s for j in jobs for s in j] == sections


def test_decode_jobs_default_to_two_per_thread_and_the_codec_uses_its_setting(profile):
    from cachegen.codec.codec import decode_jobs

    assert [len(j) for j in decode_jobs(list(range(60)), 2)] == [15] * 4
    c = Codec(profile, threads=3)  # threads != jobs_per_thread: the two are not interchangeable
    try:
        assert c.jobs_per_thread == 2
        assert [len(j) for j in c._split(list(range(60)), lossy=True)] == [10] * 6
        c.jobs_per_thread = 8
        assert [len(j) for j in c._split(list(range(60)), lossy=True)] == [2, 3] * 12
        assert c._split(list(range(60)), lossy=False) == [[s] for s in range(60)]  # lossless: one per job
    finally:
        c.close()
