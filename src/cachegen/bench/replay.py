"""Replay the streaming loader in virtual time: many loads, no sleeping, no noise from other processes.

:func:`replay_load` drives the real :class:`~cachegen.stream.loader.StreamingLoader`
(its planning, pipeline, fault handling and stitching) with a
:class:`~cachegen.stream.pipeline.VirtualClock` and a
:class:`~cachegen.stream.pipeline.VirtualRunner`, so a load's events happen in
virtual-time order, deterministically. What is virtual is only what takes time:

* the store holds no payloads, only their sizes (a payload is a view of that many zero bytes);
* the link is a :class:`~cachegen.stream.link.ThrottledLink` over a bandwidth
  :class:`~cachegen.stream.link.Trace` (which the planner does not know) that sleeps on
  the virtual clock;
* decoding and recomputing a chunk advance the clock by its true compute time: by
  default the planner's own cost model times a seeded log-normal noise, so the planner
  is not told the truth; they return a tiny stand-in KV of the right tokens.

The stitch of the stand-ins takes no virtual time, so :attr:`ReplayResult.load_s` adds
the cost model's stitch time, which the loader keeps back from the deadline. The
stream bench replays hundreds of loads per method with it (rows with
``timing="virtual"``) beside its wall-clock loads.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from cachegen.errors import ConfigError
from cachegen.kv import KVCache, KVLayer
from cachegen.store import ChunkInfo, ChunkRef
from cachegen.stream import (
    ComputeRates,
    CostModel,
    LoaderOptions,
    LoadResult,
    StreamingLoader,
    ThrottledLink,
    ThroughputEstimator,
    Trace,
    VirtualClock,
    VirtualRunner,
)
from cachegen.stream.costs import TEXT
from cachegen.stream.planner import Choice, PlanChunk


@dataclass
class ReplayResult:
    choices: list[Choice]
    load_s: float  # virtual seconds from the start to the last chunk's compute end, plus the stitch
    missed: bool  # load_s beyond the load's limit (deadline less the reserve)
    fetch_end: list[float | None] = field(default_factory=list)  # per chunk (None: not fetched)
    compute_end: list[float | None] = field(default_factory=list)
    result: LoadResult | None = None  # the loader's own result


_ZEROS = bytes(0)


def _zeros(n: int) -> bytes:
    global _ZEROS
    if len(_ZEROS) < n:
        _ZEROS = bytes(max(n, 2 * len(_ZEROS)))
    return _ZEROS


class _VirtualWork:
    """The replay's store, codec and model: sizes instead of payloads, clock time instead of work."""

    def __init__(
        self,
        chunks: Sequence[PlanChunk],
        costs: CostModel,
        clock: VirtualClock,
        cpu_noise: float,
        seed: int,
        compute_s: Callable[[int, Choice], float] | None,
        families: Mapping[int, str] | None = None,
    ):
        self.families = dict(families or {})
        self.levels = tuple(self.families)  # the levels it names families for (none: one each)
        self.chunks = list(chunks)
        self.costs, self.clock, self.cpu_noise, self.compute_s = costs, clock, cpu_noise, compute_s
        self.rng = random.Random(seed)
        self.infos = [
            ChunkInfo(ChunkRef(c.index, c.start, c.start + c.num_tokens, f"virtual-{c.index}"), dict(c.sizes))
            for c in self.chunks
        ]
        self._pos = {inf.ref.key: p for p, inf in enumerate(self.infos)}
        self._level: dict[str, int] = {}  # the level each chunk was fetched at

    # the store (ChunkSource)
    def plan(self, tokens: Sequence[int], *, timeout: float | None = None) -> list[ChunkInfo]:
        return self.infos

    def get(self, ref: ChunkRef, level: int, *, timeout: float | None = None) -> bytes:
        self._level[ref.key] = level
        n = self.infos[self._pos[ref.key]].sizes[level]
        # only the payload's length matters (to the link and the estimator): a view of shared zeros
        return memoryview(_zeros(n))[:n]  # type: ignore[return-value]

    # the codec (ChunkCodec, NamesDecoders)
    def decoder_family(self, level: int) -> str:
        return self.families[level]  # asked only for its ``levels``, the map's keys

    def encode(self, kv: KVCache, level: int, *, key: str | None = None) -> bytes:
        raise ConfigError("the replay's codec only decodes")

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        if key is None or key not in self._pos:
            raise ConfigError("the replay's codec needs the chunk key")
        p = self._pos[key]
        self.clock.sleep(self._true(p, self._level[key]))
        return self._stand_in(self.chunks[p].start, self.chunks[p].num_tokens)

    def decode_many_into(
        self, datas: Sequence[bytes], out: KVCache, sizes: Sequence[int], *, keys: Sequence[str | None] | None = None
    ) -> KVCache:
        """Consecutive chunks in one call, as the project codec decodes chunks that waited in the
        loader's queue: the first takes its compute time alone (the call's fixed part), each
        other one its batched share."""
        if keys is None or any(k is None or k not in self._pos for k in keys):
            raise ConfigError("the replay's codec needs the chunk keys")
        for j, k in enumerate(keys):
            p = self._pos[cast(str, k)]
            self.clock.sleep(self._true(p, self._level[cast(str, k)], batched=j > 0))
            c = self.chunks[p]
            out.slice(c.start, c.start + c.num_tokens).write(self._stand_in(c.start, c.num_tokens))
        return out

    # the model (Recompute)
    def recompute(self, prefix: KVCache | None, token_ids: list[int]) -> KVCache:
        start = prefix.end if prefix is not None else 0
        end = start + len(token_ids)
        for p, c in enumerate(self.chunks):
            if start <= c.start < end:
                self.clock.sleep(self._true(p, TEXT))
        return self._stand_in(start, len(token_ids))

    def _true(self, p: int, choice: Choice, batched: bool = False) -> float:
        c = self.chunks[p]
        if self.compute_s is not None:
            return self.compute_s(p, choice)
        pred = (
            self.costs.recompute_s(c.start, c.num_tokens)
            if choice == TEXT
            else self.costs.decode_s(int(choice), c.num_values or 1, batched)
        )
        return pred * math.exp(self.rng.gauss(0.0, self.cpu_noise)) if self.cpu_noise else pred

    @staticmethod
    def _stand_in(start: int, n: int) -> KVCache:
        z = torch.zeros(1, n, 1)
        return KVCache([KVLayer(z, z)], start=start)


