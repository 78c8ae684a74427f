"""The loader's exact words and book-keeping: fault and trace log records, refusal messages, the
compute book's arithmetic, the decode cost it predicts and what it hands to the planner."""

from __future__ import annotations

import dataclasses
import logging
import traceback

import pytest

import cachegen.stream.loader as loader_mod
from cachegen.errors import ConfigError, LoaderError
from cachegen.kv import KVCache
from cachegen.store.keys import ChunkRef
from cachegen.store.url import redact
from cachegen.stream import CostModel, LoaderOptions, StreamingLoader
from cachegen.stream.planner import RISK_QUANTILE, PlanChunk
from stream.fakes import FaultyStore, ToyCodec

# the toy context of the fault tests: six full chunks of 32 tokens and a partial one, stored at every level
from stream.test_loader_faults import CHUNK, setup

__all__ = ["setup"]


def test_a_fault_is_logged_as_a_warning_and_traced_at_debug_level(setup, caplog):
    model, codec, store, tokens, _kv = setup
    faulty = FaultyStore(store, {2: "bug"})
    with caplog.at_level(logging.DEBUG, logger="cachegen.stream.loader"):
        res = StreamingLoader(faulty, codec, model.recompute, LoaderOptions(policy=0)).load(tokens)
    (fault,) = res.faults
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "cachegen.stream.loader"]
    assert [r.getMessage() for r in warnings] == [f"load fault, recomputing from text: {fault}"]
    (debug,) = [r for r in caplog.records if r.levelno == logging.DEBUG and r.name == "cachegen.stream.loader"]
    assert debug.msg == "%s" and len(debug.args) == 1  # the trace is an argument, never a format
    text = debug.getMessage()
    assert text.startswith("Traceback (most recent call last):\n") and text.endswith("injected bug in the store\n")
    assert "\n  File " in text and "XX" not in text


def test_a_bug_in_the_fetch_stage_is_traced_with_its_own_exception(setup, caplog):
    model, codec, store, tokens, _kv = setup

    class Broken(loader_mod.ThroughputEstimator):
        def add(self, nbytes, seconds):
            raise ZeroDivisionError("estimator bug")

    with caplog.at_level(logging.DEBUG, logger="cachegen.stream.loader"):
        res = StreamingLoader(store, codec, model.recompute, LoaderOptions(policy=0), estimator=Broken()).load(tokens)
    assert res.faults == ["fetch stage: ZeroDivisionError: estimator bug"]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 1 and debug[0].endswith("ZeroDivisionError: estimator bug\n")


def _ref(index: int = 0, start: int = 0, end: int = CHUNK) -> ChunkRef:
    return ChunkRef(index, start, end, f"{index:064x}")


def test_refusals_name_the_chunk_and_the_ranges(setup):
    model, codec, store, tokens, kv = setup
    with pytest.raises(LoaderError) as e:
        loader_mod._Cache(10, None).prefix(5)
    assert str(e.value) == "no chunk before token 5 is in the cache"

    def shifted(prefix, ids):
        return model.recompute(None, [0, *ids])  # one token too many, at 0

    ld = StreamingLoader(store, codec, shifted)
    with pytest.raises(LoaderError) as e:
        ld.recompute_after(kv.slice(0, CHUNK), tokens[CHUNK : 2 * CHUNK])
    assert str(e.value) == f"recompute returned tokens [0, {CHUNK + 1}), expected [{CHUNK}, {2 * CHUNK})"


class IntoCodec(ToyCodec):
    """A codec with its own ``decode_into``: records the key and the slot it was given."""

    def __init__(self):
        super().__init__()
        self.into: list[tuple[str | None, int, int]] = []

    def decode_into(self, blob, slot, *, key=None):
        self.into.append((key, slot.start, slot.end))
        slot.write(self.decode(blob, key=key))


