"""Per-chunk choice of a quality level (or recompute from text): pure functions.

The loader is a two-stage pipeline: a network stage fetches chunk payloads in
order, and a compute stage decodes them (or recomputes a chunk from its text,
which needs every chunk before it). :func:`simulate` predicts when the compute
stage finishes for a list of choices; the adaptive policy picks, for the next
chunk, the highest-quality level such that the remaining chunks can still
finish by the deadline at their cheapest option. Time left is measured against
the absolute deadline, so time a chunk did not use is carried forward. When the
link's past rates are known, "can still finish" means: in most futures resampled
from them (:func:`finish_quantile`), so the slack kept matches how much the link
varies and how much of a slow fetch the compute stage cannot hide.

Quality order: a lower level number is better (``0`` = lossless, ``1`` = best
lossy, ... ``N`` = most aggressive). Text (recompute) is exact, so it is taken
whenever it finishes the chunk sooner than fetching the chosen level.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.protocols import Predicts

Choice = int | str  # a level, or TEXT

# Finish-time quantile of risk planning when it is asked for (``risk_quantile`` of the loader; off
# by default). On the uniform 0.1-10 Gbps random trace with an 8-chunk prefetch queue it did not beat
# planning at the estimated rate (docs/streaming.md), so the loader does not use it unless told.
RISK_QUANTILE = 0.95
FASTEST = "fastest"  # the policy that minimizes the load's time (see choose_fastest)
FASTEST_HORIZON = 24  # chunks the fastest policy looks ahead (see choose_fastest)
# The share of the predicted time a mix of formats must save over the best single format before the
# fastest policy mixes (see choose_fastest).
MIX_MARGIN = 0.10
RECENCY_BOOST = 2  # levels better for the last chunk of a load (see with_recency_boost)

FUTURES = 256  # futures per decision (~1 ms for 16 chunks and 7 levels)
RECENT = 5  # the estimator's window: a slowdown beyond the older history in it is a new regime
MIN_HISTORY = 4  # fewer past fetches than this say too little about the spread


@dataclass(frozen=True)
class PlanChunk:
    """What the planner knows about one chunk before fetching it."""

    index: int
    start: int  # first token position (= prefix length a recompute would need)
    num_tokens: int
    num_values: int  # K and V values over all layers
    sizes: Mapping[int, int]  # payload bytes per stored level
    boost: int = 0  # levels better than the even plan's (the chunk next to the prompt's uncached rest)


def with_recency_boost(chunks: Sequence[PlanChunk], boost: int) -> list[PlanChunk]:
    """The chunks with the last one marked to get ``boost`` levels better than the rest.

    Why: the tokens right after the cached prefix attend to its end far more than to the rest,
    so quantization noise costs most there: measured on SmolLM2 (4K context, bf16), one of 16
    chunks at the most aggressive level and the rest at the best gives KL 0.056 when it is the
    last chunk and at most 0.0026 when it is the first or a middle one (all at the best: 0.0023;
    docs/streaming.md). With KL growing ~2.2x per level, 2-3 levels better for that one chunk
    is about where its marginal KL per byte matches the others'."""
    out = list(chunks)
    if out and boost > 0:
        c = out[-1]
        out[-1] = PlanChunk(c.index, c.start, c.num_tokens, c.num_values, c.sizes, boost)
    return out


def fetch_order(chunks: Sequence[PlanChunk], adaptive: bool, cold: bool) -> tuple[list[int], int | None]:
    """(Positions of ``chunks`` in the order to fetch them, the position fetched out of order or None).

    With the adaptive policy and a boosted last chunk (:func:`with_recency_boost`) that chunk
    comes first, then the rest in order; with a ``cold`` estimator, whose first fetch is a probe
    at the smallest level, chunk 0 takes the probe and the last chunk comes second.

    Why: the last chunk is the one whose quality matters most (see :func:`with_recency_boost`), and
    on a jittery link a slow fetch late in the load can leave it only the most aggressive level;
    fetched first, it gets the whole deadline's slack and the chunks that matter less absorb the
    surprises. Chunks decode independently, so only a recompute (which needs the chunks before
    it) has to wait: the loader then recomputes the last chunk after the others."""
    n = len(chunks)
    if not (adaptive and n >= 2 and chunks[-1].boost > 0 and chunks[-1].sizes):
        return list(range(n)), None
    if cold and n >= 3:
        return [0, n - 1, *range(1, n - 1)], n - 1
    return [n - 1, *range(n - 1)], n - 1


