"""Chaos in the middle of a load: a real redis-server killed, paused (SIGSTOP), slowed (DEBUG SLEEP),
and a foreign chunk swapped in under another key, with the real codec on SmolLM2's KV (bf16).

Each load must give the tokens of a full recompute through the loader (policy "text": in bf16,
chunked and single-pass prefill differ, so that is the reference) and end within the deadline plus
the recompute time. The context is 4 chunks of 256 tokens stored lossless from the text-policy
load itself, and the chaos strikes before the last chunk's fetch, so the fallback recomputes
exactly what the text policy computes for it: the answer must be identical, not just close.
"""

from __future__ import annotations

import copy
import signal
from dataclasses import dataclass

import pytest
import torch

from cachegen.bench.quality import text_ids
from cachegen.codec import FORMAT_VERSION, LOSSLESS, Codec
from cachegen.engine.hf_cache import values_per_token
from cachegen.engine.prefill import greedy_generate, prefill
from cachegen.kv import KVCache
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream import DirectLink, LoaderOptions, StreamingLoader
from cachegen.stream.costs import TEXT

pytestmark = [pytest.mark.redis, pytest.mark.model]

CHUNK = 256
N_CHUNKS = 4
NEW_TOKENS = 6
MARGIN_S = 0.5  # thread hand-offs and store round trips on a busy 2-core machine
# Deadlines are generous (3-10 s for a load that takes ~0.2 s on a quiet machine): a test must not
# depend on how fast this machine decodes; a loader that waited for a paused or sleeping server
# (8 s) would still exceed them.


# -- a private redis-server per test (it is killed or paused) --------------------------------


@pytest.fixture
def redis_server(redis_factory):
    """A server of this test's own (the shared one of tests/store/servers.py must not be killed)."""
    return redis_factory()


def _url(srv) -> str:
    return f"{srv.url}?timeout=5"


# -- the model, the context and the reference answer (once per module) -------------------------


@dataclass
class Setup:
    model: object
    codec: Codec
    namespace: Namespace
    ctx: list[int]
    question: list[int]
    ref_kv: KVCache  # the text policy's cache
    ref_tokens: list[int]  # and its greedy answer
    foreign_kv: KVCache  # another text's KV, for the swapped chunk

    def recompute(self, prefix, ids):
        return prefill(self.model, ids, prefix=prefix)

    def loader(self, store, policy=LOSSLESS, slo_s: float | None = 1.0, link=None) -> StreamingLoader:
        opts = LoaderOptions(
            policy=policy, slo_s=slo_s, dtype=torch.bfloat16, values_per_token=values_per_token(self.model.config)
        )
        return StreamingLoader(store, self.codec, self.recompute, opts, link=link)

    def answer(self, kv: KVCache) -> list[int]:
        return greedy_generate(self.model, kv, self.ctx[kv.end :] + self.question, NEW_TOKENS)


@pytest.fixture(scope="module")
def setup(smollm2, tmp_path_factory):
    model = copy.deepcopy(smollm2.model).to(torch.bfloat16)  # the serving dtype; the shared fixture stays fp32
    ids = text_ids(smollm2.tokenizer, "pydoc-eval", N_CHUNKS * CHUNK + 24)
    ctx, question = ids[: N_CHUNKS * CHUNK], ids[N_CHUNKS * CHUNK :]
    codec = Codec(None, smollm2.fingerprint)
    ns = Namespace(f"{smollm2.fingerprint}-bfloat16", FORMAT_VERSION, "chaos")
    s = Setup(model, codec, ns, ctx, question, None, [], None)  # type: ignore[arg-type]
    # another text's KV: the foreign chunk, and what the text policy's plan needs stored under the
    # context's keys (it only reads the sizes: every chunk is recomputed)
    s.foreign_kv = prefill(model, text_ids(smollm2.tokenizer, "pydoc-calib", N_CHUNKS * CHUNK))
    local = ContextStore(open_backend(f"file://{tmp_path_factory.mktemp('chaos') / 'store'}"), ns, codec, CHUNK)
    local.put_context(ctx, s.foreign_kv, levels=[LOSSLESS])
    res = s.loader(local, policy=TEXT, slo_s=None).load(ctx)
    assert res.choices == [TEXT] * N_CHUNKS and res.cached_tokens == len(ctx)
    local.backend.close()
    s.ref_kv, s.ref_tokens = res.kv, s.answer(res.kv)
    return s


