"""Decoding into a preallocated cache: the same bits as decode + concat, for every level of the
project codec, sliding-window layers and a cast to the model's dtype; the loader never joins
chunks (``KVCache.concat`` is not called) and still degrades to recompute on a fault."""

from __future__ import annotations

import pytest
import torch

from cachegen.codec import LOSSLESS, Codec, calibrate
from cachegen.codec.protocol import DecodesInto, DecodesManyInto, decode_into
from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import ROOM_TOKENS, KVCache, KVLayer, LayerKind
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream import FormatLadder, LoaderOptions, Rung, StreamingLoader, ThroughputEstimator
from cachegen.stream.costs import TEXT
from cachegen.stream.pipeline import VirtualClock, VirtualRunner
from stream.fakes import FaultyStore, ToyCodec, ToyModel

CHUNK = 32


def kv_with_windows(seed: int, tokens: int, start: int = 0, dtype=torch.float32) -> KVCache:
    """Three layers, the middle one a sliding-window layer (which keeps every token in a KVCache)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(3):
        k = torch.randn(2, tokens, 16, generator=g) * (1 + i) + 0.5
        v = torch.randn(2, tokens, 16, generator=g) * 0.3
        sliding = i == 1
        layers.append(
            KVLayer(k.to(dtype), v.to(dtype), LayerKind.SLIDING if sliding else LayerKind.FULL, 8 if sliding else None)
        )
    return KVCache(layers, start=start)


def same_bits(a: KVCache, b: KVCache) -> None:
    assert (a.start, a.end, a.dtype) == (b.start, b.end, b.dtype)
    assert a.same_layout(b)
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(calibrate([kv_with_windows(100 + i, 160) for i in range(2)], "fp-test"), "fp-test")


def test_write_equals_concat_with_a_cast():
    whole = kv_with_windows(1, 3 * CHUNK + 5)
    parts = whole.chunks(CHUNK)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = KVCache.allocate(parts[0], whole.num_tokens, dtype=dtype)
        for p in reversed(parts):  # any order: each part has its own range
            out.write(p)
        same_bits(out, KVCache.concat([p.to(dtype) for p in parts]))


def test_write_refuses_a_part_outside_or_of_another_layout():
    out = KVCache.allocate(kv_with_windows(1, CHUNK), 2 * CHUNK)
    with pytest.raises(ConfigError):
        out.write(kv_with_windows(2, CHUNK, start=CHUNK + 1))
    other = kv_with_windows(3, CHUNK)
    other.layers[1].window = 4
    with pytest.raises(ConfigError):
        out.write(other)


@pytest.mark.parametrize("level", [LOSSLESS, 1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_equals_decode_and_concat_at_every_level(codec, level, dtype):
    whole = kv_with_windows(5, 3 * CHUNK)
    blobs = [codec.encode(c, level, key=f"k{i}") for i, c in enumerate(whole.chunks(CHUNK))]
    ref = KVCache.concat([codec.decode(b, key=f"k{i}").to(dtype) for i, b in enumerate(blobs)])
    out = KVCache.allocate(whole, whole.num_tokens, dtype=dtype)
    assert isinstance(codec, DecodesInto)
    for i, (b, c) in enumerate(zip(blobs, whole.chunks(CHUNK))):
        codec.decode_into(b, out.slice(c.start, c.end), key=f"k{i}")
    same_bits(out, ref)


def test_decode_into_checks_the_header_before_writing(codec):
    whole = kv_with_windows(6, 2 * CHUNK)
    blob = codec.encode(whole.slice(0, CHUNK), 3)
    out = KVCache.allocate(whole, 2 * CHUNK)
    for l in out.layers:
        l.k.fill_(7.0)
        l.v.fill_(7.0)
    with pytest.raises(CorruptChunk, match="expected"):
        codec.decode_into(blob, out.slice(CHUNK, 2 * CHUNK))  # another range
    all_full = KVCache([KVLayer(l.k, l.v) for l in out.layers])  # the sliding layer's kind differs
    with pytest.raises(CorruptChunk, match="layout"):
        codec.decode_into(blob, all_full.slice(0, CHUNK))
    assert all(bool((l.k == 7.0).all() and (l.v == 7.0).all()) for l in out.layers)  # nothing was written


def test_the_fallback_decodes_and_copies_for_a_codec_without_decode_into():
    toy = ToyCodec()
    assert not isinstance(toy, DecodesInto)
    kv = kv_with_windows(7, CHUNK, start=CHUNK)
    kv = KVCache([KVLayer(l.k, l.v) for l in kv.layers], start=CHUNK)  # the toy codec keeps no layer kinds
    out = KVCache.allocate(kv, 2 * CHUNK)
    decode_into(toy, toy.encode(kv, 0), out.slice(CHUNK, 2 * CHUNK))
    same_bits(out.slice(CHUNK, 2 * CHUNK), kv)
    with pytest.raises(CorruptChunk):
        decode_into(toy, toy.encode(kv, 0), out.slice(0, CHUNK))


# -- the loader ----------------------------------------------------------------------------


def with_kinds(kv: KVCache) -> KVCache:
    """``kv`` with layer 1 a sliding-window layer, as a real model's recompute would label it."""
    return KVCache(
        [KVLayer(l.k, l.v, LayerKind.SLIDING, 8) if i == 1 else KVLayer(l.k, l.v) for i, l in enumerate(kv.layers)],
        start=kv.start,
    )


