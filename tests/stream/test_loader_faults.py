"""The loader's fault handling: several faults in one load, stalled stores, any exception from a
stage, and that nothing is fetched or decoded once a fault is known (real local store, toy codec
and model; some in virtual time, where the event order is exact)."""

from __future__ import annotations

import logging

import pytest
import torch

from cachegen.errors import ConfigError, StoreUnavailable
from cachegen.kv import KVCache
from cachegen.store import Namespace
from cachegen.stream import (
    CostModel,
    LoaderOptions,
    StreamingLoader,
    ThrottledLink,
    ThroughputEstimator,
    VirtualClock,
    VirtualRunner,
    constant,
)
from cachegen.stream.costs import TEXT
from stream.fakes import FaultyCodec, FaultyStore, ToyCodec, ToyModel, stored_context

CHUNK = 32
N_TOKENS = 6 * CHUNK + 10  # six full chunks and a partial one
N_CHUNKS = 7


@pytest.fixture
def setup(tmp_path):
    model = ToyModel()
    codec = ToyCodec()
    tokens = [(7 * i + 3) % 101 for i in range(N_TOKENS)]
    kv = model.full(tokens, CHUNK)
    store = stored_context(tmp_path / "store", Namespace("toy-model", 1, "toy"), codec, CHUNK, tokens, kv)
    yield model, codec, store, tokens, kv
    store.backend.close()


def assert_same(a: KVCache, b: KVCache) -> None:
    """Lossless chunks and a recompute: the same cache up to float rounding (rtol 1e-5; the toy model
    sums over the prefix, chunk by chunk in ``kv`` and in one call in a fallback)."""
    assert (a.start, a.end) == (b.start, b.end)
    for x, y in zip(a.layers, b.layers):
        assert torch.allclose(x.k, y.k, atol=0.0) and torch.allclose(x.v, y.v, atol=0.0)


def warm_adaptive(store, codec, model, **kw) -> StreamingLoader:
    """Adaptive, warm estimator, fast link, generous deadline: lossless everywhere, the last chunk fetched first."""
    return StreamingLoader(
        store,
        codec,
        model.recompute,
        LoaderOptions(slo_s=5.0, **kw),
        link=ThrottledLink(constant(1.0)),
        estimator=ThroughputEstimator(prior_gbps=1.0, min_bytes=0),
        costs=CostModel(fetch_latency_s=0.0),
    )


def test_two_faults_in_one_load(setup):
    """The early (last) chunk fails, then chunk 3: both are recorded, fetching stops at chunk 3."""
    model, codec, store, tokens, kv = setup
    faulty = FaultyStore(store, {6: "corrupt", 3: "missing"})
    res = warm_adaptive(faulty, codec, model).load(tokens)
    assert [i for i, _ in faulty.gets] == [6, 0, 1, 2, 3]
    assert len(res.faults) == 2 and "chunk 6" in res.faults[0] and "chunk 3" in res.faults[1]
    assert res.choices == [0, 0, 0] + [TEXT] * 4
    assert [d.reason for d in res.decisions[3:]] == ["fault", "after fault", "after fault", "fault"]
    assert model.calls[-1] == (3 * CHUNK, N_TOKENS - 3 * CHUNK)  # one recompute on top of the good prefix
    assert_same(res.kv, kv)