def _store(setup: Setup, url: str) -> ContextStore:
    """The reference cache in Redis, lossless: a load without faults gives exactly the reference."""
    store = ContextStore(open_backend(url), setup.namespace, setup.codec, CHUNK)
    store.put_context(setup.ctx, setup.ref_kv, levels=[LOSSLESS])
    return store


class ChaosLink(DirectLink):
    """The real network, with ``action()`` run once just before chunk ``at`` is requested."""

    def __init__(self, at: int, action):
        self.at, self.action, self.done = at, action, False

    def fetch(self, get, ref, level):
        if ref.index == self.at and not self.done:
            self.done = True
            self.action()
        return get(ref, level)


def _check(setup: Setup, res, slo: float, fault: str) -> None:
    assert res.choices == [LOSSLESS] * (N_CHUNKS - 1) + [TEXT], res.summary()
    assert res.decisions[-1].reason == "fault" and len(res.faults) == 1 and fault in res.faults[0], res.faults
    assert res.cached_tokens == len(setup.ctx)
    for a, b in zip(res.kv.layers, setup.ref_kv.layers):  # the text policy's cache, bit for bit
        assert a.k.equal(b.k) and a.v.equal(b.v)
    assert setup.answer(res.kv) == setup.ref_tokens
    assert res.load_s <= slo + res.recompute_s + res.stitch_s + MARGIN_S, res.summary()


def test_without_chaos_the_stored_cache_gives_the_reference(setup, redis_server):
    store = _store(setup, _url(redis_server))
    res = setup.loader(store).load(setup.ctx)
    assert res.choices == [LOSSLESS] * N_CHUNKS and not res.faults
    assert setup.answer(res.kv) == setup.ref_tokens
    store.backend.close()


def test_redis_killed_mid_load(setup, redis_server):
    store = _store(setup, _url(redis_server))
    link = ChaosLink(N_CHUNKS - 1, lambda: redis_server.signal(signal.SIGKILL))
    res = setup.loader(store, slo_s=10.0, link=link).load(setup.ctx)
    _check(setup, res, 10.0, "StoreUnavailable")
    store.backend.close()


def test_redis_paused_mid_load(setup, redis_server):
    store = _store(setup, _url(redis_server))
    link = ChaosLink(N_CHUNKS - 1, lambda: redis_server.signal(signal.SIGSTOP))
    try:
        res = setup.loader(store, slo_s=3.0, link=link).load(setup.ctx)
    finally:
        redis_server.signal(signal.SIGCONT)
    _check(setup, res, 3.0, f"chunk {N_CHUNKS - 1}")
    store.backend.close()


def test_redis_slowed_by_debug_sleep_mid_load(setup, redis_server):
    store = _store(setup, _url(redis_server))
    socks = []
    link = ChaosLink(N_CHUNKS - 1, lambda: socks.append(redis_server.debug_sleep(8)))
    res = setup.loader(store, slo_s=3.0, link=link).load(setup.ctx)
    _check(setup, res, 3.0, f"chunk {N_CHUNKS - 1}")  # it did not wait for the server to wake up (8 s)
    for s in socks:
        s.close()
    store.backend.close()


def test_foreign_chunk_swapped_in_under_another_key(setup, redis_server):
    """Another context's chunk at the same positions, copied over the last chunk's key with its store
    checksum intact: only the chunk's own key digest can tell, and the loader must recompute it."""
    store = _store(setup, _url(redis_server))
    other = [t + 1 for t in setup.ctx]  # another context: every chunk key differs
    foreign = ContextStore(open_backend(_url(redis_server)), setup.namespace, setup.codec, CHUNK)
    foreign.put_context(other, setup.foreign_kv, levels=[LOSSLESS])
    mine, theirs = store.plan(setup.ctx)[-1].ref, foreign.plan(other)[-1].ref
    client = store.backend.client
    client.set(f"cg:{{{mine.key}}}:{LOSSLESS}", client.get(f"cg:{{{theirs.key}}}:{LOSSLESS}"))
    res = setup.loader(store, slo_s=10.0).load(setup.ctx)
    _check(setup, res, 10.0, "KeyMismatch")
    foreign.backend.close()
    store.backend.close()