class SlidingToyModel(ToyModel):
    def recompute(self, prefix: KVCache | None, token_ids: list[int]) -> KVCache:
        return with_kinds(super().recompute(prefix, token_ids))


@pytest.fixture
def real_store(tmp_path, codec):
    model = SlidingToyModel(layers=3, heads=2, head_dim=16)
    tokens = [(5 * i + 1) % 97 for i in range(4 * CHUNK + 7)]
    kv = model.full(tokens, CHUNK)
    store = ContextStore(open_backend(f"file://{tmp_path / 'store'}"), Namespace("toy", 1, "cg"), codec, CHUNK)
    store.put_context(tokens, kv, levels=(LOSSLESS, 2, 7))
    yield model, store, tokens, kv
    store.backend.close()


def no_concat(monkeypatch):
    def refuse(parts):
        raise AssertionError("the loader joined chunks")

    monkeypatch.setattr(KVCache, "concat", staticmethod(refuse))


@pytest.mark.parametrize("level", [LOSSLESS, 2, 7])
def test_load_is_bit_identical_to_decode_and_concat_and_joins_nothing(real_store, codec, level, monkeypatch):
    model, store, tokens, _kv = real_store
    infos = store.plan(tokens)
    ref = KVCache.concat([codec.decode(store.get(i.ref, level), key=i.ref.key).to(torch.bfloat16) for i in infos])
    no_concat(monkeypatch)
    loader = StreamingLoader(
        store, codec, model.recompute, LoaderOptions(policy=level, slo_s=None, dtype=torch.bfloat16)
    )
    res = loader.load(tokens)
    assert not res.faults and res.choices == [level] * len(infos)
    same_bits(res.kv, ref)
    assert res.stitch_s == 0.0
    room = res.kv.take_room()  # room after the full layers for the decoding session that takes the result
    assert room is not None and room[1] is None
    assert room[0] is not None and room[0][0].shape[1] == res.kv.num_tokens + ROOM_TOKENS


def test_adaptive_order_fills_every_range(real_store, codec, monkeypatch):
    """The adaptive policy fetches the last chunk first: the cache is allocated from it and every
    other chunk lands in its own range."""
    model, store, tokens, _kv = real_store
    infos = store.plan(tokens)
    no_concat(monkeypatch)
    opts = LoaderOptions(policy="adaptive", slo_s=None)
    res = StreamingLoader(store, codec, model.recompute, opts, estimator=ThroughputEstimator(prior_gbps=1.0)).load(
        tokens
    )
    monkeypatch.undo()
    ref = KVCache.concat([codec.decode(store.get(i.ref, c), key=i.ref.key) for i, c in zip(infos, res.choices)])
    same_bits(res.kv, ref)


@pytest.mark.parametrize("fault", ["corrupt", "missing"])
def test_a_fault_recomputes_the_rest_on_top_of_the_good_prefix(real_store, codec, fault):
    model, store, tokens, _kv = real_store
    infos = store.plan(tokens)
    bad = FaultyStore(store, {2: fault})
    res = StreamingLoader(bad, codec, model.recompute, LoaderOptions(policy=LOSSLESS, slo_s=None)).load(tokens)
    assert len(res.faults) == 1 and res.choices[2:] == [TEXT] * (len(infos) - 2)
    good = KVCache.concat([codec.decode(store.get(i.ref, LOSSLESS), key=i.ref.key) for i in infos[:2]])
    rest = model.recompute(good, tokens[good.end :])
    same_bits(res.kv, KVCache.concat([good, rest.to(good.dtype)]))