def replay_load(
    chunks: Sequence[PlanChunk],
    trace: Trace,
    costs: CostModel,
    options: LoaderOptions,
    estimator: ThroughputEstimator | None = None,
    latency_s: float | None = None,
    cpu_noise: float = 0.2,
    seed: int = 0,
    compute_s: Callable[[int, Choice], float] | None = None,
    rates: ComputeRates | None = None,
    families: Mapping[int, str] | None = None,
) -> ReplayResult:
    """One load of ``chunks`` by the loader in virtual time over a link following ``trace``.

    ``options``: the loader's (``values_per_token`` None: taken from the chunks; ``dtype``
    sets the stitch's bytes per value, bf16 when None). ``estimator``: pass one across
    replays to carry the estimate from load to load, as the engine does. ``latency_s``:
    per fetch (default ``costs.fetch_latency_s``). ``compute_s(position, choice)``
    overrides the true compute seconds (default: the cost model's prediction times
    ``exp(N(0, cpu_noise))``, drawn in the order the chunks are computed). ``rates``: the
    loader's measured compute speed; pass one across replays as the engine keeps one.
    ``families``: level -> the codec's decoder family (levels that share one learn one speed,
    :func:`~cachegen.stream.compute_rates.decoder_families`); none: each level its own."""
    if not chunks:
        raise ConfigError("nothing to replay: no chunks")
    c0 = chunks[0]
    vpt = options.values_per_token if options.values_per_token is not None else c0.num_values // max(c0.num_tokens, 1)
    if options.dtype is None or options.values_per_token is None:
        options = LoaderOptions(
            **{**options.__dict__, "values_per_token": vpt, "dtype": options.dtype or torch.bfloat16}
        )
    clock = VirtualClock()
    work = _VirtualWork(chunks, costs, clock, cpu_noise, seed, compute_s, families)
    link = ThrottledLink(
        trace, latency_s=costs.fetch_latency_s if latency_s is None else latency_s, clock=clock, sleep=clock.sleep
    )
    loader = StreamingLoader(
        work,
        work,
        work.recompute,
        options,
        costs=costs,
        link=link,
        estimator=estimator or ThroughputEstimator(),
        rates=rates,
        clock=clock,
        runner=VirtualRunner(clock),
    )
    end = chunks[-1].start + chunks[-1].num_tokens
    res = loader.load(range(end), t0=0.0)
    itemsize = options.dtype.itemsize if options.dtype is not None else 2
    stitch = costs.stitch_s(sum(c.num_values for c in chunks), itemsize)
    load = res.load_s + stitch
    slo = options.slo_s
    limit = slo - options.reserve_s if slo is not None else math.inf
    return ReplayResult(
        res.choices,
        load,
        load > limit,
        [d.fetch_end for d in res.decisions],
        [d.decode_end for d in res.decisions],
        res,
    )