def lift(chunk: PlanChunk, level: Choice, allowed: Sequence[int] | None = None) -> Choice:
    """The level ``chunk`` takes when the plan's level is ``level`` (``chunk.boost`` better)."""
    if chunk.boost <= 0 or level == TEXT:
        return level
    lv = options(chunk, allowed, text=False)
    if level not in lv:
        return level
    return lv[max(0, lv.index(level) - chunk.boost)]


@dataclass
class PipelineState:
    """Where the pipeline stands when the next chunk is decided (seconds from now)."""

    time_left_s: float  # until the deadline (may be negative)
    cpu_busy_s: float = 0.0  # predicted compute work already committed
    net_busy_s: float = 0.0  # predicted network work already committed
    prev: Choice | None = None  # the choice of the chunk fetched last (a batch it may join)


@dataclass
class Prediction:
    choice: Choice
    finish_s: float  # predicted end of this chunk's compute, from now
    total_s: float  # predicted end of all remaining chunks (with the cheapest tail)
    fits: bool
    # choose_fastest: this choice kept for every remaining chunk is the best plan predicted (the
    # loader may then keep it a few chunks without deciding again)
    steady: bool = False


def chunk_costs(
    chunk: PlanChunk, choice: Choice, gbps: float, costs: CostModel, batched: bool = False
) -> tuple[float, float]:
    """(network seconds, compute seconds) of one chunk under one choice (``batched``: its decode
    shares a call with chunks that waited with it, :meth:`CostModel.decode_s`)."""
    if choice == TEXT:
        return 0.0, costs.recompute_s(chunk.start, chunk.num_tokens)
    level = int(choice)
    return costs.fetch_s(chunk.sizes[level], gbps), costs.decode_s(level, chunk.num_values, batched)


class _Memo:
    """A cost model whose decode predictions are each computed once (the same values): in one
    decision :func:`useful_options` and :func:`_prices` ask for every chunk's decode at every
    level, alone and batched, the chunks of a load have one size in values, and a corrected
    model's prediction costs a few microseconds (:class:`~cachegen.stream.compute_rates.ScaledCosts`).
    Fetches and recomputes differ per chunk and are asked for once: passed through."""

    def __init__(self, costs: Predicts):
        self.costs = costs
        self.fetch_s = costs.fetch_s
        self.fetch_cpu_s = costs.fetch_cpu_s
        self.recompute_s = costs.recompute_s
        self._decode: dict[tuple[int, int, bool], float] = {}

    def decode_s(self, level: int, num_values: int, batched: bool = False) -> float:
        key = (level, num_values, batched)
        if key not in self._decode:
            self._decode[key] = self.costs.decode_s(level, num_values, batched)
        return self._decode[key]


def _step(
    net: float, cpu: float, chunk: PlanChunk, choice: Choice, gbps: float, costs: Predicts, prev: Choice | None
) -> tuple[float, float]:
    """(net, cpu) after ``chunk``: its fetch follows the last one; its compute starts when it has
    arrived and the compute before it is done. The loader decodes consecutive chunks of one level
    that wait in its queue in one call: a chunk that arrives while the compute stage is still busy,
    after one of its level (``prev``), costs its batched share. A fetch that begins while the compute
    stage is busy takes its CPU time (:meth:`CostModel.fetch_cpu_s`) from that stage's work."""
    if choice == TEXT:
        return net, cpu + costs.recompute_s(chunk.start, chunk.num_tokens)
    level = int(choice)
    nbytes = chunk.sizes[level]
    if cpu > net:
        cpu = cpu + costs.fetch_cpu_s(nbytes)
    net = net + costs.fetch_s(nbytes, gbps)
    return net, max(cpu, net) + costs.decode_s(level, chunk.num_values, cpu > net and prev == choice)


def simulate(
    chunks: Sequence[PlanChunk],
    choices: Sequence[Choice],
    gbps: float | Callable[[int], float],
    costs: CostModel,
    state: PipelineState | None = None,
) -> float:
    """Predicted seconds from now until the last chunk's compute ends; ``gbps`` is one rate, or
    a function of the chunk index (e.g. a trace's ``gbps_at``)."""
    st = state or PipelineState(0.0)
    net, cpu, prev = st.net_busy_s, st.cpu_busy_s, st.prev
    for ch, c in zip(chunks, choices):
        net, cpu = _step(net, cpu, ch, c, gbps(ch.index) if callable(gbps) else gbps, costs, prev)
        prev = c
    return cpu