def test_a_corrupt_last_chunk_fetched_first_is_recomputed_not_used(real_store, codec):
    """The early (last) chunk allocates the cache; when its decode fails half-way its range is
    recomputed last, so no partly written value reaches the result."""
    model, store, tokens, _kv = real_store
    infos = store.plan(tokens)
    last = len(infos) - 1
    bad = FaultyStore(store, {last: "corrupt"})
    opts = LoaderOptions(policy="adaptive", slo_s=None, levels=(LOSSLESS,))
    res = StreamingLoader(bad, codec, model.recompute, opts, estimator=ThroughputEstimator(prior_gbps=1.0)).load(tokens)
    assert res.choices[last] == TEXT and res.decisions[last].reason == "fault"
    good = KVCache.concat([codec.decode(store.get(i.ref, LOSSLESS), key=i.ref.key) for i in infos[:last]])
    rest = model.recompute(good, tokens[good.end :])
    same_bits(res.kv, KVCache.concat([good, rest.to(good.dtype)]))


# -- chunks fetched ahead decode together ---------------------------------------------------


class SpyCodec:
    """The project codec, recording each decode call; each call takes ``call_s`` on ``clock`` (the
    first chunk's, which allocates the cache, ``first_s``: long enough for every fetch to queue)."""

    def __init__(self, codec: Codec, clock: VirtualClock, first_s: float = 1.0, call_s: float = 0.01):
        self.codec, self.clock, self.first_s, self.call_s = codec, clock, first_s, call_s
        self.levels = codec.levels
        self.calls: list[tuple[str, int]] = []

    def encode(self, kv, level, *, key=None):
        return self.codec.encode(kv, level, key=key)

    def decode(self, data, *, key=None):
        self.calls.append(("decode", 1))
        self.clock.sleep(self.first_s)
        return self.codec.decode(data, key=key)

    def decode_into(self, data, out, *, key=None):
        self.calls.append(("into", 1))
        self.clock.sleep(self.call_s)
        return self.codec.decode_into(data, out, key=key)

    def decode_many_into(self, datas, out, sizes, *, keys=None):
        self.calls.append(("many", len(datas)))
        self.clock.sleep(self.call_s)
        return self.codec.decode_many_into(datas, out, sizes, keys=keys)


def batched_load(store, codec, model, tokens, faults=None):
    clock = VirtualClock()
    spy = SpyCodec(codec, clock)
    src = FaultyStore(store, faults or {})
    opts = LoaderOptions(policy=7, slo_s=None, dtype=torch.bfloat16)
    res = StreamingLoader(src, spy, model.recompute, opts, clock=clock, runner=VirtualRunner(clock)).load(tokens)
    return res, spy


def test_chunks_fetched_ahead_decode_in_one_call_to_the_same_bits(real_store, codec):
    model, store, tokens, _kv = real_store
    infos = store.plan(tokens)
    res, spy = batched_load(store, codec, model, tokens)
    assert spy.calls == [("decode", 1), ("many", len(infos) - 1)]  # the rest waited while the first decoded
    assert not res.faults and res.choices == [7] * len(infos)
    same_bits(
        res.kv, KVCache.concat([codec.decode(store.get(i.ref, 7), key=i.ref.key).to(torch.bfloat16) for i in infos])
    )
    batch = res.decisions[1:]
    assert len({(d.decode_start, d.decode_end) for d in batch}) == 1  # one call...
    total = sum(d.decode_s for d in batch)
    assert total == pytest.approx(spy.call_s)  # ...whose time the chunks share by tokens
    assert batch[-1].decode_s < batch[0].decode_s  # the last chunk is the shortest (7 tokens)


def test_a_corrupt_chunk_in_a_batch_is_found_one_by_one_and_only_it_and_after_recomputed(real_store, codec):
    model, store, tokens, _kv = real_store
    infos = store.plan(tokens)
    res, spy = batched_load(store, codec, model, tokens, {2: "corrupt"})
    # the batch fails; chunk 1 decodes alone, chunk 2 fails: nothing after it is decoded
    assert spy.calls == [("decode", 1), ("many", len(infos) - 1), ("into", 1), ("into", 1)]
    assert len(res.faults) == 1 and "chunk 2" in res.faults[0]
    assert res.choices == [7, 7] + [TEXT] * (len(infos) - 2)
    assert [d.reason for d in res.decisions[2:]] == ["fault"] + ["after fault"] * (len(infos) - 3)
    good = KVCache.concat([codec.decode(store.get(i.ref, 7), key=i.ref.key) for i in infos[:2]]).to(torch.bfloat16)
    rest = model.recompute(good, tokens[good.end :])
    same_bits(res.kv, KVCache.concat([good, rest.to(torch.bfloat16)]))


