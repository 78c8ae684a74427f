"""Replay the loader's decisions in virtual time: many runs, no sleeping, no noise from other processes.

:func:`simulate_load` follows :class:`~cachegen.stream.loader.StreamingLoader`
step by step: a fetch stage that decides each chunk with
:func:`~cachegen.stream.planner.decide` (the same function the loader calls),
moves its bytes over a bandwidth :class:`~cachegen.stream.link.Trace`, feeds the
estimator, and hands it to a compute stage through a one-slot queue
(``prefetch`` slots, as the loader's), which decodes or recomputes it. Network time comes from the
trace (which the planner does not know); compute time from a cost model, by
default the planner's own model times a seeded log-normal noise, so the planner
is not told the truth. The bench uses it for the 100-run random trace and checks
it against real (wall-clock) loads.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.estimator import ThroughputEstimator
from cachegen.stream.link import Trace
from cachegen.stream.planner import RISK_QUANTILE, Choice, PlanChunk, decide, fetch_order


@dataclass
class SimResult:
    choices: list[Choice]
    load_s: float  # virtual seconds from the start to the last chunk's compute end, plus the stitch
    missed: bool
    fetch_end: list[float] = field(default_factory=list)
    compute_end: list[float] = field(default_factory=list)


def simulate_load(chunks: Sequence[PlanChunk], trace: Trace, costs: CostModel, slo_s: float | None,
                  policy: Union[str, int] = "adaptive", estimator: ThroughputEstimator | None = None,
                  reserve_s: float = 0.0, allowed: Sequence[int] | None = None, safety: float = 0.95,
                  latency_s: float | None = None, cpu_noise: float = 0.2, seed: int = 0,
                  compute_s: Callable[[int, Choice], float] | None = None, prefetch: int = 8,
                  risk_quantile: float | None = None, itemsize: int = 2) -> SimResult:
    """One load in virtual time. ``compute_s(i, choice)`` overrides the true compute seconds
    (default: the cost model's prediction times ``exp(N(0, cpu_noise))``). ``prefetch`` and
    ``risk_quantile`` as in :class:`~cachegen.stream.loader.StreamingLoader` (None: plan at the
    estimated rate alone). Chunks marked by :func:`~cachegen.stream.planner.with_recency_boost` make
    the adaptive policy fetch the last chunk first, as the loader does; ``choices``, ``fetch_end`` and
    ``compute_end`` are in chunk order. The stitch after the last decode takes ``costs.stitch_s``
    of the chunks' values at ``itemsize`` bytes each."""
    est = estimator or ThroughputEstimator()
    rng = random.Random(seed)
    lat = costs.fetch_latency_s if latency_s is None else latency_s
    stitch = costs.stitch_s(sum(c.num_values for c in chunks), itemsize)  # as the loader keeps it back
    limit = (slo_s - reserve_s) if slo_s is not None else math.inf  # for the load, stitch included
    deadline = limit - stitch  # for the last compute
    n = len(chunks)
    share = max(slo_s - reserve_s, 0.0) / n if slo_s is not None and n else None

    def predicted(i: int, c: Choice) -> float:
        ch = chunks[i]
        return costs.recompute_s(ch.start, ch.num_tokens) if c == TEXT else costs.decode_s(c, ch.num_values or 1)

    def true_compute(i: int, c: Choice) -> float:
        if compute_s is not None:
            return compute_s(i, c)
        return predicted(i, c) * math.exp(rng.gauss(0.0, cpu_noise)) if cpu_noise else predicted(i, c)

    # fetch order as the loader's: the last chunk first when it is boosted and the estimator warm
    order, early = fetch_order(chunks, policy == "adaptive", not est.known)
    choice_of: dict[int, Choice] = {}
    items: list[int] = []  # queue order of chunk positions
    fetch_end: list[float] = []
    put_t: list[float] = []  # when item k entered the queue
    take_t: list[float] = []  # when the compute stage took it
    comp_end: list[float] = []
    t = 0.0  # the fetch stage's clock
    net_free = 0.0
    prev: Choice | None = None
    deferred = False

    def enqueue(i: int, done: float) -> None:
        k = len(items)
        items.append(i)
        fetch_end.append(done)
        # a queue of ``prefetch`` slots: the put completes once item k - prefetch has been taken
        p = max(done, take_t[k - prefetch]) if k >= prefetch else done
        put_t.append(p)
        tk = max(p, comp_end[k - 1]) if k else p
        take_t.append(tk)
        comp_end.append(tk + true_compute(i, choice_of[i]))

    for pos, i in enumerate(order):
        # cpu work committed at decision time: the item in progress (its predicted end) + queued items
        busy = 0.0
        for k, j in enumerate(items):
            if take_t[k] <= t < comp_end[k]:
                busy += max(take_t[k] + predicted(j, choice_of[j]) - t, 0.0)
            elif put_t[k] <= t < take_t[k]:
                busy += predicted(j, choice_of[j])
        if deferred:
            busy += predicted(early, TEXT)
        c = decide(policy, [chunks[j] for j in order[pos:]], costs, time_left_s=None if slo_s is None else deadline - t,
                   cpu_busy_s=busy, est_gbps=est.next_estimate(first_of_load=prev is None), last_gbps=est.last(),
                   tail_gbps=est.tail_estimate(),
                   known=est.known, history_s_per_bit=est.s_per_bit_history() if risk_quantile else None,
                   risk_quantile=risk_quantile or RISK_QUANTILE,
                   share_s=share, prev=prev, allowed=allowed, safety=safety)
        choice_of[i] = prev = c
        if c == TEXT:
            if i == early:  # recomputed after the others (it needs them)
                deferred = True
                continue
            done = t
        else:
            nbytes = chunks[i].sizes[c]
            start = max(t, net_free)
            if trace.by == "chunk":
                dur = lat + nbytes * 8 / (trace.gbps_at(chunks[i].index) * 1e9)
            else:
                dur = lat + trace.transfer_s(start, nbytes * 8)
            done = start + dur
            net_free = done
            est.add(nbytes, done - t)
        enqueue(i, done)
        t = put_t[-1]
    if deferred:
        enqueue(early, t)
    choices = [choice_of[i] for i in range(n)]
    load = (max(comp_end) + stitch) if comp_end else 0.0
    order_fetch = {i: f for i, f in zip(items, fetch_end)}
    order_comp = {i: e for i, e in zip(items, comp_end)}
    return SimResult(choices, load, load > limit, [order_fetch[i] for i in range(n)], [order_comp[i] for i in range(n)])
