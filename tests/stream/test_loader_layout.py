"""The load's cache allocated from the first chunk's header (:meth:`StreamingLoader.layout`): the
first chunk then decodes into the cache like every later one, with no chunk-sized cache decoded
and copied; only when the header gives the model's values per token; and a first chunk that
fails leaves no cache behind. Toy codec and model (the loader's mutation run holds these)."""

from __future__ import annotations

import torch

from cachegen.kv import ROOM_TOKENS, KVCache
from cachegen.store import Namespace
from cachegen.stream import LoaderOptions, StreamingLoader
from cachegen.stream.costs import TEXT
from stream.fakes import FaultyStore, LayoutToyCodec, ToyModel, stored_context

CHUNK = 16
VPT = 2 * 2 * 2 * 8  # the toy model: 2 layers, 2 heads, K and V of 8


def setup(codec, tmp_path, n_chunks=4):
    model = ToyModel()
    tokens = [(7 * i + 3) % 101 for i in range(n_chunks * CHUNK)]
    store = stored_context(
        tmp_path / "store", Namespace("toy", 1, "t"), codec, CHUNK, tokens, model.full(tokens, CHUNK)
    )
    return model, store, tokens


def load(store, codec, model, tokens, vpt, level=0):
    opts = LoaderOptions(policy=level, slo_s=None, values_per_token=vpt)
    return StreamingLoader(store, codec, model.recompute, opts).load(tokens)


def same(a: KVCache, b: KVCache) -> None:
    assert (a.start, a.end, a.dtype) == (b.start, b.end, b.dtype) and a.same_layout(b)
    assert all(torch.equal(x.k, y.k) and torch.equal(x.v, y.v) for x, y in zip(a.layers, b.layers))


def has_room(kv: KVCache) -> bool:
    """Whether the load's cache leaves ROOM_TOKENS after every layer for the decoding session."""
    room = kv.take_room()
    return room is not None and all(r is not None and r[0].shape[1] == kv.num_tokens + ROOM_TOKENS for r in room)


def test_the_first_chunk_decodes_into_a_cache_allocated_from_its_header(tmp_path):
    codec = LayoutToyCodec()
    model, store, tokens = setup(codec, tmp_path)
    for level in (0, 2):
        want = KVCache.concat([codec.decode(store.get(i.ref, level), key=i.ref.key) for i in store.plan(tokens)])
        codec.calls.clear()
        res = load(store, codec, model, tokens, VPT, level)
        assert not res.faults and res.choices == [level] * 4
        assert codec.calls == ["layout"] + ["into"] * 4  # one header read, no decode of its own
        same(res.kv, want)
        assert has_room(res.kv)


def test_the_cache_allocated_from_the_header_has_the_loaders_dtype(tmp_path):
    """``LoaderOptions.dtype`` sets the cache's dtype on this path too (else the header's)."""
    codec = LayoutToyCodec()
    model, store, tokens = setup(codec, tmp_path)
    want = KVCache.concat([codec.decode(store.get(i.ref, 0), key=i.ref.key) for i in store.plan(tokens)])
    opts = LoaderOptions(policy=0, slo_s=None, values_per_token=VPT, dtype=torch.bfloat16)
    codec.calls.clear()
    res = StreamingLoader(store, codec, model.recompute, opts).load(tokens)
    assert codec.calls[:2] == ["layout", "into"]
    same(res.kv, want.to(torch.bfloat16))


def test_without_the_models_values_per_token_the_first_chunk_is_decoded_and_copied(tmp_path):
    """A header never sizes the allocation alone: with the values per token unknown or not the
    header's, or a codec that cannot tell, the first chunk is decoded, then placed, as before."""
    for vpt, none in ((None, False), (VPT - 1, False), (VPT + 1, False), (VPT, True)):
        codec = LayoutToyCodec(layout_none=none)
        model, store, tokens = setup(codec, tmp_path / f"{vpt}{none}")
        want = KVCache.concat([codec.decode(store.get(i.ref, 0), key=i.ref.key) for i in store.plan(tokens)])
        codec.calls.clear()
        res = load(store, codec, model, tokens, vpt)
        assert not res.faults
        assert [c for c in codec.calls if c != "layout"] == ["decode"] + ["into"] * 3, vpt
        same(res.kv, want)
        assert has_room(res.kv)


def test_a_first_chunk_that_fails_after_its_header_leaves_no_cache_behind(tmp_path):
    """Chunk 0's header is sound, its bytes are not: the cache allocated from the header is dropped
    with it, and the load recomputes from chunk 0 on into a cache of the recompute's, as a full
    recompute gives it. A later chunk's fault recomputes on top of the header-allocated cache."""
    codec = LayoutToyCodec()
    model, store, tokens = setup(codec, tmp_path)
    res = load(FaultyStore(store, {0: "corrupt"}), codec, model, tokens, VPT)
    assert len(res.faults) == 1 and res.choices == [TEXT] * 4
    same(res.kv, model.recompute(None, tokens))
    codec.calls.clear()
    res = load(FaultyStore(store, {1: "corrupt"}), codec, model, tokens, VPT)
    assert len(res.faults) == 1 and res.choices == [0] + [TEXT] * 3
    first = codec.decode(store.get(store.plan(tokens)[0].ref, 0))
    same(res.kv, KVCache.concat([first, model.recompute(first, tokens[CHUNK:])]))
