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
    assert store.lookup([*toks, 7, 8, 9]) == 48  # the partial chunk's key covers exactly 50 tokens
    assert store.lookup([1, *toks[1:]]) == 0
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
        enc.encode(kv.slice(48, 50), 2, key=plan[3].ref.key),
        enc.encode(kv.slice(0, 16), 0, key=plan[0].ref.key),
    ]
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
    store.backend.put_chunks(
        [
            ChunkWrite(refs[0].key, token_bytes(toks[:16]), {0: b"a"}),
            ChunkWrite(refs[2].key, token_bytes(toks[32:]), {0: b"c"}),
        ]
    )
    assert store.lookup(toks) == 16
    assert [i.cached for i in store.plan(toks)] == [True, False, True]


def test_same_keys_in_every_backend(store, kv_factory):
    """The loader can move between stores: the key of a chunk is a function of the tokens alone."""
    toks = list(range(30))
    refs = store.put_context(toks, kv_factory(30), levels=[0])
    assert refs == chunk_keys(toks, store.namespace, 16)


# -- the chunk size recorded with the namespace ------------------------------------------


def test_a_store_keeps_one_chunk_size_per_namespace(store, kv_factory):
    toks = list(range(40))
    store.put_context(toks, kv_factory(40), levels=[0])
    with pytest.raises(ConfigError, match="16 tokens each, not 32: pass --chunk-tokens 16"):
        # it would silently find nothing: every key differs with 32-token chunks (a local store
        # says so when it opens, Redis on the first call)
        ContextStore(store.backend, store.namespace, store.encoder, chunk_tokens=32).lookup(toks)
    with pytest.raises(ConfigError, match="--chunk-tokens 16"):
        ContextStore(store.backend, store.namespace, store.encoder, chunk_tokens=32).put_context(toks, kv_factory(40))
    adopted = ContextStore(store.backend, store.namespace, store.encoder, chunk_tokens=None)
    assert adopted.lookup(toks) == 40 and adopted.chunk_tokens == 16
    from dataclasses import replace

    elsewhere = ContextStore(
        store.backend, replace(store.namespace, profile_id="another"), store.encoder, chunk_tokens=32
    )
    assert elsewhere.lookup(toks) == 0  # another namespace keeps its own size
    elsewhere.put_context(toks, kv_factory(40), levels=[0])
    assert elsewhere.lookup(toks) == 40
    store.backend.clear()  # an empty store takes any size again
    fresh = ContextStore(store.backend, store.namespace, store.encoder, chunk_tokens=32)
    fresh.put_context(toks, kv_factory(40), levels=[0])
    assert fresh.lookup(toks) == 40


# -- contexts: store ls / store rm ------------------------------------------------------------


def test_list_and_remove_contexts(store, kv_factory):
    from cachegen.store import list_contexts, remove_context

    a, b, c = list(range(48)), list(range(48)) + list(range(900, 920)), list(range(5000, 5020))
    kv_b = kv_factory(68, seed=2)
    store.put_context(b, kv_b)  # b: 5 chunks; a is its 3-chunk prefix
    store.put_context(a, kv_b.slice(0, 48))
    store.put_context(c, kv_factory(20, seed=3), levels=[1])
    rows = {r.tokens: r for r in list_contexts(store.backend)}
    assert sorted(rows) == [20, 48, 68]
    sizes = {i.ref.key: sum(i.sizes.values()) for t in (a, b, c) for i in store.plan(t)}
    for toks in (a, b, c):
        plan = store.plan(toks)
        r = rows[len(toks)]
        assert (r.id, r.chunks, r.bytes, r.complete) == (
            plan[-1].ref.key,
            len(plan),
            sum(sizes[i.ref.key] for i in plan),
            True,
        )
    assert rows[48].levels == [0, 1, 2] and rows[20].levels == [1]
    with pytest.raises(ConfigError, match="at least 8"):
        remove_context(store.backend, rows[68].id[:4])
    with pytest.raises(ConfigError, match="no context"):
        remove_context(store.backend, "f" * 16 if not rows[68].id.startswith("f" * 16) else "e" * 16)
    # removing b removes only its own two chunks: a, its prefix, still loads whole
    assert remove_context(store.backend, rows[68].id[:12]) == 2
    assert store.lookup(b) == 48 and store.lookup(a) == 48
    assert sorted(r.tokens for r in list_contexts(store.backend)) == [20, 48]
    # removing a prefix of a longer context keeps the chunks the longer one needs
    store.put_context(b, kv_b)
    assert remove_context(store.backend, rows[48].id) == 0
    assert sorted(r.tokens for r in list_contexts(store.backend)) == [20, 68] and store.lookup(b) == 68
    assert remove_context(store.backend, rows[20].id.upper()) == 2 and store.lookup(c) == 0
