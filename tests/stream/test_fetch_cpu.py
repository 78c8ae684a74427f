"""A fetch's CPU time: measured per fetch, learned per MB, charged by the planner to a busy compute
stage, and taken out of the decode times the loader learns from."""

from __future__ import annotations

import statistics
import threading
import time

import pytest

from cachegen.bench.replay import replay_load
from cachegen.store import Namespace
from cachegen.stream import ComputeRates, CostModel, LoaderOptions, StreamingLoader, ThroughputEstimator, constant
from cachegen.stream import compute_rates as rates_mod
from cachegen.stream import loader as loader_mod
from cachegen.stream.compute_rates import FETCH_CPU_SHARE, MIN_RATIO, ScaledCosts, cpu_timed, thread_cpu_clock
from cachegen.stream.costs import TEXT
from cachegen.stream.planner import PipelineState, PlanChunk, choose_fastest
from stream.fakes import BatchingToyCodec, ToyCodec, ToyModel, stored_context
from stream.test_loader import CHUNK, N_TOKENS


def _spin(seconds: float) -> None:
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


# -- measuring ------------------------------------------------------------------------------


def test_cpu_timed_counts_the_calling_thread_s_cpu_not_its_waits():
    out, cpu = cpu_timed(lambda: time.sleep(0.03) or "slept")
    assert out == "slept" and 0.0 <= cpu < 0.01
    out, cpu = cpu_timed(lambda: _spin(0.02))
    assert out is None and cpu >= 0.02


def test_a_thread_s_cpu_clock_is_read_from_another_thread_and_stops_with_it():
    box: dict = {}
    started, spun, leave = threading.Event(), threading.Event(), threading.Event()

    def worker():
        box["clock"] = thread_cpu_clock()
        started.set()
        _spin(0.05)
        spun.set()
        leave.wait(5)

    th = threading.Thread(target=worker)
    th.start()
    started.wait(5)
    clock = box["clock"]
    if clock is None:
        leave.set()
        th.join()
        pytest.skip("this platform cannot read another thread's CPU clock")
    a = clock()
    _spin(0.05)  # the reader's own CPU is not the worker's
    spun.wait(5)
    b = clock()
    leave.set()
    th.join()
    assert a is not None and b is not None
    assert 0.04 <= b - a < 0.09
    after = clock()  # the thread has ended: no reading, or one that no longer grows
    assert after is None or after - b < 0.01


# -- learning -------------------------------------------------------------------------------


def test_fetch_cpu_is_learned_per_mb_as_the_share_a_busy_compute_stage_loses():
    r = ComputeRates(window=3)
    assert r.fetch_cpu_s_per_mb() is None
    for nbytes, cpu in ((1_000_000, 0.0005), (2_000_000, 0.004), (3_000_000, 0.003), (500_000, 0.001)):
        r.observe_fetch(nbytes, cpu)  # the first falls out of the window: 2, 1 and 2 ms per MB are kept
    assert r.known
    assert r.fetch_cpu_s_per_mb() == pytest.approx(FETCH_CPU_SHARE * 0.002)
    assert r.factor(1) == 1.0  # a fetch teaches no decode


@pytest.mark.parametrize(
    ("nbytes", "cpu"), [(rates_mod.MIN_FETCH_BYTES - 1, 0.001), (10**6, -0.001), (10**6, float("nan"))]
)
def test_a_small_fetch_or_a_sample_that_is_not_a_time_is_ignored(nbytes, cpu):
    r = ComputeRates()
    r.observe_fetch(nbytes, cpu)
    assert not r.known and r.fetch_cpu_s_per_mb() is None


def test_the_smallest_fetch_kept_and_a_fetch_of_no_cpu_count():
    r = ComputeRates()
    r.observe_fetch(rates_mod.MIN_FETCH_BYTES, 0.0)
    assert r.fetch_cpu_s_per_mb() == 0.0


def test_a_decode_is_learned_less_the_share_of_the_fetch_cpu_beside_it():
    r = ComputeRates()
    r.observe(1, 1.0, 0.5, 0.5)
    assert r.factor(1) == pytest.approx(0.5 - FETCH_CPU_SHARE * 0.5)
    r = ComputeRates()
    r.observe(1, 1.0, 0.5, 10.0)  # more than the whole decode: the floor
    assert r.factor(1) == MIN_RATIO
    r = ComputeRates()
    r.observe(1, 1.0, -0.1, 0.0)  # not a time, whatever the fetches took
    assert not r.known


