"""Decoding into a preallocated cache: the same bits as decode + concat, for every level of the
project codec, sliding-window layers and a cast to the model's dtype; the loader never joins
chunks (``KVCache.concat`` is not called) and still degrades to recompute on a fault."""

from __future__ import annotations

import pytest
import torch

from cachegen.codec import LOSSLESS, Codec, calibrate
from cachegen.codec.protocol import DecodesInto, decode_into
from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import KVCache, KVLayer, LayerKind
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream import LoaderOptions, StreamingLoader, ThroughputEstimator
from cachegen.stream.costs import TEXT
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
