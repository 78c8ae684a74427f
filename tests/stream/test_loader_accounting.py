"""The loader's result in exact virtual time (every per-chunk time and every total, a fault's
recompute shared out by tokens), the deadline counted from ``t0``, the time left handed to the
store, and the options that shape the plan (levels, dtype, a trailing run of uncached chunks)."""

from __future__ import annotations

import logging

import pytest
import torch

from cachegen.errors import ConfigError, LoaderError, StoreUnavailable
from cachegen.kv import KVCache, KVLayer
from cachegen.store import ChunkWrite, ContextStore, open_backend, token_bytes
from cachegen.stream import (
    LoaderOptions,
    StreamingLoader,
    ThrottledLink,
    ThroughputEstimator,
    Trace,
    VirtualClock,
    VirtualRunner,
    constant,
)
from cachegen.stream.costs import TEXT, CostModel
from stream.fakes import FaultyCodec, FaultyStore, ToyCodec, ToyModel

# the toy context of the fault tests: six full chunks of 32 tokens and a partial one, stored at every level
from stream.test_loader_faults import CHUNK, N_TOKENS, setup

__all__ = ["setup"]

VALUES = 2 * 2 * 2 * CHUNK * 8  # K and V values of a full chunk of the toy model
DECODE_S = 0.002  # per full chunk
FETCH_S = 0.010  # per full lossless chunk
S_PER_TOKEN = 1e-3  # recompute


def assert_same(a: KVCache, b: KVCache) -> None:
    assert (a.start, a.end, a.dtype) == (b.start, b.end, b.dtype)
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


def fallback(kv: KVCache, tokens: list[int], at: int) -> KVCache:
    """What a fault at token ``at`` must give: the lossless prefix, then the model's KV of the rest in one
    call on top of it (the toy model sums over its prefix, so this differs in the last bits from ``kv``)."""
    prefix = kv.slice(0, at)
    return KVCache.concat([prefix, ToyModel().recompute(prefix, tokens[at:])])


def virtual():
    """A loader in virtual time: lossless fetches of 10 ms, decodes of 2 ms, recompute 1 ms a token."""
    clock = VirtualClock()
    codec = ToyCodec(delay_s_per_mvalue=DECODE_S / (VALUES / 1e6), sleep=clock.sleep)
    model = ToyModel(s_per_token=S_PER_TOKEN, sleep=clock.sleep)
    return clock, codec, model


def test_every_time_in_a_load_with_a_fault_in_virtual_time(setup):
    """Fetches (10 ms) run ahead of decodes (2 ms); chunk 4's decode fails at 52 ms, and chunks 4-6
    (74 tokens) are recomputed in one call of 74 ms, shared out among them by tokens."""
    _, _, store, tokens, kv = setup
    clock, codec, model = virtual()
    size = store.plan(tokens)[0].sizes[0]
    link = ThrottledLink(constant(size * 8 / FETCH_S / 1e9), clock=clock, sleep=clock.sleep)
    fcodec = FaultyCodec(codec, {4 * CHUNK: MemoryError()})
    faulty = FaultyStore(store, sleep=clock.sleep)
    res = StreamingLoader(
        faulty,
        fcodec,
        model.recompute,
        LoaderOptions(policy=0, slo_s=None),
        link=link,
        clock=clock,
        runner=VirtualRunner(clock),
    ).load(tokens)
    d = res.decisions
    ap = lambda x: pytest.approx(x, abs=1e-12)
    assert res.plan_s == 0.0 and faulty.timeouts == [None] * len(faulty.timeouts)  # no deadline, no timeout
    assert [x.fetch_start for x in d[:5]] == ap([0.0, 0.01, 0.02, 0.03, 0.04])
    assert [x.fetch_end for x in d[:5]] == ap([0.01, 0.02, 0.03, 0.04, 0.05])
    assert [x.fetch_s for x in d[:5]] == ap([FETCH_S] * 5) and [x.bytes for x in d[:4]] == [size] * 4
    assert [x.decode_start for x in d[:4]] == ap([0.01, 0.02, 0.03, 0.04])
    assert [x.decode_end for x in d[:4]] == ap([0.012, 0.022, 0.032, 0.042])
    assert [x.decode_s for x in d[:4]] == ap([DECODE_S] * 4)
    rest = N_TOKENS - 4 * CHUNK  # 74 tokens recomputed from 52 ms to 126 ms
    assert model.calls[-1] == (4 * CHUNK, rest)
    assert [(x.choice, x.reason, x.bytes) for x in d[4:]] == [(TEXT, "fault", 0)] + [(TEXT, "after fault", 0)] * 2
    assert [x.decode_start for x in d[4:]] == ap([0.052] * 3) and [x.decode_end for x in d[4:]] == ap([0.126] * 3)
    assert [x.decode_s for x in d[4:]] == ap([0.032, 0.032, 0.010])
    assert res.fetch_s == ap(0.05) and res.decode_s == ap(0.008) and res.recompute_s == ap(0.074)
    assert res.load_s == ap(0.126) and res.cached_tokens == N_TOKENS
    assert_same(res.kv, fallback(kv, tokens, 4 * CHUNK))
    # what the benches write and print, field by field
    assert res.summary() == (
        "202 tokens in 0.126s (slo None) fetch 0.050s decode 0.008s recompute 0.074s faults 1 | "
        "0:L0 1:L0 2:L0 3:L0 4:T 5:T 6:T"
    )
    j = res.to_json()
    assert list(j) == [
        "cached_tokens",
        "slo_s",
        "load_s",
        "plan_s",
        "fetch_s",
        "decode_s",
        "recompute_s",
        "stitch_s",
        "faults",
        "missed",
        "decisions",
    ]
    assert (j["cached_tokens"], j["slo_s"], j["missed"], j["faults"]) == (N_TOKENS, None, False, res.faults)
    assert [j[k] for k in ("load_s", "plan_s", "fetch_s", "decode_s", "recompute_s")] == ap(
        [0.126, 0, 0.05, 0.008, 0.074]
    )
    assert (
        j["stitch_s"] == res.stitch_s and j["decisions"][4]["reason"] == "fault" and j["decisions"][0]["bytes"] == size
    )
    assert [x["choice"] for x in j["decisions"]] == [0, 0, 0, 0, TEXT, TEXT, TEXT]


