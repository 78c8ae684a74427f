"""How long one decision of the ``fastest`` policy takes: :func:`choose_fastest` over a load's chunks.

    .venv/bin/python tools/time_decision.py [--chunks 16] [--repeats 200]

A synthetic load shaped like ``cachegen bench ttft``'s ``adaptive`` method on SmolLM2: 256-token
chunks of 1.4 M values, each stored as raw fp16 (6 MB), 8-bit KV (3 MB) and three levels of the
project codec (0.15-0.9 MB, seeded sizes); a cost model corrected by a :class:`ComputeRates` that
has seen each level decode at 0.6-1.4x its prediction and a fetch's CPU, with the ladder's decoder
families. The decision runs on the fetch thread between two fetches, so its time is added to
each fetch. Prints the median over ``--repeats`` (milliseconds), with the cost model corrected
inside the timing as the loader does for every decision. README.md quotes it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from cachegen.stream import ComputeRates, CostModel
from cachegen.stream.planner import PipelineState, PlanChunk, choose_fastest

FAMILIES = {0: "fp16/level 0", 1: "uniform8/level 0", 2: "cachegen/lossy", 3: "cachegen/lossy", 4: "cachegen/lossy"}
COSTS = CostModel(
    decode_s_per_mvalue={0: 0.002, 1: 0.003, 2: 0.02, 3: 0.02, 4: 0.02},
    decode_batched_s_per_mvalue={2: 0.012, 3: 0.012, 4: 0.011},
    decode_fixed_s=0.002,
    recompute_fixed_s=0.01,
    recompute_s_per_token=4e-3,
    recompute_s_per_token_ctx=1e-6,
    fetch_latency_s=0.0003,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    rng = random.Random(0)
    chunks = [
        PlanChunk(
            i,
            i * 256,
            256,
            1_400_000,
            {
                0: 6_000_000,
                1: 3_000_000,
                2: rng.randint(700_000, 900_000),
                3: rng.randint(400_000, 600_000),
                4: rng.randint(150_000, 250_000),
            },
        )
        for i in range(a.chunks)
    ]
    rates = ComputeRates()
    for level in range(5):
        for _ in range(8):
            rates.observe(level, 1.0, rng.uniform(0.6, 1.4))
    rates.observe_fetch(3_000_000, 0.003)
    state = PipelineState(time_left_s=float("inf"), cpu_busy_s=0.004, prev=1)
    times = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        choose_fastest(chunks, 10.0, rates.corrected(COSTS, FAMILIES), state)
        times.append(time.perf_counter() - t)
    print(f"{a.chunks} chunks left, 5 formats: median {statistics.median(times) * 1e3:.3f} ms a decision")


if __name__ == "__main__":
    main()