def test_corrected_charges_the_learned_fetch_cpu_and_keeps_the_calibrated_one_until_then():
    base = CostModel(fetch_cpu_s_per_mb=0.25)
    r = ComputeRates()
    r.observe(1, 1.0, 0.5)
    assert r.corrected(base).fetch_cpu_s(2_000_000) == 0.5  # none learned: the model's own
    r = ComputeRates()
    r.observe_fetch(2_000_000, 0.008)
    c = r.corrected(base)
    assert isinstance(c, ScaledCosts)
    assert c.fetch_cpu_s(2_000_000) == pytest.approx(2 * FETCH_CPU_SHARE * 0.004)
    assert c.decode_s(1, 10**6) == base.decode_s(1, 10**6)  # no decode measured: no factor


# -- planning -------------------------------------------------------------------------------


def test_the_fastest_policy_keeps_big_fetches_away_from_busy_decodes_when_they_cost_it():
    """Level 1 is big and cheap to decode, level 2 small and slow. With the compute stage busy,
    fetching level 1 beside it is free of CPU in one model and costs 40 ms per MB in the other; the
    plan takes level 1 in the first and keeps level 2 in the second, each the sooner end by the
    model it plans with."""
    chunks = [PlanChunk(i, 256 * i, 256, 10**6, {1: 1_000_000, 2: 100_000}) for i in range(3)]
    free = CostModel(
        decode_s_per_mvalue={1: 0.002, 2: 0.030},
        decode_fixed_s=0.0,
        fetch_latency_s=0.0,
        recompute_s_per_token=1.0,
    )
    costly = CostModel(
        **{**free.to_json(), "decode_s_per_mvalue": free.decode_s_per_mvalue, "fetch_cpu_s_per_mb": 0.04}
    )
    busy = PipelineState(float("inf"), cpu_busy_s=0.2, prev=2)
    assert choose_fastest(chunks, 1.0, free, busy).choice == 1
    assert choose_fastest(chunks, 1.0, costly, busy).choice == 2


# -- the loader -----------------------------------------------------------------------------


@pytest.fixture
def toy(tmp_path):
    model = ToyModel()
    codec = ToyCodec(delay_s_per_mvalue=0.0)
    tokens = [(7 * i + 3) % 101 for i in range(N_TOKENS)]
    kv = model.full(tokens, CHUNK)
    store = stored_context(tmp_path / "store", Namespace("toy-model", 1, "toy"), codec, CHUNK, tokens, kv)
    vpt = kv.num_values // kv.num_tokens
    yield model, store, tokens, vpt
    store.backend.close()


def _threaded_load(toy, rates, decode_s=0.01, policy=2, codec=None):
    """A load on threads in real time: each decode (or recompute) sleeps ``decode_s`` and is
    predicted at that."""
    _, store, tokens, vpt = toy
    mv = CHUNK * vpt / 1e6
    codec = codec or ToyCodec(delay_s_per_mvalue=decode_s / mv)
    model = ToyModel(s_per_token=decode_s / CHUNK)
    costs = CostModel(
        decode_s_per_mvalue_default=decode_s / mv,
        decode_fixed_s=0.0,
        recompute_fixed_s=0.0,
        recompute_s_per_token=decode_s / CHUNK,
        recompute_s_per_token_ctx=0.0,
    )
    opts = LoaderOptions(policy=policy, slo_s=None, values_per_token=vpt, recency_boost=0)
    return StreamingLoader(store, codec, model.recompute, opts, costs=costs, rates=rates).load(tokens)


def test_a_threaded_load_learns_its_fetches_cpu(toy, monkeypatch):
    monkeypatch.setattr(rates_mod, "MIN_FETCH_BYTES", 1)
    monkeypatch.setattr(loader_mod, "cpu_timed", lambda fn: (fn(), 0.001))
    rates = ComputeRates()
    res = _threaded_load(toy, rates)
    per_mb = [FETCH_CPU_SHARE * 0.001 / (d.bytes / 1e6) for d in res.decisions if d.bytes]
    assert len(per_mb) == len(res.decisions)
    assert rates.fetch_cpu_s_per_mb() == pytest.approx(statistics.median(per_mb))


