"""The loader with real parts: the project's codec (SmolLM2's calibrated profile) on SmolLM2's KV,
through every store the store tests use (file, a real redis-server, a real 3-node Redis Cluster,
mock), with faults made in the store itself (a chunk deleted mid-load, another chunk's payload
under a key with a valid store checksum, a paused server).

Oracles that do not use the loader: the reference cache is the model's prefill chunk by chunk
(what the text policy computes), a level's cache is the codec's decode of what the store holds, and
a fallback's cache is that prefix plus the model's prefill of the rest on top of it; each must match
bit for bit, and greedy answers after it must match. Four chunks of 64 tokens keep it quick.
"""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from cachegen.bench.quality import text_ids
from cachegen.calibrate import load_or_calibrate
from cachegen.codec import FORMAT_VERSION, LOSSLESS, Codec
from cachegen.engine.hf_cache import values_per_token
from cachegen.engine.prefill import greedy_generate, prefill
from cachegen.kv import KVCache
from cachegen.store import ChunkRef, ChunkWrite, ContextStore, Namespace, chunk_keys, open_backend, token_bytes
from cachegen.stream import DirectLink, LoaderOptions, StreamingLoader, ThroughputEstimator
from cachegen.stream.costs import TEXT

pytestmark = [pytest.mark.model, pytest.mark.redis]

CHUNK = 64
N_CHUNKS = 4
NEW_TOKENS = 4
MARGIN_S = 0.5  # thread hand-offs and store round trips on a busy 2-core machine (see test_chaos_redis.py)


@dataclass
class Real:
    loaded: object
    codec: Codec
    namespace: Namespace
    ctx: list[int]
    question: list[int]
    ref_kv: KVCache  # prefill chunk by chunk: the text policy's cache
    memo: dict = field(default_factory=dict)  # oracles shared by the tests of every store (by content)

    def recompute(self, prefix: KVCache | None, ids: list[int]) -> KVCache:
        return prefill(self.loaded.model, ids, prefix=prefix)

    def answer(self, kv: KVCache) -> list[int]:
        return greedy_generate(self.loaded.model, kv, self.ctx[kv.end :] + self.question, NEW_TOKENS)

    def expected_answer(self, kv: KVCache) -> list[int]:
        """The answer after an oracle's cache, computed once per distinct cache."""
        key = ("answer", digest(kv))
        if key not in self.memo:
            self.memo[key] = self.answer(kv)
        return self.memo[key]

    def loader(
        self, store, policy: str | int = "adaptive", slo_s: float | None = None, codec=None, **kw
    ) -> StreamingLoader:
        opts = LoaderOptions(policy=policy, slo_s=slo_s, values_per_token=values_per_token(self.loaded.config))
        kw.setdefault("estimator", ThroughputEstimator(prior_gbps=1.0))  # warm: the last chunk is fetched first
        return StreamingLoader(store, codec or self.codec, self.recompute, opts, **kw)


@pytest.fixture(scope="module")
def real(smollm2) -> Real:
    ids = text_ids(smollm2.tokenizer, "pydoc-eval", N_CHUNKS * CHUNK + 16)
    ctx, question = ids[: N_CHUNKS * CHUNK], ids[N_CHUNKS * CHUNK :]
    codec = Codec(load_or_calibrate(smollm2), smollm2.fingerprint)
    parts: list[KVCache] = []
    for a in range(0, len(ctx), CHUNK):
        parts.append(prefill(smollm2.model, ctx[a : a + CHUNK], prefix=KVCache.concat(parts) if parts else None))
    ns = Namespace(smollm2.fingerprint, FORMAT_VERSION, codec.profile.id if codec.profile else "none")
    return Real(smollm2, codec, ns, ctx, question, KVCache.concat(parts))


LEVELS = (LOSSLESS, 3, 7)


@pytest.fixture(scope="module")
def writes(real) -> list[ChunkWrite]:
    """The reference cache's chunks at three levels, encoded once (as ContextStore.put_context does)."""
    refs = chunk_keys(real.ctx, real.namespace, CHUNK)
    raw = token_bytes(real.ctx)
    return [
        ChunkWrite(
            r.key,
            raw[r.start * 4 : r.end * 4],
            {lv: real.codec.encode(real.ref_kv.slice(r.start, r.end), lv, key=r.key) for lv in LEVELS},
            start=r.start,
            ends_context=r.end == len(real.ctx),
            prev=refs[r.index - 1].key if r.index else "",
        )
        for r in refs
    ]


