"""``mock://``: the in-memory backend and its injected faults (the shared behaviour runs in
``test_store_context.py`` through ``any_url``)."""

from __future__ import annotations

import time

import pytest
from store_helpers import NS, RawEncoder, make_kv

from cachegen.errors import ChunkNotFound, ConfigError, CorruptChunk, StoreUnavailable
from cachegen.store import ContextStore, open_backend
from cachegen.store.mock import forget


@pytest.fixture
def name(request):
    n = f"mock-{request.node.name}"
    yield n
    forget(n)


def test_one_store_per_name(name):
    cs = ContextStore(open_backend(f"mock://{name}"), NS, RawEncoder(), chunk_tokens=16)
    toks = list(range(40))
    cs.put_context(toks, make_kv(40))
    again = ContextStore(open_backend(f"mock://{name}?seed=4"), NS, RawEncoder(), chunk_tokens=16)
    assert again.lookup(toks) == 40 and again.get(cs.refs(toks)[0], 0) == cs.get(cs.refs(toks)[0], 0)
    assert ContextStore(open_backend(f"mock://{name}-other"), NS, chunk_tokens=16).lookup(toks) == 0


def test_latency_holds_the_timeout(name):
    b = open_backend(f"mock://{name}?latency=0.2")
    b.put_chunk(f"{1:064x}", b"", {0: b"x"})
    t = time.monotonic()
    assert b.get(f"{1:064x}", 0, timeout=5) == b"x"
    assert time.monotonic() - t >= 0.2  # the injected latency is really spent
    t = time.monotonic()
    with pytest.raises(StoreUnavailable, match="within"):
        b.sizes_many([f"{1:064x}"], timeout=0.05)
    assert time.monotonic() - t < 0.2  # but never past the caller's timeout


def test_injected_faults_are_deterministic(name):
    def outcomes(url):
        b = open_backend(url)
        b.put_chunk(f"{1:064x}", b"", {0: b"x"})
        out = []
        for _ in range(200):
            try:
                b.get(f"{1:064x}", 0)
                out.append("ok")
            except StoreUnavailable:
                out.append("down")
            except ChunkNotFound:
                out.append("missing")
            except CorruptChunk:
                out.append("corrupt")
        return out

    url = f"mock://{name}?fail=0.2&missing=0.1&corrupt=0.1&seed=7"
    first = outcomes(url)
    assert outcomes(url) == first  # same seed, same faults
    assert set(first) == {"ok", "down", "missing", "corrupt"}
    assert 20 < first.count("down") < 60 and first.count("ok") > 100
    assert outcomes(f"mock://{name}?fail=0.2&missing=0.1&corrupt=0.1&seed=8") != first


def test_bad_mock_urls():
    for bad in ("mock://", "mock://x?fail=2", "mock://x?latency=-1", "mock://x?nope=1"):
        with pytest.raises(ConfigError):
            open_backend(bad)