def test_the_fetch_thread_s_cpu_during_a_decode_is_taken_out_of_what_the_loader_learns(toy, monkeypatch):
    """Read as the fetch thread's clock says, each decode ran beside a whole second of fetch CPU,
    so what is left of its 10 ms is nothing: the factor is the floor. Without that clock the
    decodes are learned as measured, about as predicted."""
    monkeypatch.setattr(loader_mod, "thread_cpu_clock", lambda: None)
    plain = ComputeRates()
    _threaded_load(toy, plain)
    assert plain.factor(2) > 0.5
    ticks = iter(range(10**6))
    monkeypatch.setattr(loader_mod, "thread_cpu_clock", lambda: lambda: float(next(ticks)))
    robbed = ComputeRates()
    _threaded_load(toy, robbed)
    assert robbed.factor(2) == MIN_RATIO


@pytest.mark.parametrize("robbed", [False, True])
def test_a_recompute_and_a_call_of_several_chunks_learn_net_of_the_fetch_thread_s_cpu(toy, monkeypatch, robbed):
    ticks = iter(range(10**6))
    clock = (lambda: lambda: float(next(ticks))) if robbed else (lambda: None)
    monkeypatch.setattr(loader_mod, "thread_cpu_clock", clock)
    text = ComputeRates()
    _threaded_load(toy, text, policy=TEXT)
    # the first decode takes 0.2 s, so the fetches of the other chunks wait and decode in one call
    batched = ComputeRates()
    codec = BatchingToyCodec(time.sleep, first_s=0.2, share_s=0.01)
    res = _threaded_load(toy, batched, codec=codec)
    assert ("many", len(res.decisions) - 1) in codec.calls
    if robbed:
        assert text.factor(TEXT) == batched.factor(2) == MIN_RATIO
    else:
        assert text.factor(TEXT) > 0.5 and batched.factor(2) > 0.5


def test_a_call_priced_at_nothing_teaches_nothing(toy):
    """A cost model that predicts no decode time gives a call a price of 0: no ratio to learn."""
    _, store, tokens, vpt = toy
    rates = ComputeRates()
    codec = BatchingToyCodec(time.sleep, first_s=0.1, share_s=0.0)
    opts = LoaderOptions(policy=2, slo_s=None, values_per_token=vpt, recency_boost=0)
    free = CostModel(decode_s_per_mvalue_default=0.0, decode_fixed_s=0.0)
    res = StreamingLoader(store, codec, ToyModel().recompute, opts, costs=free, rates=rates).load(tokens)
    assert any(kind == "many" for kind, _ in codec.calls) and res.kv is not None
    assert rates.factor(2) == 1.0  # nothing learned


def test_stolen_time_is_the_fetch_thread_s_cpu_since_the_mark(toy):
    _, store, tokens, _ = toy
    loader = StreamingLoader(store, ToyCodec(), ToyModel().recompute, LoaderOptions(policy=2, slo_s=None))
    run = loader_mod._Load(loader, tokens, None, 0.0)
    assert run.fetch_cpu_now() is None and run.stolen_since(1.0) == 0.0  # no clock: nothing known
    run.fetch_cpu = lambda: 5.0
    assert run.fetch_cpu_now() == 5.0
    assert run.stolen_since(2.0) == 3.0
    assert run.stolen_since(5.0) == 0.0
    assert run.stolen_since(6.0) == 0.0  # a clock read out of order takes nothing
    assert run.stolen_since(None) == 0.0
    run.fetch_cpu = lambda: None  # the fetch thread has ended
    assert run.stolen_since(2.0) == 0.0


def test_a_replayed_load_learns_no_fetch_cpu(monkeypatch):
    """In virtual time the fetches run in the caller's thread and their CPU says nothing."""
    monkeypatch.setattr(rates_mod, "MIN_FETCH_BYTES", 1)
    rates = ComputeRates()
    chunks = [PlanChunk(i, i * 256, 256, 10**6, {2: 400_000}) for i in range(4)]
    opts = LoaderOptions(policy=2, slo_s=None, recency_boost=0)
    replay_load(chunks, constant(0.1), CostModel(), opts, ThroughputEstimator(prior_gbps=0.1), rates=rates)
    assert rates.fetch_cpu_s_per_mb() is None and rates.known  # its decodes were learned