def test_decode_into_checks_the_slot_and_passes_the_key(setup):
    model, _codec, store, tokens, kv = setup
    codec = IntoCodec()
    ld = StreamingLoader(store, codec, model.recompute)
    infos = store.plan(tokens)
    ref = infos[1].ref
    data = store.get(ref, 0)
    cache = KVCache.allocate(kv, kv.num_tokens)
    ld.decode_into(data, ref, cache.slice(ref.start, ref.end))
    assert codec.into == [(ref.key, ref.start, ref.end)]
    for a, b in ((ref.start, ref.end + 1), (ref.start + 1, ref.end)):  # one end right, the other wrong
        with pytest.raises(LoaderError) as e:
            ld.decode_into(data, ref, cache.slice(a, b))
        assert str(e.value) == f"chunk {ref.index}: slot [{a}, {b}) is not its range"


def test_a_chunk_of_another_layout_is_refused_before_it_is_written(setup):
    model, _codec, store, tokens, kv = setup

    class OneHead(ToyCodec):
        def decode(self, blob, *, key=None):
            out = super().decode(blob, key=key)
            return KVCache([loader_mod.KVCache.allocate(out, out.num_tokens).layers[0]] * 1, start=out.start)

    ld = StreamingLoader(store, ToyCodec(), model.recompute)
    ld.codec = OneHead()
    ref = store.plan(tokens)[1].ref
    cache = KVCache.allocate(kv, kv.num_tokens)
    with pytest.raises(Exception) as e:
        ld.decode_into(store.get(ref, 0), ref, cache.slice(ref.start, ref.end))
    assert str(e.value) == f"corrupt chunk: chunk {ref.index} has a different layout from the chunks before it"


def test_a_plan_without_any_stored_chunk_loads_nothing_without_a_fault(setup):
    model, codec, store, tokens, _kv = setup

    class Unstored:
        def plan(self, toks, *, timeout=None):
            return [dataclasses.replace(i, sizes={}) for i in store.plan(toks)]

        def get(self, ref, level, *, timeout=None):  # pragma: no cover - never asked
            raise AssertionError("nothing is stored")

    res = StreamingLoader(Unstored(), codec, model.recompute).load(tokens)
    assert (res.kv, res.cached_tokens, res.decisions, res.faults) == (None, 0, [], [])