def options(chunk: PlanChunk, allowed: Sequence[int] | None = None, text: bool = True) -> list[Choice]:
    """Stored levels, best quality first, then TEXT."""
    lv: list[Choice] = sorted(l for l in chunk.sizes if allowed is None or l in allowed)
    return [*lv, TEXT] if text else lv


def cheapest_tail(
    chunks: Sequence[PlanChunk],
    gbps: float,
    costs: CostModel,
    net: float,
    cpu: float,
    allowed: Sequence[int] | None = None,
    prev: Choice | None = None,
) -> tuple[float, float, list[Choice]]:
    """Greedy: each chunk takes the option that ends its compute soonest (``prev``: the choice
    of the chunk before the first)."""
    picks: list[Choice] = []
    for ch in chunks:
        best: tuple[float, float, Choice] | None = None
        for o in options(ch, allowed):
            n2, c2 = _step(net, cpu, ch, o, gbps, costs, prev)
            if best is None or (c2, n2) < (best[1], best[0]):
                best = (n2, c2, o)
        assert best is not None  # options() always holds TEXT
        net, cpu, prev = best
        picks.append(prev)
    return net, cpu, picks


def tail_at(
    chunks: Sequence[PlanChunk],
    level: Choice,
    gbps: float,
    costs: CostModel,
    net: float,
    cpu: float,
    allowed: Sequence[int] | None = None,
    prev: Choice | None = None,
) -> float:
    """Compute end when every chunk takes ``level`` (a boosted chunk: its :func:`lift`; a chunk
    without it: its fastest option); ``prev``: the choice of the chunk before the first."""
    for ch in chunks:
        if level in ch.sizes or level == TEXT:
            o = lift(ch, level, allowed)
            net, cpu = _step(net, cpu, ch, o, gbps, costs, prev)
            prev = o
        else:
            net, cpu, (prev,) = cheapest_tail([ch], gbps, costs, net, cpu, allowed, prev)
    return cpu


def finish_quantile(
    chunks: Sequence[PlanChunk],
    plan: Sequence[Choice],
    head_s_per_bit: float,
    tail_s_per_bit: np.ndarray,
    costs: CostModel,
    state: PipelineState,
    q: float,
) -> float:
    """The ``q`` quantile of when the last chunk's compute ends (seconds from now) under ``plan``.

    Monte Carlo over the rows of ``tail_s_per_bit`` (M, len(chunks) - 1): seconds per bit of
    each later chunk's fetch in one possible future (the head's is ``head_s_per_bit``). Fetches
    run back to back; a chunk's compute starts when it has arrived and the one before is done,
    so a slow fetch costs only what the compute stage cannot hide behind work it already has."""
    m = tail_s_per_bit.shape[0]
    net = np.full(m, state.net_busy_s)
    cpu = np.full(m, state.cpu_busy_s)
    prev = state.prev
    for j, (ch, o) in enumerate(zip(chunks, plan)):
        if o == TEXT:
            cpu = cpu + costs.recompute_s(ch.start, ch.num_tokens)
            prev = o
            continue
        spb = head_s_per_bit if j == 0 else tail_s_per_bit[:, j - 1]
        level = int(o)
        cpu = np.where(cpu > net, cpu + costs.fetch_cpu_s(ch.sizes[level]), cpu)  # as :func:`_step`
        net = net + (costs.fetch_latency_s + 8 * ch.sizes[level] * spb)
        single = costs.decode_s(level, ch.num_values)
        batched = costs.decode_s(level, ch.num_values, True) if prev == o else single  # as :func:`_step`
        cpu = np.maximum(cpu, net) + np.where(cpu > net, batched, single)
        prev = o
    return float(np.quantile(cpu, q))


