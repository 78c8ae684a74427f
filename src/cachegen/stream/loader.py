"""The streaming loader: fetch, decode and stitch a stored prefix before a deadline.

Two threads form a pipeline. The *fetch* thread decides each chunk's level (or
text) with the planner, fetches it through the link and measures throughput;
the calling thread decodes (the numba decoder releases the GIL) or recomputes
chunks in order, so chunk ``i + 1`` is on the wire while chunk ``i`` decodes.

Faults: a store timeout or connection loss, a missing chunk, a corrupt payload
or a decoded chunk whose position or shape does not match the plan stops the
fetching; that chunk and every later one are recomputed from text on top of
the good prefix. A chunk that failed is never part of the result.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

import torch

from cachegen.errors import CachegenError, ConfigError, CorruptChunk, LoaderError, StoreError
from cachegen.kv import KVCache
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.estimator import ThroughputEstimator
from cachegen.stream.link import DirectLink
from cachegen.stream.planner import (RECENCY_BOOST, RISK_QUANTILE, Choice, PlanChunk, decide, fetch_order,
                                     with_recency_boost)

Recompute = Callable[[Union[KVCache, None], list], KVCache]

ADAPTIVE = "adaptive"
RULE = "rule"


@dataclass
class ChunkDecision:
    """What happened to one chunk (times in seconds since the load began)."""

    index: int
    start: int
    end: int
    choice: Choice  # a level, or "text"
    bytes: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0  # decode, or recompute for text
    est_gbps: float | None = None  # the estimate the choice was made with
    measured_gbps: float | None = None
    fetch_start: float | None = None
    fetch_end: float | None = None
    decode_start: float | None = None
    decode_end: float | None = None
    reason: str = ""  # why text: "planned", "not stored", or the fault

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class LoadResult:
    kv: KVCache | None  # the KV of tokens [0, cached_tokens), or None
    cached_tokens: int
    decisions: list[ChunkDecision]
    slo_s: float | None
    plan_s: float = 0.0  # store.plan round trip
    load_s: float = 0.0  # from load() call to the stitched KV (what TTFT adds before the suffix prefill)
    fetch_s: float = 0.0  # sum over chunks
    decode_s: float = 0.0
    recompute_s: float = 0.0
    stitch_s: float = 0.0
    faults: list[str] = field(default_factory=list)

    @property
    def missed(self) -> bool:
        return self.slo_s is not None and self.load_s > self.slo_s

    @property
    def choices(self) -> list[Choice]:
        return [d.choice for d in self.decisions]

    def summary(self) -> str:
        per = " ".join(f"{d.index}:{'T' if d.choice == TEXT else 'L%d' % d.choice}" for d in self.decisions)
        return (f"{self.cached_tokens} tokens in {self.load_s:.3f}s (slo {self.slo_s}) "
                f"fetch {self.fetch_s:.3f}s decode {self.decode_s:.3f}s recompute {self.recompute_s:.3f}s "
                f"faults {len(self.faults)} | {per}")

    def to_json(self) -> dict:
        return {
            "cached_tokens": self.cached_tokens, "slo_s": self.slo_s, "load_s": self.load_s, "plan_s": self.plan_s,
            "fetch_s": self.fetch_s, "decode_s": self.decode_s, "recompute_s": self.recompute_s,
            "stitch_s": self.stitch_s, "faults": list(self.faults), "missed": self.missed,
            "decisions": [d.to_json() for d in self.decisions],
        }


FETCH_FAULTS = (StoreError, CorruptChunk, OSError, TimeoutError, ConnectionError)


class StreamingLoader:
    """Load the cached prefix of a prompt from ``store`` within ``slo_s`` seconds.

    ``store``: has ``plan(tokens) -> [ChunkInfo(ref, sizes)]`` and ``get(ref, level) -> bytes``
    (a :class:`cachegen.store.ContextStore`). ``codec``: has ``decode(bytes) -> KVCache``.
    ``recompute(prefix, token_ids) -> KVCache``: the KV of ``token_ids`` after ``prefix``
    (from the engine). ``policy``: ``"adaptive"``, ``"rule"`` (CacheGen's equal-share rule),
    a fixed level (int; chunks not stored at it are recomputed), or ``"text"``.
    ``reserve_s``: time kept back from the SLO for what follows the load (suffix prefill).
    ``estimator``: pass the same one to every load over a link (the next load starts from
    what the last one measured); a fresh one without a prior makes the first chunk a probe
    at the smallest level. ``prefetch``: fetched payloads that may wait for the compute stage;
    a deep queue lets fast fetches run ahead so that a later slow one is hidden behind decoding
    (8 chunks of 256 tokens at the best level are ~20 MB for SmolLM2). ``risk_quantile`` (off by
    default: measured not to pay on the random trace): the adaptive plan must finish by the
    deadline in this fraction of the futures drawn from the estimator's history (see
    :func:`~cachegen.stream.planner.choose_adaptive`, docs/streaming.md). ``recency_boost``: the
    adaptive plan gives the last chunk (the one next to the prompt's uncached rest) this many
    levels better than the others (:func:`~cachegen.stream.planner.with_recency_boost`) and is
    fetched first (:func:`~cachegen.stream.planner.fetch_order`); 0 = an even plan, in order.
    """

    def __init__(self, store, codec, recompute: Recompute, costs: CostModel | None = None, slo_s: float | None = 1.0,
                 link=None, policy: Union[str, int] = ADAPTIVE, estimator: ThroughputEstimator | None = None,
                 levels: Sequence[int] | None = None, prefetch: int = 8, reserve_s: float = 0.0,
                 safety: float = 0.95, dtype: torch.dtype | None = None, values_per_token: int | None = None,
                 clock: Callable[[], float] = time.perf_counter, risk_quantile: float | None = None,
                 recency_boost: int = RECENCY_BOOST):
        if prefetch < 1:
            raise ConfigError("prefetch must be >= 1")
        if risk_quantile is not None and not 0.0 < risk_quantile < 1.0:
            raise ConfigError("risk_quantile must be in (0, 1)")
        if not (policy in (ADAPTIVE, RULE, TEXT) or isinstance(policy, int)):
            raise ConfigError(f"unknown policy {policy!r}")
        self.store, self.codec, self.recompute = store, codec, recompute
        self.costs = costs or CostModel()
        self.slo_s = slo_s
        self.link = link or DirectLink()
        self.policy = policy
        self.estimator = estimator or ThroughputEstimator()
        self.levels = tuple(levels) if levels is not None else None
        self.prefetch = prefetch
        self.reserve_s = reserve_s
        self.safety = safety
        self.risk_quantile = risk_quantile
        self.recency_boost = max(0, int(recency_boost))
        self.dtype = dtype
        self.clock = clock
        self._values_per_token = values_per_token
        self._cpu_lock = threading.Lock()

    # -- helpers -------------------------------------------------------------
    def _plan_chunks(self, tokens, num_values_per_token: int | None) -> tuple[list, list[PlanChunk]]:
        infos = list(self.store.plan(tokens))
        last = max((i for i, inf in enumerate(infos) if inf.sizes), default=-1)
        infos = infos[: last + 1]
        vpt = num_values_per_token or self._values_per_token
        chunks = [PlanChunk(inf.ref.index, inf.ref.start, inf.ref.end - inf.ref.start,
                            (inf.ref.end - inf.ref.start) * (vpt or 0),
                            {l: s for l, s in inf.sizes.items() if self.levels is None or l in self.levels})
                  for inf in infos]
        chunks = with_recency_boost(chunks, self.recency_boost)
        return infos, chunks

    _values_per_token: int | None = None  # learnt from the first decoded chunk

    def _choose(self, remaining: list[PlanChunk], n_chunks: int, deadline: float, cpu_busy: float,
                prev: Choice | None = None) -> tuple[Choice, float]:
        e = self.estimator
        g, last = e.next_estimate(first_of_load=prev is None), e.last()
        share = max(self.slo_s - self.reserve_s, 0.0) / n_chunks if self.slo_s is not None else None
        choice = decide(self.policy, remaining, self.costs,
                        time_left_s=None if self.slo_s is None else deadline - self.clock(), cpu_busy_s=cpu_busy,
                        est_gbps=g, last_gbps=last, tail_gbps=e.tail_estimate(), known=e.known,
                        history_s_per_bit=e.s_per_bit_history() if self.risk_quantile else None,
                        risk_quantile=self.risk_quantile or RISK_QUANTILE, share_s=share,
                        prev=prev, allowed=self.levels, safety=self.safety)
        return choice, (last if self.policy == RULE else g)

    def _check(self, kv: KVCache, ref, like: KVCache | None) -> None:
        if kv.start != ref.start or kv.num_tokens != ref.end - ref.start:
            raise CorruptChunk(f"chunk {ref.index} decoded to tokens [{kv.start}, {kv.end}), "
                               f"expected [{ref.start}, {ref.end})")
        if like is not None and not like.same_layout(kv):
            raise CorruptChunk(f"chunk {ref.index} has a different layout from the chunks before it")

    # -- the load ------------------------------------------------------------
    def load(self, tokens: Sequence[int], slo_s: float | None = None, t0: float | None = None) -> LoadResult:
        """The KV of the longest cached prefix of ``tokens`` (``kv=None`` when nothing is cached)."""
        t0 = self.clock() if t0 is None else t0
        slo = self.slo_s if slo_s is None else slo_s
        saved_slo, self.slo_s = self.slo_s, slo
        try:
            return self._load(list(tokens), slo, t0)
        finally:
            self.slo_s = saved_slo

    def _load(self, tokens: list, slo: float | None, t0: float) -> LoadResult:
        faults: list[str] = []
        try:
            infos, chunks = self._plan_chunks(tokens, None)
        except FETCH_FAULTS as e:
            infos, chunks = [], []
            faults.append(f"plan: {type(e).__name__}: {e}")
        plan_s = self.clock() - t0
        res = LoadResult(None, 0, [], slo, plan_s=plan_s, faults=faults)
        if not chunks:
            res.load_s = self.clock() - t0
            return res
        # the stitch after the last decode is part of the load: keep its time back too
        itemsize = self.dtype.itemsize if self.dtype is not None else 2
        stitch = self.costs.stitch_s(sum(c.num_values for c in chunks), itemsize)
        deadline = t0 + (slo - self.reserve_s - stitch if slo is not None else float("inf"))
        n = len(chunks)
        decisions = [ChunkDecision(c.index, c.start, c.start + c.num_tokens, TEXT) for c in chunks]
        q: "queue.Queue" = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        # predicted compute work: (end of the item being processed, predicted costs of queued items)
        cpu = {"busy_until": t0, "queued": 0.0}
        self.link.begin()

        def cpu_busy() -> float:
            with self._cpu_lock:
                return max(cpu["busy_until"] - self.clock(), 0.0) + cpu["queued"]

        def predicted(i: int, choice: Choice) -> float:
            c = chunks[i]
            if choice == TEXT:
                return self.costs.recompute_s(c.start, c.num_tokens)
            return self.costs.decode_s(choice, c.num_values or 1)

        def put(item) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        # the last chunk first; second when the estimator is cold: the first fetch is then a probe at
        # the smallest level, which belongs on a chunk that matters little
        order, early = fetch_order(chunks, self.policy == ADAPTIVE, not self.estimator.known)

        def fetcher() -> None:
            try:
                deferred = None
                prev = None
                for k, i in enumerate(order):
                    if stop.is_set():
                        return
                    choice, est = self._choose([chunks[j] for j in order[k:]], n, deadline, cpu_busy(), prev)
                    prev = choice
                    d = decisions[i]
                    d.choice, d.est_gbps = choice, est
                    if choice == TEXT:
                        d.reason = "not stored" if not chunks[i].sizes else "planned"
                        with self._cpu_lock:
                            cpu["queued"] += predicted(i, choice)
                        if i == early:  # a recompute needs the chunks before it: do it last
                            deferred = ("text", i, None)
                        elif not put(("text", i, None)):
                            return
                        continue
                    ref = infos[i].ref
                    d.fetch_start = self.clock() - t0
                    try:
                        data = self.link.fetch(self.store.get, ref, choice)
                    except FETCH_FAULTS as e:
                        d.fetch_end = self.clock() - t0
                        put(("fault", i, f"chunk {i} level {choice}: {type(e).__name__}: {e}"))
                        if i == early:  # only that chunk is lost: recompute it last, fetch the rest
                            continue
                        return
                    d.fetch_end = self.clock() - t0
                    d.fetch_s = d.fetch_end - d.fetch_start
                    d.bytes = len(data)
                    d.measured_gbps = self.estimator.add(len(data), d.fetch_s)
                    with self._cpu_lock:
                        cpu["queued"] += predicted(i, choice)
                    if not put(("data", i, data)):
                        return
                if deferred is not None:
                    put(deferred)
            except BaseException as e:  # a bug must not hang the consumer
                put(("fault", -1, f"fetch thread: {type(e).__name__}: {e}"))

        th = threading.Thread(target=fetcher, name="cachegen-fetch", daemon=True)
        th.start()
        got: dict[int, KVCache] = {}
        fault_at: int | None = None
        redo_early = False
        try:
            for _ in range(n):
                kind, i, payload = q.get()
                if kind == "fault":
                    faults.append(payload)
                    if i == early and early is not None:
                        redo_early = True
                        continue
                    fault_at = min((j for j in range(n) if j not in got), default=n - 1) if i < 0 else i
                    break
                d = decisions[i]
                with self._cpu_lock:
                    cost = predicted(i, d.choice)
                    cpu["queued"] = max(cpu["queued"] - cost, 0.0)
                    cpu["busy_until"] = self.clock() + cost
                d.decode_start = self.clock() - t0
                ref = infos[i].ref
                try:
                    if kind == "text":
                        kv = self._recompute([got[j] for j in range(i)], tokens[ref.start:ref.end])
                    else:
                        kv = self.codec.decode(payload)
                    self._check(kv, ref, next(iter(got.values()), None))
                except (CachegenError, ValueError, RuntimeError) as e:
                    if kind == "text":
                        raise
                    d.decode_end = self.clock() - t0
                    d.decode_s = d.decode_end - d.decode_start
                    faults.append(f"chunk {i} level {d.choice}: {type(e).__name__}: {e}")
                    if i == early:
                        redo_early = True
                        continue
                    fault_at = i
                    break
                d.decode_end = self.clock() - t0
                d.decode_s = d.decode_end - d.decode_start
                if self._values_per_token is None and kv.num_tokens:
                    self._values_per_token = kv.num_values // kv.num_tokens
                got[i] = kv
        finally:
            stop.set()
            while True:  # unblock the fetcher
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            th.join(timeout=10)
        if fault_at is None and redo_early:
            fault_at = early
        parts = [got[j] for j in range(fault_at if fault_at is not None else n)]
        if fault_at is not None:
            a = chunks[fault_at].start
            b = chunks[-1].start + chunks[-1].num_tokens
            t = self.clock()
            kv = self._recompute(parts, tokens[a:b])
            dt = self.clock() - t
            if kv.start != a or kv.end != b:
                raise LoaderError(f"recompute returned tokens [{kv.start}, {kv.end}), expected [{a}, {b})")
            parts.append(kv)
            for k in range(fault_at, n):
                d = decisions[k]
                d.choice, d.bytes = TEXT, 0
                d.reason = "fault" if k == fault_at or (k == early and redo_early) else "after fault"
                d.decode_start, d.decode_end, d.decode_s = t - t0, t - t0 + dt, dt * chunks[k].num_tokens / (b - a)
        t = self.clock()
        full = self._stitch(parts)
        res.stitch_s = self.clock() - t
        res.kv = full
        res.cached_tokens = full.end
        res.decisions = decisions
        res.fetch_s = sum(d.fetch_s for d in decisions)
        res.decode_s = sum(d.decode_s for d in decisions if d.choice != TEXT)
        res.recompute_s = sum(d.decode_s for d in decisions if d.choice == TEXT)
        res.load_s = self.clock() - t0
        return res

    def _stitch(self, parts: list[KVCache]) -> KVCache:
        dtype = self.dtype or parts[0].dtype
        return KVCache.concat([p if p.dtype == dtype else p.to(dtype) for p in parts])

    def _recompute(self, parts: list[KVCache], token_ids: list) -> KVCache:
        prefix = self._stitch(parts) if parts else None
        kv = self.recompute(prefix, list(token_ids))
        start = prefix.end if prefix is not None else 0
        if kv.start != start or kv.num_tokens != len(token_ids):
            raise LoaderError(f"recompute returned tokens [{kv.start}, {kv.end}), expected [{start}, {start + len(token_ids)})")
        return kv