@pytest.fixture
def store(real, writes, any_url):
    """The reference cache stored at three levels in one of the four stores."""
    cs = ContextStore(open_backend(any_url), real.namespace, real.codec, CHUNK)
    cs.backend.put_chunks(writes)
    yield cs
    cs.backend.close()


def assert_equal(a: KVCache, b: KVCache) -> None:
    """Bit for bit: same positions, layout, dtype and values."""
    assert (a.start, a.end, a.num_layers, a.dtype) == (b.start, b.end, b.num_layers, b.dtype)
    for x, y in zip(a.layers, b.layers):
        assert x.k.equal(y.k) and x.v.equal(y.v)


def stored(store: ContextStore, ctx, level: int, chunks: range) -> list[KVCache]:
    """The codec's decode of what the store holds for ``chunks`` at ``level``."""
    infos = store.plan(ctx)
    return [store.encoder.decode(store.get(infos[i].ref, level), key=infos[i].ref.key) for i in chunks]


def digest(kv: KVCache) -> bytes:
    h = hashlib.blake2b(f"{kv.start}:{kv.end}:{kv.dtype}".encode(), digest_size=16)
    for layer in kv.layers:
        for t in (layer.k, layer.v):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def fallback(real: Real, good: list[KVCache]) -> KVCache:
    """The good prefix, then the model's prefill of the rest of the context on top of it (once per prefix)."""
    prefix = KVCache.concat(good)
    key = ("fallback", digest(prefix))
    if key not in real.memo:
        real.memo[key] = KVCache.concat([prefix, real.recompute(prefix, real.ctx[prefix.end :])])
    return real.memo[key]


class ChaosLink(DirectLink):
    """The real network; records each fetch, and runs ``actions[i]()`` once just before chunk i's."""

    def __init__(self, actions: dict[int, Callable[[], object]] | None = None):
        self.actions = dict(actions or {})
        self.fetched: list[int] = []

    def fetch(self, get, ref, level):
        self.fetched.append(ref.index)
        action = self.actions.pop(ref.index, None)
        if action is not None:
            action()
        return get(ref, level)


class RecordingCodec:
    """The real codec; records the chunk key of every decode call (raised or not)."""

    def __init__(self, codec: Codec):
        self.codec, self.levels = codec, codec.levels
        self.keys: list[str] = []

    def encode(self, kv, level, *, key=None):
        return self.codec.encode(kv, level, key=key)

    def decode(self, data, *, key=None):
        self.keys.append(key)
        return self.codec.decode(data, key=key)


def swap_in_foreign(store: ContextStore, ctx, victim: int, donor: int) -> None:
    """Replace chunk ``victim``'s lossless payload with chunk ``donor``'s through the store's own API,
    so the store's checksum is valid: only the codec's key binding can tell (KeyMismatch)."""
    infos = store.plan(ctx)
    v, d = infos[victim].ref, infos[donor].ref
    payload = store.get(d, LOSSLESS)
    store.backend.delete_chunks([v.key])
    raw = token_bytes(ctx)
    prev = infos[victim - 1].ref.key if victim else ""
    store.backend.put_chunks(
        [ChunkWrite(v.key, raw[v.start * 4 : v.end * 4], {LOSSLESS: payload}, start=v.start, prev=prev)]
    )


def refs(store: ContextStore, ctx) -> list[ChunkRef]:
    return [i.ref for i in store.plan(ctx)]


# -- without faults ---------------------------------------------------------------------------


def test_the_text_policy_is_the_chunked_prefill(real, tmp_path):
    cs = ContextStore(open_backend(f"file://{tmp_path / 's'}"), real.namespace, real.codec, CHUNK)
    cs.put_context(real.ctx, real.ref_kv, levels=[LOSSLESS])
    res = real.loader(cs, policy=TEXT).load(real.ctx)
    assert res.choices == [TEXT] * N_CHUNKS and not res.faults
    assert_equal(res.kv, real.ref_kv)
    cs.backend.close()


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_loads_the_codecs_decode_of_what_is_stored(real, store, level):
    res = real.loader(store, policy=level).load(real.ctx)
    assert res.choices == [level] * N_CHUNKS and not res.faults and res.cached_tokens == len(real.ctx)
    want = KVCache.concat(stored(store, real.ctx, level, range(N_CHUNKS)))
    assert_equal(res.kv, want)
    if level == LOSSLESS:  # lossless is the reference itself, and so is its answer
        assert_equal(res.kv, real.ref_kv)
        assert real.answer(res.kv) == real.expected_answer(real.ref_kv)
    sizes = [i.sizes[level] for i in store.plan(real.ctx)]
    assert [d.bytes for d in res.decisions] == sizes