def choose_adaptive(
    remaining: Sequence[PlanChunk],
    gbps: float,
    costs: CostModel,
    state: PipelineState,
    allowed: Sequence[int] | None = None,
    tail_gbps: float | None = None,
    safety: float = 1.0,
    futures: np.ndarray | None = None,
    risk_quantile: float = RISK_QUANTILE,
) -> Prediction:
    """Choice for ``remaining[0]``, the next chunk to fetch.

    The best level that every remaining chunk could take and still end by the
    deadline (an even plan keeps slack for later drops; time saved is carried
    forward and raises later chunks' levels); failing that, the best level for
    this chunk with the remaining chunks at their fastest option; failing that,
    the fastest option. Text instead, when it ends this chunk sooner and fits.
    ``gbps`` predicts this chunk's fetch, ``tail_gbps`` (default ``gbps``) the
    later ones'. The plan must end within ``safety * time_left_s``.

    ``futures`` (M, len(remaining) - 1): seconds per bit of each later chunk's
    fetch in M possible futures (drawn from past samples). With them an even plan
    fits when its ``risk_quantile`` finish time (:func:`finish_quantile`) is in
    time, instead of its finish at ``tail_gbps``: the plan then keeps slack in
    proportion to how much the link varies and to how little of that the compute
    stage can hide, and none on a steady link.
    """
    if not remaining:
        raise ValueError("no chunk to plan")
    head, tail = remaining[0], remaining[1:]
    tg = gbps if tail_gbps is None else tail_gbps
    budget = state.time_left_s * safety
    heads = {}
    for o in options(head, allowed):
        heads[o] = _step(state.net_busy_s, state.cpu_busy_s, head, o, gbps, costs, state.prev)
    text_net, text_cpu = heads[TEXT]
    levels = [o for o in heads if o != TEXT]

    def pred(o: Choice, total: float) -> Prediction:
        return Prediction(o, heads[o][1], total, total <= budget)

    # risk planning only: the fastest option of each later chunk, for chunks lacking the planned level
    fast = (
        cheapest_tail(tail, tg, costs, *heads[levels[-1]], allowed, levels[-1])[2]
        if futures is not None and levels
        else []
    )

    def fits(o: Choice, total: float) -> bool:
        if futures is None or not tail:
            return total <= budget
        plan = [lift(head, o, allowed), *[lift(ch, o, allowed) if o in ch.sizes else f for ch, f in zip(tail, fast)]]
        return finish_quantile(remaining, plan, 1.0 / (gbps * 1e9), futures, costs, state, risk_quantile) <= budget

    # 1. an even plan (boosted chunks a few levels better)
    for o in levels:
        ho = lift(head, o, allowed)
        total = tail_at(tail, o, tg, costs, *heads[ho], allowed, ho)
        if fits(o, total):
            if text_cpu <= heads[ho][1]:
                tt = tail_at(tail, o, tg, costs, text_net, text_cpu, allowed, TEXT)
                if tt <= budget:
                    return pred(TEXT, tt)
            return pred(ho, total)
    # 2. this chunk as good as possible, the rest as fast as possible
    fastest: list[Prediction] = []
    for o in [*levels, TEXT]:
        _, total, _ = cheapest_tail(tail, tg, costs, *heads[o], allowed, o)
        fastest.append(pred(o, total))
    text = fastest[-1]
    for p in fastest[:-1]:
        if p.fits:
            return text if text.fits and text.finish_s <= p.finish_s else p
    if text.fits:
        return text
    # 3. nothing fits: finish as soon as possible
    return min(fastest, key=lambda p: (p.total_s, p.finish_s))


def useful_options(chunk: PlanChunk, costs: Predicts, allowed: Sequence[int] | None = None) -> list[Choice]:
    """:func:`options` less the stored levels that another one beats on both bytes and decode
    time (they can never end a load sooner): the few that matter to :func:`choose_fastest`."""
    nv = chunk.num_values
    # options()'s stored levels, filtered inline: calling it made a 16-chunk decision 4% slower
    cost = [
        (o, chunk.sizes[o], costs.decode_s(o, nv), costs.decode_s(o, nv, True))
        for o in sorted(chunk.sizes)
        if allowed is None or o in allowed
    ]
    # plain loops: this runs for every chunk of the horizon at every decision, on the fetch thread
    keep: list[Choice] = []
    for o, size, alone, batched in cost:
        for _, s2, a2, b2 in cost:
            if s2 <= size and a2 <= alone and b2 <= batched and (s2 < size or a2 < alone or b2 < batched):
                break
        else:
            keep.append(o)
    keep.append(TEXT)
    return keep