def test_three_faulty_chunks_in_one_load(setup):
    """Faults on chunks 6 (fetched first), 2 (a decode: OverflowError) and 4: the load stops at chunk 2,
    so chunk 4's fault is never reached, nothing after chunk 2 is decoded, and the cache is exact."""
    model, codec, store, tokens, kv = setup
    faulty = FaultyStore(store, {6: "timeout", 4: "missing"})
    fcodec = FaultyCodec(codec, {2 * CHUNK: OverflowError("int too large to convert")})
    res = warm_adaptive(faulty, fcodec, model).load(tokens)
    assert len(res.faults) == 2, res.faults
    assert "chunk 6" in res.faults[0] and "StoreUnavailable" in res.faults[0]
    assert "chunk 2" in res.faults[1] and "OverflowError" in res.faults[1]
    assert fcodec.decoded == [0, CHUNK, 2 * CHUNK]  # chunk 6 never arrived; nothing decoded after the fault
    assert res.choices == [0, 0] + [TEXT] * 5
    assert res.decisions[2].reason == "fault" and res.decisions[6].reason == "fault"
    assert model.calls[-1] == (2 * CHUNK, N_TOKENS - 2 * CHUNK)
    assert_same(res.kv, kv)


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        OverflowError("Python int too large to convert to C long"),
        TypeError("a bug in the codec"),
        RuntimeError("numba"),
        KeyError("x"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_any_exception_from_decode_is_a_fault(setup, error, caplog):
    model, codec, store, tokens, kv = setup
    fcodec = FaultyCodec(codec, {3 * CHUNK: error})
    with caplog.at_level(logging.WARNING, logger="cachegen.stream.loader"):
        res = StreamingLoader(store, fcodec, model.recompute, LoaderOptions(policy=0)).load(tokens)
    assert len(res.faults) == 1 and type(error).__name__ in res.faults[0] and "chunk 3" in res.faults[0]
    assert res.choices == [0] * 3 + [TEXT] * 4 and res.decisions[3].reason == "fault"
    assert fcodec.decoded == [0, CHUNK, 2 * CHUNK, 3 * CHUNK]  # decoding stopped at the fault
    assert_same(res.kv, kv)
    assert any("chunk 3" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("kind", ["memory", "bug"])
def test_any_exception_from_fetch_is_a_fault(setup, kind):
    model, codec, store, tokens, kv = setup
    faulty = FaultyStore(store, {2: kind})
    res = StreamingLoader(faulty, codec, model.recompute, LoaderOptions(policy=0)).load(tokens)
    assert len(res.faults) == 1 and ("MemoryError" if kind == "memory" else "TypeError") in res.faults[0]
    assert [i for i, _ in faulty.gets] == [0, 1, 2]  # the fetch stage stopped at its fault
    assert res.choices == [0, 0] + [TEXT] * 5
    assert_same(res.kv, kv)


def test_a_bug_in_the_fetch_stage_is_a_fault(setup):
    """An exception raised by the stage itself (here by its estimator), not by a store call."""
    model, codec, store, tokens, kv = setup

    class Broken(ThroughputEstimator):
        def add(self, nbytes, seconds):
            if len(self.samples) == 2:
                raise ZeroDivisionError("a bug")
            return super().add(nbytes, seconds)

    res = StreamingLoader(store, codec, model.recompute, LoaderOptions(policy=0), estimator=Broken(min_bytes=0)).load(
        tokens
    )
    assert len(res.faults) == 1 and "fetch stage: ZeroDivisionError" in res.faults[0]
    assert res.choices == [0, 0] + [TEXT] * 5
    assert_same(res.kv, kv)


def test_fault_messages_are_redacted(setup, caplog):
    model, codec, store, tokens, _kv = setup

    class Refusing(FaultyStore):
        def get(self, ref, level, *, timeout=None):
            if ref.index == 1:
                raise StoreUnavailable("redis://:hunter2@10.0.0.9:6379/0?password=hunter2 refused the connection")
            return self.store.get(ref, level)

    with caplog.at_level(logging.WARNING, logger="cachegen.stream.loader"):
        res = StreamingLoader(Refusing(store), codec, model.recompute, LoaderOptions(policy=0)).load(tokens)
    assert res.faults and "hunter2" not in res.faults[0] and "***@10.0.0.9" in res.faults[0]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "10.0.0.9" in logged and "hunter2" not in logged


# -- stalls --------------------------------------------------------------------------------


def test_a_stalled_plan_ends_the_load_at_its_limit(setup):
    model, codec, store, tokens, _kv = setup
    faulty = FaultyStore(store, stall_plan=True)
    try:
        res = StreamingLoader(faulty, codec, model.recompute, LoaderOptions(slo_s=0.3, reserve_s=0.1)).load(tokens)
    finally:
        faulty.release()
    # nothing loaded (the caller prefills everything), and the loader stopped waiting at its limit
    assert res.kv is None and res.cached_tokens == 0 and len(res.faults) == 1
    assert res.faults == ["plan: no answer from the store within the deadline (0.3s); recomputing"]
    assert 0.2 - 0.01 <= res.load_s < 0.2 + 0.5, res.load_s
    assert 0.1 < faulty.timeouts[0] <= 0.2  # the time left, passed to the store


def test_a_stalled_get_ends_the_load_within_deadline_plus_recompute(setup):
    model, codec, store, tokens, kv = setup
    faulty = FaultyStore(store, {3: "stall"})  # blocks (ignoring its timeout) until released
    try:
        res = StreamingLoader(faulty, codec, model.recompute, LoaderOptions(policy=0, slo_s=0.5)).load(tokens)
    finally:
        faulty.release()
    assert res.choices == [0, 0, 0] + [TEXT] * 4 and res.decisions[3].reason == "fault"
    assert len(res.faults) == 1 and "chunk 3" in res.faults[0] and "no answer" in res.faults[0]
    assert_same(res.kv, kv)
    assert res.load_s <= 0.5 + res.recompute_s + res.stitch_s + 0.25, res.summary()
    assert all(t is not None and 0 < t <= 0.5 for t in faulty.timeouts[1:])  # every get was given the time left


def _virtual(store, codec_delay: float = 0.0, s_per_token: float = 0.0, gbps: float | None = None, **faults):
    clock = VirtualClock()
    codec = ToyCodec(delay_s_per_mvalue=codec_delay, sleep=clock.sleep)
    model = ToyModel(s_per_token=s_per_token, sleep=clock.sleep)
    faulty = FaultyStore(store, sleep=clock.sleep, **faults)
    link = ThrottledLink(constant(gbps), clock=clock, sleep=clock.sleep) if gbps else None
    return clock, codec, model, faulty, link


def test_a_slow_get_in_virtual_time_ends_exactly_at_the_limit_plus_recompute(setup):
    """A get that would take 5 s: the loader gives up at its limit (deadline less the reserve) and
    recomputes chunks 3-6; in virtual time the load ends exactly then plus the recompute."""
    _, _, store, tokens, kv = setup
    clock, codec, model, faulty, _ = _virtual(store, s_per_token=1e-3, faults={3: "slow"}, timeout_s=5.0)
    opts = LoaderOptions(policy=0, slo_s=0.5, reserve_s=0.1)
    res = StreamingLoader(faulty, codec, model.recompute, opts, clock=clock, runner=VirtualRunner(clock)).load(tokens)
    assert res.choices == [0, 0, 0] + [TEXT] * 4
    assert model.calls[-1] == (3 * CHUNK, N_TOKENS - 3 * CHUNK)
    assert res.load_s == pytest.approx(0.4 + (N_TOKENS - 3 * CHUNK) * 1e-3, abs=1e-12)
    assert_same(res.kv, kv)


def test_nothing_is_fetched_or_decoded_after_a_fault_in_virtual_time(setup):
    """Fetches take 10 ms and decodes 2 ms, so the fetch stage is one chunk ahead: when chunk 2's decode
    fails (at 32 ms), chunk 3 is on the wire and nothing else is ever fetched or decoded, though the
    recompute that follows (170 ms) would leave time for the rest."""
    _, _, store, tokens, kv = setup
    lossless = store.plan(tokens)[0].sizes[0]
    clock, codec, model, faulty, link = _virtual(
        store, codec_delay=0.002 / (2 * 2 * 2 * CHUNK * 8 / 1e6), s_per_token=1e-3, gbps=lossless * 8 / 0.010 / 1e9
    )
    fcodec = FaultyCodec(codec, {2 * CHUNK: MemoryError()})
    res = StreamingLoader(
        faulty,
        fcodec,
        model.recompute,
        LoaderOptions(policy=0, slo_s=None),
        link=link,
        clock=clock,
        runner=VirtualRunner(clock),
    ).load(tokens)
    assert faulty.gets == [(i, 0) for i in range(4)]
    assert fcodec.decoded == [0, CHUNK, 2 * CHUNK]
    assert res.decisions[1].decode_end == pytest.approx(0.022) and res.decisions[2].decode_start == pytest.approx(0.032)
    assert res.choices == [0, 0] + [TEXT] * 5 and len(res.faults) == 1
    assert_same(res.kv, kv)


# -- the loader's interface ----------------------------------------------------------------


def test_load_does_not_change_the_loader(setup):
    model, codec, store, tokens, _kv = setup
    loader = StreamingLoader(store, codec, model.recompute, LoaderOptions(policy="rule", slo_s=0.07))
    before = loader.options
    res = loader.load(tokens, slo_s=7.0)
    assert res.slo_s == 7.0 and loader.options is before and loader.options.slo_s == 0.07
    assert loader.load(tokens).slo_s == 0.07


def test_a_config_error_from_the_plan_is_raised(setup):
    """A user's mistake (e.g. a store written with another chunk size) is not a store fault to hide."""
    model, codec, store, tokens, _kv = setup

    class Mismatched(FaultyStore):
        def plan(self, tokens, *, timeout=None):
            raise ConfigError("the store holds chunks of 256 tokens, not 32: pass --chunk-tokens 256")

    with pytest.raises(ConfigError, match="chunk-tokens 256"):
        StreamingLoader(Mismatched(store), codec, model.recompute).load(tokens)


@pytest.mark.parametrize(
    "bad",
    [
        {"policy": "fast"},
        {"policy": -1},
        {"slo_s": 0},
        {"prefetch": 0},
        {"risk_quantile": 1.0},
        {"reserve_s": -1},
        {"safety": 0},
        {"recency_boost": -1},
    ],
)
def test_bad_options_are_refused(bad):
    with pytest.raises(ConfigError):
        LoaderOptions(**bad)