def test_adaptive_without_deadline_loads_lossless_last_chunk_first(real, store):
    link = ChaosLink()
    res = real.loader(store, link=link).load(real.ctx)
    assert link.fetched == [3, 0, 1, 2] and res.choices == [LOSSLESS] * N_CHUNKS and not res.faults
    assert_equal(res.kv, real.ref_kv)


# -- several faults in one load, made in the store ----------------------------------------------


def test_two_faults_in_one_load(real, store):
    """The last chunk (fetched first) holds another chunk's payload: a decode fault that costs only
    it. Chunk 1 is deleted just before its fetch: a fetch fault that ends the fetching there."""
    swap_in_foreign(store, real.ctx, victim=3, donor=2)
    r = refs(store, real.ctx)
    link = ChaosLink({1: lambda: store.backend.delete_chunks([r[1].key])})
    codec = RecordingCodec(real.codec)
    res = real.loader(store, link=link, codec=codec).load(real.ctx)
    assert link.fetched == [3, 0, 1]  # nothing fetched after the fault
    assert codec.keys == [r[3].key, r[0].key]  # nothing decoded after it either
    assert len(res.faults) == 2 and "chunk 3" in res.faults[0] and "KeyMismatch" in res.faults[0]
    assert "chunk 1" in res.faults[1] and "ChunkNotFound" in res.faults[1]
    assert res.choices == [LOSSLESS] + [TEXT] * 3
    assert [d.reason for d in res.decisions[1:]] == ["fault", "after fault", "fault"]
    want = fallback(real, stored(store, real.ctx, LOSSLESS, range(1)))
    assert_equal(res.kv, want)
    assert real.answer(res.kv) == real.expected_answer(want)


def test_three_faulty_chunks_in_one_load(real, store):
    """Chunks 3, 1 and 2 all hold foreign payloads. Chunk 3's fault costs only it, chunk 1's ends the
    load: chunk 2 (maybe already on the wire) is never decoded, so its fault is never seen."""
    for victim, donor in ((3, 0), (1, 0), (2, 0)):
        swap_in_foreign(store, real.ctx, victim, donor)
    r = refs(store, real.ctx)
    codec = RecordingCodec(real.codec)
    res = real.loader(store, codec=codec).load(real.ctx)
    assert codec.keys == [r[3].key, r[0].key, r[1].key]
    assert len(res.faults) == 2 and all("KeyMismatch" in f for f in res.faults), res.faults
    assert "chunk 3" in res.faults[0] and "chunk 1" in res.faults[1]
    assert res.choices == [LOSSLESS] + [TEXT] * 3
    assert [d.reason for d in res.decisions[1:]] == ["fault", "after fault", "fault"]
    want = fallback(real, stored(store, real.ctx, LOSSLESS, range(1)))
    assert_equal(res.kv, want)
    assert real.answer(res.kv) == real.expected_answer(want)


# -- a store that stalls ------------------------------------------------------------------------


@pytest.fixture(params=["redis", "cluster"])
def paused(request, real, writes, redis_factory):
    """(store, pause, resume): a private redis-server, or every node of the shared cluster."""
    if request.param == "redis":
        servers = [redis_factory()]
        url = servers[0].url
    else:
        url, servers = request.getfixturevalue("redis_cluster")
        for n in servers:
            n.command("flushall")
    cs = ContextStore(open_backend(url), real.namespace, real.codec, CHUNK)
    cs.backend.put_chunks(writes)

    def send(sig):
        return lambda: [s.signal(sig) for s in servers]

    try:
        yield cs, send(signal.SIGSTOP)
    finally:
        send(signal.SIGCONT)()
        cs.backend.close()


def test_a_paused_store_mid_load_gives_the_text_policys_cache_in_time(real, paused):
    """The server is paused (SIGSTOP) just before the last chunk's fetch: the load gives up on it at
    its deadline, recomputes that chunk, and gives exactly the text policy's cache and answer."""
    store, pause = paused
    slo = 2.0
    res = real.loader(store, policy=LOSSLESS, slo_s=slo, link=ChaosLink({N_CHUNKS - 1: pause})).load(real.ctx)
    assert res.choices == [LOSSLESS] * (N_CHUNKS - 1) + [TEXT], res.summary()
    assert len(res.faults) == 1 and f"chunk {N_CHUNKS - 1}" in res.faults[0], res.faults
    assert_equal(res.kv, real.ref_kv)
    assert real.answer(res.kv) == real.expected_answer(real.ref_kv)
    assert res.load_s <= slo + res.recompute_s + res.stitch_s + MARGIN_S, res.summary()
    assert res.load_s >= slo - MARGIN_S  # it did wait for the store up to its deadline