# a chunk at one option: fetch s, decode s, batched decode s, the fetch's CPU s (text: 0, r, r, 0)
Price = tuple[float, float, float, float]


def _prices(chunk: PlanChunk, choices: Sequence[Choice], gbps: float, costs: Predicts) -> dict[Choice, Price]:
    """``chunk``'s :data:`Price` at each of ``choices`` (text: no fetch, its recompute twice)."""
    out: dict[Choice, Price] = {}
    for c in choices:
        if c == TEXT:
            r = costs.recompute_s(chunk.start, chunk.num_tokens)
            out[c] = (0.0, r, r, 0.0)
        else:
            lv = int(c)
            out[c] = (
                costs.fetch_s(chunk.sizes[lv], gbps),
                costs.decode_s(lv, chunk.num_values),
                costs.decode_s(lv, chunk.num_values, True),
                costs.fetch_cpu_s(chunk.sizes[lv]),
            )
    return out


def _at(net: float, cpu: float, prev: Choice | None, c: Choice, p: Price) -> tuple[float, float]:
    """:func:`_step` at a precomputed price: the same floats, in the same order."""
    if c == TEXT:
        return net, cpu + p[1]
    if cpu > net:
        cpu = cpu + p[3]
    net = net + p[0]
    return net, max(cpu, net) + (p[2] if cpu > net and prev == c else p[1])


def _soonest(
    net: float, cpu: float, prev: Choice | None, choices: Sequence[Choice], prices: Mapping[Choice, Price]
) -> tuple[float, float, Choice]:
    """(net, cpu, choice) after a chunk at whichever of ``choices`` ends its compute soonest (then
    frees the link soonest; ties to the earlier choice)."""
    best: tuple[float, float, Choice] | None = None
    for c in choices:
        # _at, inline: a call per candidate made a decision 20% slower (0.47 -> 0.56 ms)
        p = prices[c]
        if c == TEXT:
            n2, c2 = net, cpu + p[1]
        else:
            c1 = cpu + p[3] if cpu > net else cpu
            n2 = net + p[0]
            c2 = max(c1, n2) + (p[2] if c1 > n2 and prev == c else p[1])
        if best is None or c2 < best[1] or (c2 == best[1] and n2 < best[0]):
            best = (n2, c2, c)
    assert best is not None  # every chunk has an option: text
    return best