def test_the_deadline_counts_from_t0(setup):
    """A request that began 0.2 s before load(): a get that would take 5 s is given up at t0 + slo -
    reserve, the rest (chunks 3-6, 106 tokens) recomputed; the store was handed the time left."""
    _, _, store, tokens, kv = setup
    clock, codec, model = virtual()
    clock.sleep(1.0)
    faulty = FaultyStore(store, {3: "slow"}, timeout_s=5.0, sleep=clock.sleep)
    opts = LoaderOptions(policy=0, slo_s=0.6, reserve_s=0.1)
    loader = StreamingLoader(faulty, codec, model.recompute, opts, clock=clock, runner=VirtualRunner(clock))
    res = loader.load(tokens, t0=0.8)
    assert faulty.timeouts[0] == pytest.approx(0.3, abs=1e-12)  # the plan: 1.3 - 1.0
    assert faulty.timeouts[1:5] == pytest.approx([0.3] * 4, abs=1e-12)  # the gets: fetching takes no time here
    assert res.choices == [0, 0, 0] + [TEXT] * 4 and len(res.faults) == 1 and "no answer" in res.faults[0]
    assert res.load_s == pytest.approx(0.5 + (N_TOKENS - 3 * CHUNK) * S_PER_TOKEN, abs=1e-12)
    assert_same(res.kv, fallback(kv, tokens, 3 * CHUNK))


@pytest.mark.parametrize("slo", [0.0, -1.0])
def test_a_load_deadline_must_be_positive(setup, slo):
    model, codec, store, tokens, _kv = setup
    with pytest.raises(ConfigError):
        StreamingLoader(store, codec, model.recompute).load(tokens, slo_s=slo)


def test_a_store_without_timeouts_still_loads(setup):
    """A store whose plan and get take no ``timeout=`` (one written before the keyword existed)."""
    model, codec, store, tokens, kv = setup

    class Plain:
        def plan(self, tokens):
            return store.plan(tokens)

        def get(self, ref, level):
            return store.get(ref, level)

    res = StreamingLoader(Plain(), codec, model.recompute, LoaderOptions(policy=0, slo_s=1.0)).load(tokens)
    assert res.choices == [0] * 7 and not res.faults
    assert_same(res.kv, kv)


def test_a_failed_plan_loads_nothing(setup):
    model, codec, store, tokens, _kv = setup

    class Down(FaultyStore):
        def plan(self, tokens, *, timeout=None):
            raise StoreUnavailable("redis://:secret@10.1.2.3:6379/0 refused the connection")

    res = StreamingLoader(Down(store), codec, model.recompute).load(tokens)
    assert res.kv is None and res.cached_tokens == 0 and res.decisions == []
    assert len(res.faults) == 1 and res.faults[0].startswith("plan: StoreUnavailable") and "secret" not in res.faults[0]