class Clock:
    def __init__(self, t: float = 10.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_compute_book_adds_queued_work_and_the_item_in_progress():
    clock = Clock()
    book = loader_mod._CpuBook(clock, 10.0)
    assert book.busy() == 0.0
    book.queued(1.0)
    book.queued(2.0)
    assert book.busy() == 3.0
    book.started(0.5)  # 0.5 s of the queue is now in progress, until 10.5
    assert book.busy() == 3.0
    clock.t = 10.25
    assert book.busy() == 2.75
    clock.t = 11.0
    assert book.busy() == 2.5  # the item in progress is over: only the queue is left


def test_the_predicted_decode_counts_the_chunks_values(setup):
    model, codec, store, tokens, _kv = setup
    costs = CostModel(decode_fixed_s=0.001, decode_s_per_mvalue={0: 2.0}, decode_s_per_mvalue_default=2.0)
    ld = StreamingLoader(store, codec, model.recompute, costs=costs)
    run = loader_mod._Load(ld, tokens, 1.0, 0.0)
    assert run.predicted(costs, PlanChunk(0, 0, 32, 1_000_000, {0: 1}), 0) == costs.decode_s(0, 1_000_000)
    assert run.predicted(costs, PlanChunk(0, 0, 32, 0, {0: 1}), 0) == costs.decode_s(0, 1)  # no count: one value


def _spy_on_decide(monkeypatch) -> list[dict]:
    """The keyword arguments of every ``decide`` call the loader makes (the planner still decides)."""
    calls: list[dict] = []
    decide = loader_mod.decide

    def spy(policy, chunks, costs, **kw):
        calls.append(kw)
        return decide(policy, chunks, costs, **kw)

    monkeypatch.setattr(loader_mod, "decide", spy)
    return calls


@pytest.mark.parametrize("risk", [None, 0.9])
def test_what_the_planner_is_given(setup, monkeypatch, risk):
    model, codec, store, tokens, _kv = setup
    calls = _spy_on_decide(monkeypatch)
    est = loader_mod.ThroughputEstimator()
    for _ in range(4):
        est.add(1_000_000, 0.001)
    firsts: list[bool] = []
    next_estimate = est.next_estimate

    def spy_next(*, first_of_load=False):
        firsts.append(first_of_load)
        return next_estimate(first_of_load=first_of_load)

    monkeypatch.setattr(est, "next_estimate", spy_next)
    opts = LoaderOptions(slo_s=2.0, reserve_s=0.5, levels=(0, 1, 2), risk_quantile=risk)
    res = StreamingLoader(store, codec, model.recompute, opts, estimator=est).load(tokens)
    n = len(res.decisions)
    assert len(calls) == n and firsts == [True] + [False] * (n - 1)
    for kw in calls:
        assert kw["share_s"] == (2.0 - 0.5) / n
        assert kw["allowed"] == (0, 1, 2)
        assert kw["time_left_s"] is not None and 0 < kw["time_left_s"] <= 1.5
        assert kw["tail_gbps"] is not None and kw["tail_gbps"] > 0
        assert kw["risk_quantile"] == (risk or RISK_QUANTILE)
        assert (kw["history_s_per_bit"] is None) == (risk is None)
    assert all(d.est_gbps is not None for d in res.decisions)
    # the adaptive plan records the estimate it chose with (not the last sample)
    assert res.decisions[0].est_gbps == pytest.approx(next_estimate(first_of_load=True), rel=0.5)


def test_without_a_deadline_the_planner_gets_no_time_left(setup, monkeypatch):
    model, codec, store, tokens, _kv = setup
    calls = _spy_on_decide(monkeypatch)
    StreamingLoader(store, codec, model.recompute, LoaderOptions(slo_s=None)).load(tokens)
    assert calls and all(kw["time_left_s"] is None and kw["share_s"] is None for kw in calls)


def test_redact_is_applied_to_the_trace(setup, caplog):
    """The trace record is the redacted traceback, exactly."""
    e = RuntimeError("redis://user:secret@host/0 failed")
    with caplog.at_level(logging.DEBUG, logger="cachegen.stream.loader"):
        loader_mod._Load.trace(e)
    (r,) = caplog.records
    assert r.getMessage() == redact("".join(traceback.format_exception(e)))
    assert "secret" not in r.getMessage()


def test_a_failed_fetch_keeps_its_times_its_estimate_and_its_words(setup):
    """A chunk whose fetch failed is recomputed (its choice is text), but its decision keeps when
    the fetch ran and the estimate it was made with, and the fault names the chunk and level."""
    model, codec, store, tokens, _kv = setup
    res = StreamingLoader(FaultyStore(store, {2: "missing"}), codec, model.recompute, LoaderOptions(policy=0)).load(
        tokens
    )
    assert res.faults == ["chunk 2 level 0: ChunkNotFound: chunk 2 (injected)"]
    before, d = res.decisions[1], res.decisions[2]
    assert (d.choice, d.reason, d.kept) == ("text", "fault", False)
    assert d.est_gbps is not None and d.est_gbps == before.est_gbps
    assert d.fetch_start is not None and d.fetch_end is not None
    assert before.fetch_end <= d.fetch_start <= d.fetch_end <= d.decode_start


def test_a_deadline_of_a_load_must_be_positive(setup):
    model, codec, store, tokens, _kv = setup
    loader = StreamingLoader(store, codec, model.recompute, LoaderOptions(policy=0))
    for bad in (0, -1.0):
        with pytest.raises(ConfigError) as e:
            loader.load(tokens, slo_s=bad)
        assert str(e.value) == f"slo_s must be positive, not {bad}"