def choose_fastest(
    remaining: Sequence[PlanChunk],
    gbps: float,
    costs: CostModel,
    state: PipelineState,
    allowed: Sequence[int] | None = None,
    tail_gbps: float | None = None,
    horizon: int = FASTEST_HORIZON,
) -> Prediction:
    """The option for ``remaining[0]`` that ends the load soonest (the ``"fastest"`` policy: the
    least time to first token, with or without a deadline).

    Each of this chunk's :func:`useful_options` is followed by the next ``horizon`` chunks in
    two kinds of continuation: each chunk greedily at the option that ends its compute soonest,
    and every chunk at one format; the earliest predicted end wins, ties to the better (earlier)
    option. Why look ahead: a big, cheap-to-decode format taken while the link is idle delays
    every later fetch, and a small, slow-to-decode one taken while the CPU is busy delays every
    later decode; what the user waits for is the end of the last chunk. The horizon bounds the
    work per decision (a 32K-token context has 128 chunks) where a few dozen chunks already
    show which stage a choice holds up.

    A mix of formats is taken only when it is predicted to save at least :data:`MIX_MARGIN` of
    the time of the best single format (the one that, kept for every chunk, ends soonest; this
    chunk at it, then its best continuation), or when only the mix meets the deadline; otherwise
    this chunk takes that format. Why: what the model leaves out costs a mix, not a single format: a big fetch's
    store read and checksum take a core from the decode beside it (at 10 Gbit/s a 3 MB 8-bit
    chunk's read keeps the fetch thread busy, and an L7 decode beside it took 24-35 ms against
    15 ms alone), and a chunk of another format splits a batched decode. At 10 Gbit/s the plan
    took L7 for the first two chunks for a predicted 3 ms (5%) and ended its load 25 ms after
    8-bit KV alone; with a 5% margin it still took L7 for the first chunk, whose decode beside the
    8-bit fetches took 55 ms, and ended its load at 0.129 s against 0.101 s for 8-bit KV alone."""
    if not remaining:
        raise ValueError("no chunk to plan")
    # Each chunk's price at each option is computed once and the continuations step through them
    # inline (:func:`_at`, :func:`_soonest`): a decision runs on the fetch thread between two
    # fetches, and with a call into the cost model per step (about 700 a decision for 16 chunks)
    # it took 1.4-1.9 ms, more than a fifth of a 3 MB fetch at 10 Gbit/s; now about 0.4 ms.
    tg = gbps if tail_gbps is None else tail_gbps
    window = remaining[: horizon + 1]
    memo = _Memo(costs)
    opts = [useful_options(ch, memo, allowed) for ch in window]
    formats = [o for o in opts[0] if o != TEXT]
    # every price the continuations below read, computed once: the format a continuation keeps
    # may be one that useful_options dropped for a later chunk
    prices = [
        _prices(ch, [*chs, *(f for f in formats if f not in chs and f in ch.sizes)], gbps if j == 0 else tg, memo)
        for j, (ch, chs) in enumerate(zip(window, opts))
    ]
    rest = list(zip(opts[1:], prices[1:]))
    preds: dict[Choice, Prediction] = {}
    single: dict[Choice, float] = {}  # this chunk and the rest at one format: the predicted end
    for o in opts[0]:
        net0, cpu0 = _at(state.net_busy_s, state.cpu_busy_s, state.prev, o, prices[0][o])
        ends = []
        net, cpu, prev = net0, cpu0, o
        for chs, ps in rest:  # greedy
            net, cpu, prev = _soonest(net, cpu, prev, chs, ps)
        ends.append(cpu)
        for f in formats:  # one format for the rest (a chunk without it: its greedy option)
            net, cpu, prev = net0, cpu0, o
            for chs, ps in rest:
                if f in ps:
                    net, cpu = _at(net, cpu, prev, f, ps[f])
                    prev = f
                else:
                    net, cpu, prev = _soonest(net, cpu, prev, chs, ps)
            ends.append(cpu)
            if f == o:
                single[o] = cpu
        total = min(ends)
        preds[o] = Prediction(o, cpu0, total, total <= state.time_left_s)
    best = min(preds.values(), key=lambda p: p.total_s)  # ties: the better (earlier) option
    if single:
        one = preds[min(single, key=single.__getitem__)]
        if best.choice != one.choice and best.total_s > (1 - MIX_MARGIN) * one.total_s and (one.fits or not best.fits):
            return one
    # steady: no mix is predicted to end sooner than this format kept for the rest
    return replace(best, steady=best.choice in single and single[best.choice] <= best.total_s)


def choose_rule(
    chunk: PlanChunk, share_s: float, gbps: float, costs: CostModel, allowed: Sequence[int] | None = None
) -> Choice:
    """CacheGen's rule: the chunk gets ``share_s`` (deadline / chunks); the best level whose
    transfer fits it at the last measured throughput (decoding overlaps the next transfer),
    else text."""
    for o in options(chunk, allowed, text=False):
        n, _ = chunk_costs(chunk, o, gbps, costs)
        if n <= share_s:
            return o
    return TEXT


def smallest_level(chunk: PlanChunk, allowed: Sequence[int] | None = None) -> int | None:
    """The stored level with the fewest bytes (the probe)."""
    lv = [int(l) for l in options(chunk, allowed, text=False)]
    return min(lv, key=lambda l: (chunk.sizes[l], -l)) if lv else None


def _cold_start(
    ch: PlanChunk, cpu_busy_s: float, est_gbps: float, costs: CostModel, allowed: Sequence[int] | None
) -> Choice:
    """A cold estimator's first choice: the probe (the smallest stored level, which measures the
    link cheaply), unless recomputing this chunk (the first of the context) ends it sooner."""
    probe = smallest_level(ch, allowed)
    if probe is None:
        return TEXT
    _n, c = _step(0.0, cpu_busy_s, ch, probe, est_gbps, costs, None)
    _, ct = _step(0.0, cpu_busy_s, ch, TEXT, est_gbps, costs, None)
    return TEXT if ct < c and ch.start == 0 else probe