def test_a_ladder_sends_each_run_of_one_codec_in_one_call(codec, monkeypatch):
    """Rungs of the project codec at two levels and a codec without decode_into: the codec's runs
    go to its decode_many_into (levels mixed), the other's chunks one by one; the same bits as
    the ladder's decode_into per chunk, and the bytes naming a rung are checked."""
    whole = kv_with_windows(9, 5 * CHUNK)
    whole = KVCache([KVLayer(l.k, l.v) for l in whole.layers])  # the toy codec keeps no layer kinds
    toy = ToyCodec()
    lad = FormatLadder([Rung("cg/L3", codec, 3), Rung("cg/L7", codec, 7), Rung("toy", toy, 0)])
    rungs = [0, 1, 2, 0, 1]
    parts = whole.chunks(CHUNK)
    blobs = [lad.encode(p, r, key=f"k{j}") for j, (p, r) in enumerate(zip(parts, rungs))]
    keys = [f"k{j}" for j in range(len(parts))]
    ref = KVCache.allocate(whole, whole.num_tokens)
    for b, p, k in zip(blobs, parts, keys):
        lad.decode_into(b, ref.slice(p.start, p.end), key=k)
    runs: list[int] = []
    real = codec.decode_many_into
    monkeypatch.setattr(
        codec, "decode_many_into", lambda d, o, s, keys=None: runs.append(len(d)) or real(d, o, s, keys=keys)
    )
    out = KVCache.allocate(whole, whole.num_tokens)
    assert isinstance(lad, DecodesManyInto)
    lad.decode_many_into(blobs, out, [CHUNK] * len(parts), keys=keys)
    assert runs == [2, 2] and toy.decodes == 2  # one chunk through the toy codec for the reference, one here
    same_bits(out, ref)
    with pytest.raises(CorruptChunk, match="names rung"):
        lad.decode_many_into([blobs[0], bytes([9]) + blobs[1][1:]], out.slice(0, 2 * CHUNK), [CHUNK, CHUNK])
    with pytest.raises(ConfigError, match="do not tile"):
        lad.decode_many_into(blobs, out, [CHUNK] * 4)


# -- the cache allocated from the first chunk's header ------------------------------------------

VPT = 3 * 2 * (16 + 16)  # the toy model: 3 layers, 2 heads, K and V of 16


def refuse_decode(monkeypatch, codec):
    def refuse(data, *, key=None):
        raise AssertionError("the loader decoded a chunk into a cache of its own")

    monkeypatch.setattr(codec, "decode", refuse)


@pytest.mark.parametrize("level", [LOSSLESS, 7])
def test_the_first_chunk_decodes_into_a_cache_allocated_from_its_header(real_store, codec, level, monkeypatch):
    """With the model's values per token known, the loader reads the first chunk's layout from its
    header, allocates the cache and decodes that chunk into it like every other: no chunk-sized
    cache is decoded and copied (``decode`` is never called), and the bits are the same."""
    model, store, tokens, _kv = real_store
    infos = store.plan(tokens)
    ref = KVCache.concat([codec.decode(store.get(i.ref, level), key=i.ref.key).to(torch.bfloat16) for i in infos])
    refuse_decode(monkeypatch, codec)
    opts = LoaderOptions(policy=level, slo_s=None, dtype=torch.bfloat16, values_per_token=VPT)
    res = StreamingLoader(store, codec, model.recompute, opts).load(tokens)
    assert not res.faults and res.choices == [level] * len(infos)
    same_bits(res.kv, ref)
    assert res.kv.meta == ref.meta


@pytest.mark.parametrize("vpt", [None, VPT - 1])
def test_without_the_models_values_per_token_the_first_chunk_is_decoded_first(real_store, codec, vpt, monkeypatch):
    """A header never sizes the allocation alone: with the values per token unknown, or not the
    header's, the first chunk is decoded into a cache of its own and copied, as before."""
    model, store, tokens, _kv = real_store
    calls = []
    real = codec.decode

    def counting(data, *, key=None):
        calls.append(key)
        return real(data, key=key)

    monkeypatch.setattr(codec, "decode", counting)
    opts = LoaderOptions(policy=7, slo_s=None, values_per_token=vpt)
    res = StreamingLoader(store, codec, model.recompute, opts).load(tokens)
    assert not res.faults and len(calls) == 1


def test_a_first_chunk_that_fails_after_its_header_leaves_no_cache_of_its_layout(real_store, codec):
    """The first chunk's header is sound and its payload corrupt: the cache allocated from the
    header is dropped with it, and the load recomputes from the start into a cache of the
    recompute's layout, as a full recompute gives it."""
    model, store, tokens, _kv = real_store
    bad = FaultyStore(store, {0: "corrupt"})
    opts = LoaderOptions(policy=LOSSLESS, slo_s=None, values_per_token=VPT)
    res = StreamingLoader(bad, codec, model.recompute, opts).load(tokens)
    assert len(res.faults) == 1 and set(res.choices) == {TEXT}
    want = model.recompute(None, tokens[: res.kv.end])
    same_bits(res.kv, want.to(res.kv.dtype))