def test_a_chunk_of_another_layout_is_a_fault(setup):
    model, _codec, store, tokens, kv = setup

    class OneHead(ToyCodec):
        def decode(self, blob, *, key=None):
            out = super().decode(blob, key=key)
            if out.start != 2 * CHUNK:
                return out
            return KVCache([KVLayer(l.k[:1], l.v[:1]) for l in out.layers], start=out.start)

    res = StreamingLoader(store, OneHead(), model.recompute, LoaderOptions(policy=0)).load(tokens)
    assert res.choices == [0, 0] + [TEXT] * 5 and res.decisions[2].reason == "fault" and len(res.faults) == 1
    assert "layout" in res.faults[0]
    assert_same(res.kv, fallback(kv, tokens, 2 * CHUNK))


def test_a_recompute_of_other_positions_is_an_error(setup):
    """A model that returns the KV of other positions is a bug to raise, not a cache to use."""
    model, codec, store, tokens, _kv = setup

    def shifted(prefix, ids):
        out = model.recompute(prefix, ids)
        return KVCache(out.layers, start=out.start + 1)

    with pytest.raises(LoaderError, match="recompute returned tokens"):
        StreamingLoader(store, codec, shifted, LoaderOptions(policy=TEXT)).load(tokens)


def test_the_stitched_cache_takes_the_options_dtype(setup):
    model, codec, store, tokens, kv = setup
    res = StreamingLoader(store, codec, model.recompute, LoaderOptions(policy=0, dtype=torch.float16)).load(tokens)
    assert res.kv.dtype == torch.float16
    assert_same(res.kv, kv.to(torch.float16))


def test_only_the_allowed_levels_are_used(setup):
    model, codec, store, tokens, _kv = setup
    opts = LoaderOptions(slo_s=None, levels=(2, 3))
    res = StreamingLoader(
        store, codec, model.recompute, opts, estimator=ThroughputEstimator(prior_gbps=1.0, min_bytes=0)
    ).load(tokens)
    assert res.choices == [2] * 7  # the best allowed level, lossless being stored too
    sizes = [i.sizes[2] for i in store.plan(tokens)]
    assert [d.bytes for d in res.decisions] == sizes


def test_chunks_after_the_last_stored_one_are_left_to_the_caller(setup, tmp_path):
    """Only chunks 0-3 are stored: the load covers them and leaves the rest to the suffix prefill."""
    model, codec, store, tokens, kv = setup
    part = ContextStore(open_backend(f"file://{tmp_path / 'part'}"), store.namespace, codec, chunk_tokens=CHUNK)
    raw = token_bytes(tokens)
    part.backend.put_chunks(
        [
            ChunkWrite(i.ref.key, raw[i.ref.start * 4 : i.ref.end * 4], {0: store.get(i.ref, 0)}, start=i.ref.start)
            for i in store.plan(tokens)[:4]
        ]
    )
    res = StreamingLoader(part, codec, model.recompute, LoaderOptions(policy=0)).load(tokens)
    assert len(res.decisions) == 4 and res.cached_tokens == 4 * CHUNK and not res.faults
    assert_same(res.kv, kv.slice(0, 4 * CHUNK))
    part.backend.close()


def test_the_rule_is_planned_and_recorded_at_the_last_sample(setup):
    """The rule's estimate is the latest sample (the prior before any), not the adaptive estimate:
    the link gives 2 Mbit/s to chunks 0-1 and 4 Mbit/s from chunk 2, so from chunk 3 on the latest
    sample (4) is above the window's harmonic mean (2.4 for chunk 3)."""
    _, _, store, tokens, _kv = setup
    clock, codec, model = virtual()
    link = ThrottledLink(Trace([(0, 0.002), (2, 0.004)], by="chunk"), clock=clock, sleep=clock.sleep)
    est = ThroughputEstimator(prior_gbps=0.003, min_bytes=0)
    res = StreamingLoader(
        store,
        codec,
        model.recompute,
        LoaderOptions(policy="rule", slo_s=7.0),
        costs=CostModel(fetch_latency_s=0.0),  # the link's: none
        link=link,
        estimator=est,
        clock=clock,
        runner=VirtualRunner(clock),
    ).load(tokens)
    assert res.choices == [0] * 7
    assert [d.est_gbps for d in res.decisions] == pytest.approx([0.003, 0.002, 0.002] + [0.004] * 4, rel=1e-9)
    assert [d.measured_gbps for d in res.decisions] == pytest.approx([0.002] * 2 + [0.004] * 5, rel=1e-9)


