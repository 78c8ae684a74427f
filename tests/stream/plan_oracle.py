"""A two-stage pipeline timer for the planner's tests, written from the loader's description and
using only :class:`CostModel`'s predictions (none of the planner's code).

Payloads cross the link one after another, back to back; the compute stage takes the chunks in
order, a fetched one once it has arrived and the one before it is done, a recomputed one once the
one before it is done. The arithmetic is done in the order the description gives it (the link's
time plus the fetch, then the later of the two stages plus the decode), so a plan's time is the
same float as the planner's prediction of it, and ties and budgets can be tested exactly."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.planner import PlanChunk

# no per-value decode cost, no attention term, no request latency: every time is a sum of a few
# numbers the tests state
COSTS = CostModel(
    decode_s_per_mvalue={},
    decode_s_per_mvalue_default=0.0,
    decode_fixed_s=0.002,
    recompute_fixed_s=0.01,
    recompute_s_per_token=1e-3,
    recompute_s_per_token_ctx=0.0,
    fetch_latency_s=0.0,
)
TOKENS = 256  # a chunk's recompute: 0.01 + 0.256 = 0.266 s
SIZES = {1: 250_000, 2: 125_000, 3: 62_500}  # at 0.1 Gbit/s 20, 10 and 5 ms; at 0.05 40, 20, 10 ms
G = 0.1

# Exact binary fractions: a fetch of 125 MB at 1 Gbit/s is 1.0 s, a decode 0.5 s, the recompute of a
# one-token chunk 0.5 + 1.0 = 1.5 s: fetching and recomputing tie exactly.
EXACT = CostModel(
    decode_s_per_mvalue={},
    decode_s_per_mvalue_default=0.0,
    decode_fixed_s=0.5,
    recompute_fixed_s=0.5,
    recompute_s_per_token=1.0,
    recompute_s_per_token_ctx=0.0,
    fetch_latency_s=0.0,
)


def make_chunks(n: int, sizes: dict[int, int] = SIZES, tokens: int = TOKENS, first: int = 0) -> list[PlanChunk]:
    return [PlanChunk(i, i * tokens, tokens, 0, dict(sizes)) for i in range(first, first + n)]


def step(net: float, cpu: float, c: PlanChunk, o, gbps: float, costs: CostModel, prev=None) -> tuple[float, float]:
    """(link free, compute free) after chunk ``c`` at option ``o``; a chunk that arrives before the
    compute stage is free, after one of its own level (``prev``), joins that chunk's batch: it is
    decoded at its batched cost. A fetch that starts while the compute stage is still busy adds its
    CPU time to that stage's work."""
    if o == TEXT:
        return net, cpu + costs.recompute_s(c.start, c.num_tokens)
    if net < cpu:
        cpu = cpu + costs.fetch_cpu_s(c.sizes[o])
    net = net + costs.fetch_s(c.sizes[o], gbps)
    joins = net < cpu and prev == o
    return net, max(cpu, net) + costs.decode_s(o, c.num_values, batched=joins)


def run(
    chunks: Sequence[PlanChunk],
    plan: Sequence,
    rate: float | Sequence[float] | Callable[[int], float],
    costs: CostModel = COSTS,
    net: float = 0.0,
    cpu: float = 0.0,
    prev=None,
) -> tuple[float, float]:
    """(link free, compute free) after ``plan``; ``rate``: one rate, one per position, or a
    function of the position; ``prev``: the option of the chunk fetched before the first."""
    for j, (c, o) in enumerate(zip(chunks, plan, strict=True)):
        g = rate(j) if callable(rate) else rate if isinstance(rate, (int, float)) else rate[j]
        net, cpu = step(net, cpu, c, o, g, costs, prev)
        prev = o
    return net, cpu


def end(chunks, plan, head_gbps: float, tail_gbps: float | None = None, costs: CostModel = COSTS, cpu: float = 0.0):
    """When the compute stage finishes ``plan``, the first fetch at ``head_gbps``, the rest at ``tail_gbps``."""
    tail = head_gbps if tail_gbps is None else tail_gbps
    return run(chunks, plan, lambda j: head_gbps if j == 0 else tail, costs, cpu=cpu)[1]


def undominated(c: PlanChunk, costs: CostModel, allowed=None) -> list:
    """The stored (and allowed) levels no other level beats on bytes, decode time and batched decode
    time, then TEXT."""
    lv = sorted(l for l in c.sizes if allowed is None or l in allowed)
    cost = {l: (c.sizes[l], costs.decode_s(l, c.num_values), costs.decode_s(l, c.num_values, batched=True)) for l in lv}
    out = []
    for l in lv:
        beaten = False
        for p in lv:
            mine, theirs = cost[l], cost[p]
            if theirs != mine and theirs[0] <= mine[0] and theirs[1] <= mine[1] and theirs[2] <= mine[2]:
                beaten = True
        if not beaten:
            out.append(l)
    return [*out, TEXT]
