"""ContextStore and the behaviour every backend shares (file, Redis, Redis Cluster)."""

from __future__ import annotations

import pytest

from cachegen.errors import ChunkNotFound, ConfigError
from cachegen.store import ChunkWrite, ContextStore, chunk_keys, open_backend, token_bytes

pytestmark = pytest.mark.redis


@pytest.fixture
def store(any_url, namespace, encoder):
    with open_backend(any_url) as backend:
        backend.clear()
        yield ContextStore(backend, namespace, encoder, chunk_tokens=16)


def test_put_lookup_plan_get(store, kv_factory):
    toks = list(range(100, 150))  # 3 full chunks and a partial one of 2 tokens
    kv = kv_factory(50)
    assert store.lookup(toks) == 0
    refs = store.put_context(toks, kv)
    assert [(r.start, r.end) for r in refs] == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert store.lookup(toks) == 50
    assert store.lookup(toks[:40]) == 32  # the stored chunk [32, 48) is not a prefix of 40 tokens
    assert store.lookup(toks + [7, 8, 9]) == 48  # the partial chunk's key covers exactly 50 tokens
    assert store.lookup([1] + toks[1:]) == 0
    plan = store.plan(toks)
    enc = store.encoder
    for info in plan:
        part = kv.slice(info.ref.start, info.ref.end)
        expected = {l: enc.encode(part, l, key=info.ref.key) for l in (0, 1, 2)}
        assert info.sizes == {l: len(b) for l, b in expected.items()}
        for l in (0, 1, 2):
            assert store.get(info.ref, l) == expected[l]
        assert store.tokens(info.ref) == toks[info.ref.start : info.ref.end]
    assert store.get_many([(plan[3].ref, 2), (plan[0].ref.key, 0)]) == [
        enc.encode(kv.slice(48, 50), 2, key=plan[3].ref.key), enc.encode(kv.slice(0, 16), 0, key=plan[0].ref.key)]
    stats = store.backend.stats().to_json()
    assert stats["contexts"] == 1 and stats["chunks"] == 4
    assert set(stats["levels"]) == {"0", "1", "2"} and stats["levels"]["1"]["chunks"] == 4
    assert stats["bytes"] == sum(sum(i.sizes.values()) for i in plan)


def test_missing_chunk_and_level(store, kv_factory):
    toks = list(range(20))
    refs = store.put_context(toks, kv_factory(20), levels=[1])
    with pytest.raises(ChunkNotFound):
        store.get(refs[0], 0)
    with pytest.raises(ChunkNotFound):
        store.get(chunk_keys([9] * 20, store.namespace, 16)[0], 1)
    with pytest.raises(KeyError):  # ChunkNotFound is also a KeyError
        store.tokens(chunk_keys([9] * 20, store.namespace, 16)[0])
    assert store.plan(toks)[0].sizes.keys() == {1}


def test_put_skips_what_is_stored_and_adds_levels(store, kv_factory):
    toks, kv = list(range(40)), kv_factory(40)
    store.put_context(toks, kv, levels=[0])
    assert store.encoder.calls == 3
    assert store.put_context(toks, kv, levels=[0]) == []
    assert store.encoder.calls == 3
    store.put_context(toks, kv, levels=[0, 2])
    assert store.encoder.calls == 6
    assert all(i.sizes.keys() == {0, 2} for i in store.plan(toks))
    # a longer context sharing the first two chunks stores only its own chunks
    longer = toks + list(range(500, 520))
    written = store.put_context(longer, kv_factory(60, seed=1), levels=[0])
    assert [r.start for r in written] == [32, 48]
    assert store.backend.stats().contexts == 2


def test_suffix_kv_and_bad_ranges(store, kv_factory):
    toks = list(range(64))
    store.put_context(toks[:32], kv_factory(32))
    assert store.lookup(toks) == 32
    full = kv_factory(64, seed=3)
    written = store.put_context(toks, full.slice(32, 64))  # only what lookup did not find was prefilled
    assert [r.start for r in written] == [32, 48] and store.lookup(toks) == 64
    with pytest.raises(ConfigError):
        store.put_context(toks, full.slice(8, 64))  # not on a chunk boundary
    with pytest.raises(ConfigError):
        store.put_context(toks, full.slice(0, 60))  # does not reach the end
    with pytest.raises(ConfigError):
        ContextStore(store.backend, store.namespace).put_context(toks, full)  # no encoder


def test_plan_sees_chunks_after_a_hole(store, kv_factory):
    toks = list(range(48))
    refs = store.put_context(toks, kv_factory(48))
    # a hole in the middle: the later chunk is still valid (its key covers the whole prefix)
    store.backend.clear()
    store.backend.put_chunks([ChunkWrite(refs[0].key, token_bytes(toks[:16]), {0: b"a"}),
                              ChunkWrite(refs[2].key, token_bytes(toks[32:]), {0: b"c"})])
    assert store.lookup(toks) == 16
    assert [i.cached for i in store.plan(toks)] == [True, False, True]


def test_same_keys_in_every_backend(store, kv_factory):
    """The loader can move between stores: the key of a chunk is a function of the tokens alone."""
    toks = list(range(30))
    refs = store.put_context(toks, kv_factory(30), levels=[0])
    assert refs == chunk_keys(toks, store.namespace, 16)