def test_a_fault_is_traced_at_debug_level(setup, caplog):
    model, codec, store, tokens, _kv = setup
    faulty = FaultyStore(store, {2: "bug"})
    with caplog.at_level(logging.DEBUG, logger="cachegen.stream.loader"):
        res = StreamingLoader(faulty, codec, model.recompute, LoaderOptions(policy=0)).load(tokens)
    assert len(res.faults) == 1
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("Traceback" in m and "injected bug in the store" in m for m in debug), debug


@pytest.mark.parametrize("latency_s", [0.0, 0.005, 0.02])
def test_a_sample_is_the_rate_net_of_the_per_request_latency(setup, latency_s):
    """The estimator's samples split a fetch as the planner prices one (latency + bytes / rate):
    over a 4 Mbit/s link with a per-fetch latency the cost model knows, every sample is 4 Mbit/s
    (counting the latency as transfer gave less, the more so the smaller the chunk)."""
    _, _, store, tokens, _kv = setup
    clock, codec, model = virtual()
    link = ThrottledLink(Trace([(0, 0.004)], by="chunk"), latency_s=latency_s, clock=clock, sleep=clock.sleep)
    res = StreamingLoader(
        store,
        codec,
        model.recompute,
        LoaderOptions(policy=0),
        costs=CostModel(fetch_latency_s=latency_s),
        link=link,
        estimator=ThroughputEstimator(prior_gbps=0.004, min_bytes=0),
        clock=clock,
        runner=VirtualRunner(clock),
    ).load(tokens)
    fetch = [d.fetch_end - d.fetch_start for d in res.decisions]
    assert fetch == pytest.approx([latency_s + d.bytes * 8 / 4e6 for d in res.decisions], rel=1e-9)
    wire = [d.bytes * 8 / 4e6 for d in res.decisions]
    if latency_s <= min(wire):
        assert [d.measured_gbps for d in res.decisions] == pytest.approx([0.004] * 7, rel=1e-9)
    else:  # the latency is more than half of each fetch: half the fetch is taken as transfer
        want = [d.bytes * 8 / (f / 2) / 1e9 for d, f in zip(res.decisions, fetch)]
        assert [d.measured_gbps for d in res.decisions] == pytest.approx(want, rel=1e-9)
        assert all(d.bytes * 8 / f / 1e9 < d.measured_gbps < 0.004 for d, f in zip(res.decisions, fetch))


def test_transfer_s_takes_off_the_latency_and_at_most_half_the_fetch():
    from cachegen.stream.loader import transfer_s

    assert transfer_s(0.010, 0.004) == pytest.approx(0.006)
    assert transfer_s(0.010, 0.0) == 0.010
    assert transfer_s(0.010, 0.005) == pytest.approx(0.005)  # exactly half
    assert transfer_s(0.010, 0.008) == pytest.approx(0.005)  # an overstated latency: half, no more
    assert transfer_s(0.010, 0.5) == pytest.approx(0.005)
    assert transfer_s(0.010, -0.003) == 0.010  # a negative latency adds nothing


@pytest.mark.parametrize("policy", ["fastest", 0])
def test_the_fastest_policy_takes_the_latency_its_link_measures(setup, policy):
    """The link adds 0.5 ms per fetch; the cost model says none. The fastest policy plans with
    the latency fitted to the link's fetches (seeded here with two sizes), so its samples are the
    link's 4 Mbit/s; a fixed level keeps the cost model's latency, and its samples count the
    0.5 ms as transfer."""
    _, _, store, tokens, _kv = setup
    clock, codec, model = virtual()
    link = ThrottledLink(Trace([(0, 0.004)], by="chunk"), latency_s=0.0005, clock=clock, sleep=clock.sleep)
    est = ThroughputEstimator(prior_gbps=0.004, min_bytes=0)
    for b in (1000, 5000, 1000, 5000):
        est.record_fetch(b, 0.0005 + b * 8 / 4e6)
    opts = LoaderOptions(policy=policy)
    res = StreamingLoader(
        store,
        codec,
        model.recompute,
        opts,
        costs=CostModel(fetch_latency_s=0.0),
        link=link,
        estimator=est,
        clock=clock,
        runner=VirtualRunner(clock),
    ).load(tokens)
    fetched = [d for d in res.decisions if d.choice != TEXT]
    assert len(fetched) >= 4
    if policy == "fastest":
        assert [d.measured_gbps for d in fetched] == pytest.approx([0.004] * len(fetched), rel=1e-6)
    else:
        want = [d.bytes * 8 / (d.fetch_end - d.fetch_start) / 1e9 for d in fetched]
        assert [d.measured_gbps for d in fetched] == pytest.approx(want, rel=1e-9)
        assert all(m < 0.004 for m in want)