def decide_fastest(
    remaining: Sequence[PlanChunk],
    costs: CostModel,
    *,
    time_left_s: float | None,
    cpu_busy_s: float,
    est_gbps: float,
    tail_gbps: float,
    known: bool,
    prev: Choice | None = None,
    allowed: Sequence[int] | None = None,
) -> tuple[Choice, bool]:
    """The ``fastest`` policy's choice for ``remaining[0]`` (:func:`decide`), and whether keeping it
    for the rest is the best plan predicted (:attr:`Prediction.steady`; never for a cold
    estimator's probe, which must be followed by a real decision)."""
    ch = remaining[0]
    if not ch.sizes:
        return TEXT, False
    if not known:
        return _cold_start(ch, cpu_busy_s, est_gbps, costs, allowed), False
    left = math.inf if time_left_s is None else time_left_s
    st = PipelineState(time_left_s=left, cpu_busy_s=cpu_busy_s, prev=prev)
    p = choose_fastest(remaining, est_gbps, costs, st, allowed, tail_gbps=tail_gbps)
    return p.choice, p.steady


def decide(
    policy: str | int,
    remaining: Sequence[PlanChunk],
    costs: CostModel,
    *,
    time_left_s: float | None,
    cpu_busy_s: float,
    est_gbps: float,
    last_gbps: float,
    tail_gbps: float,
    known: bool,
    history_s_per_bit: Sequence[float] | None = None,
    risk_quantile: float = RISK_QUANTILE,
    share_s: float | None = None,
    prev: Choice | None = None,
    allowed: Sequence[int] | None = None,
    safety: float = 1.0,
) -> Choice:
    """The loader's per-chunk decision for ``remaining[0]`` (shared by the loader and :mod:`.sim`).

    ``policy``: ``"adaptive"``, ``"rule"``, ``"fastest"`` (:func:`choose_fastest`: the
    option that ends the load soonest, deadline or not), a fixed level or ``"text"``.
    ``time_left_s`` None = no deadline (the adaptive and rule policies: the best level). ``known`` False (a cold estimator: no sample, no
    prior): the first chunk takes the smallest stored level, a safe probe. The rule
    probes the same way after a text chunk, which gave it no new sample (otherwise
    it would stay on text for the rest of the load: the *stranded* rule).
    ``history_s_per_bit``: past fetches' seconds per bit; with at least
    :data:`MIN_HISTORY` of them the adaptive plan is checked against
    :data:`FUTURES` futures resampled from them (seeded by the chunk index: the same
    inputs give the same choice).
    """
    ch = remaining[0]
    if not ch.sizes or policy == TEXT:
        return TEXT
    if isinstance(policy, int):
        return policy if policy in ch.sizes else TEXT
    if policy == FASTEST:
        return decide_fastest(
            remaining,
            costs,
            time_left_s=time_left_s,
            cpu_busy_s=cpu_busy_s,
            est_gbps=est_gbps,
            tail_gbps=tail_gbps,
            known=known,
            prev=prev,
            allowed=allowed,
        )[0]
    if time_left_s is None:
        return min(options(ch, allowed, text=False), default=TEXT)
    probe = smallest_level(ch, allowed)
    if probe is None:
        return TEXT
    if policy == "rule":
        if not known or prev == TEXT:
            return probe
        return choose_rule(ch, share_s if share_s is not None else 0.0, last_gbps, costs, allowed)
    st = PipelineState(time_left_s=time_left_s, cpu_busy_s=cpu_busy_s, prev=prev)
    if not known:
        return _cold_start(ch, cpu_busy_s, est_gbps, costs, allowed)
    futures = None
    if history_s_per_bit is not None and len(history_s_per_bit) >= MIN_HISTORY and len(remaining) > 1:
        rng = np.random.default_rng(ch.index)
        h = np.asarray(history_s_per_bit, dtype=np.float64)
        futures = rng.choice(h, size=(FUTURES, len(remaining) - 1))
        # a link that slowed down beyond anything seen before (a step, not a dip) shifts every future
        recent, older = h[-RECENT:], h[:-RECENT]
        if older.size and recent.max() > older.max():
            futures *= max(1.0, (1.0 / (est_gbps * 1e9)) / h.mean())
    return choose_adaptive(
        remaining,
        est_gbps,
        costs,
        st,
        allowed,
        tail_gbps=tail_gbps,
        safety=safety,
        futures=futures,
        risk_quantile=risk_quantile,
    ).choice
