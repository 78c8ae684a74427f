"""The streaming loader: fetch and decode a stored prefix into one cache before a deadline.

Two stages form a pipeline (scheduled by a :class:`~cachegen.stream.pipeline.Runner`:
threads in real time, events in virtual time). The *fetch* stage asks the store
for the plan, decides each chunk's level (or text) with the planner, fetches it
through the link and measures throughput; the *compute* stage decodes (the numba
decoder releases the GIL) or recomputes chunks in order, so chunk ``i + 1`` is on
the wire while chunk ``i`` decodes. Each chunk is decoded (or recomputed) straight into
its range of the load's cache, allocated once for the whole prefix, so nothing is joined
after the last decode. The stages exchange typed messages
(:class:`Planned`, :class:`Fetched`, :class:`TextChosen`, :class:`FetchFailed`, ...).

Faults: any exception from the plan, a fetch or a decode (a store timeout or
connection loss, a missing chunk, a corrupt or foreign payload, a decoded chunk
whose position or shape does not match the plan, ``MemoryError``, a bug), and a
store that does not answer by the deadline, stop the fetching; that chunk and every
later one are recomputed from text on top of the good prefix. A chunk that failed
is never part of the result. Every fault is logged (redacted) and listed in
:attr:`LoadResult.faults`.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import torch

from cachegen.errors import ConfigError, CorruptChunk, LoaderError
from cachegen.kv import ROOM_TOKENS, KVCache
from cachegen.store.url import redact
from cachegen.stream.compute_rates import ComputeRates, cpu_timed, decoder_families, thread_cpu_clock
from cachegen.stream.costs import TEXT, CostModel
from cachegen.stream.estimator import ThroughputEstimator
from cachegen.stream.link import DirectLink
from cachegen.stream.pipeline import (
    Call,
    Op,
    ProducerEnded,
    Receive,
    Runner,
    Send,
    Stage,
    StopProducer,
    ThreadedRunner,
)
from cachegen.stream.planner import (
    FASTEST,
    RECENCY_BOOST,
    RISK_QUANTILE,
    Choice,
    PlanChunk,
    decide,
    decide_fastest,
    fetch_order,
    with_recency_boost,
)
from cachegen.stream.protocols import ChunkSource, Clock, Link, Recompute

if TYPE_CHECKING:
    from cachegen.codec import ChunkCodec
    from cachegen.store import ChunkInfo, ChunkRef

log = logging.getLogger(__name__)

ADAPTIVE = "adaptive"
RULE = "rule"
Policy = str | int  # ADAPTIVE, RULE, FASTEST, TEXT, or a fixed level

MIN_STORE_TIMEOUT_S = 0.001  # a store call is never given less (a timeout <= 0 is not a timeout)
# a format kept without deciding again (LoaderOptions.steady_chunks) is dropped once an estimate of
# the link has moved by more than this fraction since the decision
STEADY_TOLERANCE = 0.25


@dataclass(frozen=True)
class LoaderOptions:
    """How a :class:`StreamingLoader` plans.

    ``policy``: ``"adaptive"``, ``"rule"`` (CacheGen's equal-share rule), ``"fastest"``
    (each chunk's option that ends the load soonest, whatever its quality: minimal time to
    first token; :func:`~cachegen.stream.planner.choose_fastest`), a fixed level (chunks not
    stored at it are recomputed), or ``"text"``. ``slo_s``: the load's deadline (None: none;
    the adaptive and rule policies then take every chunk at its best level). ``reserve_s``: time kept back from the
    deadline for what follows the load (the suffix prefill). ``levels``: the levels it may
    use (None: every stored one). ``prefetch``: fetched payloads that may wait for the
    compute stage; a deep queue lets fast fetches run ahead so that a later slow one is
    hidden behind decoding (8 chunks of 256 tokens at the best level are ~20 MB for
    SmolLM2). ``safety``: the plan must end within this fraction of the time left.
    ``risk_quantile`` (off by default: measured not to pay on the random trace): the
    adaptive plan must finish by the deadline in this fraction of the futures drawn from
    the estimator's history (:func:`~cachegen.stream.planner.choose_adaptive`).
    ``recency_boost``: the adaptive plan gives the last chunk (next to the prompt's
    uncached rest) this many levels better than the others and fetches it first
    (:func:`~cachegen.stream.planner.with_recency_boost`); 0 = an even plan, in order.
    ``dtype``: of the load's cache (None: the first chunk's). ``values_per_token``: K
    and V values per token over all layers, for the decode-cost model (None: the plan
    counts only the fixed part of each decode). ``steady_chunks``: when the fastest policy
    finds that keeping its choice for every remaining chunk is the best plan it predicts
    (:attr:`~cachegen.stream.planner.Prediction.steady`), the next this many chunks take it
    without a decision, while the link's estimates stay within :data:`STEADY_TOLERANCE` of those
    it was made with (0: decide every chunk). Why: a decision is Python on the fetch thread, and
    the GIL it holds slows the decode beside it (at 10 Gbit/s an 8-bit chunk decoded in 5-6 ms
    beside the fetches of the ``adaptive`` method against 4 ms beside those of 8-bit KV alone)."""

    policy: Policy = ADAPTIVE
    slo_s: float | None = 1.0
    reserve_s: float = 0.0
    levels: tuple[int, ...] | None = None
    prefetch: int = 8
    safety: float = 0.95
    risk_quantile: float | None = None
    recency_boost: int = RECENCY_BOOST
    dtype: torch.dtype | None = None
    values_per_token: int | None = None
    steady_chunks: int = 3

    def __post_init__(self) -> None:
        if not (self.policy in (ADAPTIVE, RULE, FASTEST, TEXT) or (isinstance(self.policy, int) and self.policy >= 0)):
            raise ConfigError(f"unknown policy {self.policy!r}: use adaptive, rule, fastest, text or a level")
        if self.slo_s is not None and not self.slo_s > 0:
            raise ConfigError(f"slo_s must be positive (or None for no deadline), not {self.slo_s}")
        if self.reserve_s < 0:
            raise ConfigError("reserve_s must be >= 0")
        if self.prefetch < 1:
            raise ConfigError("prefetch must be >= 1")
        if not 0.0 < self.safety <= 1.0:
            raise ConfigError("safety must be in (0, 1]")
        if self.risk_quantile is not None and not 0.0 < self.risk_quantile < 1.0:
            raise ConfigError("risk_quantile must be in (0, 1)")
        if self.recency_boost < 0:
            raise ConfigError("recency_boost must be >= 0")
        if self.steady_chunks < 0:
            raise ConfigError("steady_chunks must be >= 0")
        if self.levels is not None:
            object.__setattr__(self, "levels", tuple(int(l) for l in self.levels))


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
    measured_gbps: float | None = None  # bytes over the fetch's time less the cost model's latency
    fetch_start: float | None = None
    fetch_end: float | None = None
    decode_start: float | None = None
    decode_end: float | None = None
    reason: str = ""  # why text: "planned", "not stored", "fault" or "after fault"
    kept: bool = False  # the last decision's steady choice, taken without deciding (steady_chunks)

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class LoadResult:
    kv: KVCache | None  # the KV of tokens [0, cached_tokens), or None
    cached_tokens: int
    decisions: list[ChunkDecision]
    slo_s: float | None
    plan_s: float = 0.0  # store.plan round trip
    load_s: float = 0.0  # from load() call to the whole KV (what TTFT adds before the suffix prefill)
    fetch_s: float = 0.0  # sum over chunks
    decode_s: float = 0.0
    recompute_s: float = 0.0
    stitch_s: float = 0.0  # after the last decode: 0 (chunks are decoded into the load's cache)
    faults: list[str] = field(default_factory=list)

    @property
    def missed(self) -> bool:
        return self.slo_s is not None and self.load_s > self.slo_s

    @property
    def choices(self) -> list[Choice]:
        return [d.choice for d in self.decisions]

    def summary(self) -> str:
        per = " ".join(f"{d.index}:{'T' if d.choice == TEXT else f'L{d.choice}'}" for d in self.decisions)
        return (
            f"{self.cached_tokens} tokens in {self.load_s:.3f}s (slo {self.slo_s}) "
            f"fetch {self.fetch_s:.3f}s decode {self.decode_s:.3f}s recompute {self.recompute_s:.3f}s "
            f"faults {len(self.faults)} | {per}"
        )

    def to_json(self) -> dict:
        return {
            "cached_tokens": self.cached_tokens,
            "slo_s": self.slo_s,
            "load_s": self.load_s,
            "plan_s": self.plan_s,
            "fetch_s": self.fetch_s,
            "decode_s": self.decode_s,
            "recompute_s": self.recompute_s,
            "stitch_s": self.stitch_s,
            "faults": list(self.faults),
            "missed": self.missed,
            "decisions": [d.to_json() for d in self.decisions],
        }


# -- the messages between the stages ---------------------------------------------------


@dataclass(frozen=True)
class LoadPlan:
    """The store's answer, as both stages use it: chunks in order, the fetch order, deadlines."""

    infos: list[ChunkInfo]
    chunks: list[PlanChunk]
    order: list[int]  # positions in fetch order
    early: int | None  # the position fetched out of order (the last chunk), or None
    deadline: float  # clock time by which the last decode must end


@dataclass(frozen=True)
class Planned:
    plan: LoadPlan


@dataclass(frozen=True)
class PlanFailed:
    fault: str
    error: Exception | None = None  # a ConfigError (a user's mistake, e.g. a chunk size mismatch) is raised


@dataclass(frozen=True)
class Fetched:
    pos: int
    level: int
    est_gbps: float
    fetch_start: float
    fetch_end: float
    data: bytes
    measured_gbps: float | None
    kept: bool = False


@dataclass(frozen=True)
class TextChosen:
    pos: int
    est_gbps: float
    reason: str  # "planned" or "not stored"


@dataclass
class _Steady:
    """A fastest decision that keeping its choice for the rest is nearly the best plan: the
    choice, the estimates and cost model it was made with, and the chunks that took it since."""

    choice: Choice
    est_gbps: float
    tail_gbps: float
    costs: CostModel
    kept: int = 0


@dataclass(frozen=True)
class FetchFailed:
    pos: int
    level: int
    est_gbps: float
    fetch_start: float
    fetch_end: float
    fault: str
    kept: bool = False


def transfer_s(fetch_s: float, latency_s: float) -> float:
    """The part of a fetch that moved bytes, for the estimator: the fetch less the cost model's
    per-request latency, as the planner prices a fetch (latency + bytes / rate). A small chunk's
    fetch is mostly latency; counted as transfer, it made a fast link look slow after small
    chunks. At most half the fetch is taken off, so a latency the model overstates can at most
    double a sample (an overstated rate sends big formats over a slow link)."""
    return max(fetch_s - max(latency_s, 0.0), fetch_s / 2)


def _describe(where: str, e: BaseException) -> str:
    return redact(f"{where}: {type(e).__name__}: {e}")


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes keyword ``name`` (collaborators that predate a keyword still work)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class _CpuBook:
    """Compute work the planner counts as committed: the item in progress (until its predicted
    end) plus the predicted cost of queued items. Written by both stages."""

    def __init__(self, clock: Clock, t0: float):
        self.clock = clock
        self._busy_until = t0
        self._queued = 0.0
        self._lock = threading.Lock()

    def busy(self) -> float:
        with self._lock:
            return max(self._busy_until - self.clock(), 0.0) + self._queued

    def queued(self, cost: float) -> None:
        with self._lock:
            self._queued += cost

    def started(self, cost: float) -> None:
        with self._lock:
            self._queued = max(self._queued - cost, 0.0)
            self._busy_until = self.clock() + cost


class StreamingLoader:
    """Load the cached prefix of a prompt from ``store`` before a deadline.

    Collaborators: ``store`` (:class:`~cachegen.stream.protocols.ChunkSource`), ``codec``
    (decodes chunks: ``cachegen.codec.ChunkCodec``), ``recompute`` (the model:
    ``recompute(prefix, token_ids) -> KVCache``), ``costs`` (the planner's cost model),
    ``link`` (how bytes cross the network; default: direct), ``estimator`` (pass the same
    one to every load over a link: the next load starts from what the last one measured;
    a fresh one without a prior makes the first chunk a probe at the smallest level),
    ``rates`` (the measured speed of decodes and recomputes against ``costs``: pass the same
    one to every load on a machine; the ``fastest`` policy plans with ``costs`` corrected by
    it, :class:`~cachegen.stream.compute_rates.ComputeRates`), ``clock`` and ``runner``
    (real time and threads by default; the replay passes a
    :class:`~cachegen.stream.pipeline.VirtualClock` and a
    :class:`~cachegen.stream.pipeline.VirtualRunner`). ``options``: :class:`LoaderOptions`.
    A loader holds no per-load state: :meth:`load` may be called again, or from several
    threads (they share the estimator and the link)."""

    def __init__(
        self,
        store: ChunkSource,
        codec: ChunkCodec,
        recompute: Recompute,
        options: LoaderOptions | None = None,
        *,
        costs: CostModel | None = None,
        link: Link | None = None,
        estimator: ThroughputEstimator | None = None,
        rates: ComputeRates | None = None,
        clock: Clock = time.perf_counter,
        runner: Runner | None = None,
    ):
        self.store, self.codec, self.recompute = store, codec, recompute
        self.options = options or LoaderOptions()
        self.costs = costs or CostModel()
        self.link: Link = link or DirectLink()
        self.estimator = estimator or ThroughputEstimator()
        self.rates = rates or ComputeRates()
        self.clock = clock
        self.runner: Runner = runner or ThreadedRunner(clock)
        self._plan_timeout = _accepts(store.plan, "timeout")
        self._get_timeout = _accepts(store.get, "timeout")
        self._decode_key = _accepts(codec.decode, "key")
        self._decode_into = callable(getattr(codec, "decode_into", None))  # a DecodesInto
        self.decodes_many = callable(getattr(codec, "decode_many_into", None))  # a DecodesManyInto
        self._reads_layout = self._decode_into and callable(getattr(codec, "layout", None))  # a ReadsLayout
        self.families = decoder_families(codec)  # the levels that share a decoder learn one speed

    def load(self, tokens: Sequence[int], *, slo_s: float | None = None, t0: float | None = None) -> LoadResult:
        """The KV of the longest cached prefix of ``tokens`` (``kv=None`` when nothing is cached).

        ``slo_s``: this load's deadline instead of the options' (the loader is not changed);
        ``t0``: when the request began, if before this call (the deadline counts from it)."""
        slo = self.options.slo_s if slo_s is None else slo_s
        if slo is not None and not slo > 0:
            raise ConfigError(f"slo_s must be positive, not {slo}")
        run = _Load(self, list(tokens), slo, self.clock() if t0 is None else t0)
        return self.runner.run(run.fetch_stage(), run.compute_stage(), self.options.prefetch)

    # -- store calls (each bounded by the time left) -------------------------------------
    def _store_timeout(self, until: float) -> float | None:
        if math.isinf(until):
            return None
        return max(until - self.clock(), MIN_STORE_TIMEOUT_S)

    def plan_infos(self, tokens: Sequence[int], until: float = math.inf) -> list[ChunkInfo]:
        if self._plan_timeout:
            return list(self.store.plan(tokens, timeout=self._store_timeout(until)))
        return list(self.store.plan(tokens))

    def get(self, ref: ChunkRef, level: int, until: float = math.inf) -> bytes:
        if self._get_timeout:
            return self.store.get(ref, level, timeout=self._store_timeout(until))
        return self.store.get(ref, level)

    def layout(self, data: bytes) -> KVCache | None:
        """The layout of a fetched chunk from its header (the codec's ``layout``: a
        :class:`~cachegen.codec.protocol.ReadsLayout` that also decodes into a cache), to allocate
        the load's cache before decoding the chunk into it. None, and the chunk is decoded first,
        when the codec cannot tell, or when the header does not give the model's values per token
        (``LoaderOptions.values_per_token``; unknown: None), so a header never sizes the
        allocation alone. A header the codec refuses raises CorruptChunk; one of another range
        is refused by the decode into the range it was fetched for."""
        vpt = self.options.values_per_token
        if not self._reads_layout or vpt is None:
            return None
        like: KVCache | None = self.codec.layout(data)  # type: ignore[attr-defined]  # checked in __init__
        if like is None or sum(l.k.shape[0] * (l.k.shape[2] + l.v.shape[2]) for l in like.layers) != vpt:
            return None
        return like

    def decode(self, data: bytes, ref: ChunkRef, like: KVCache | None) -> KVCache:
        """Decode a chunk fetched for ``ref`` and check it is that chunk (a mismatch is :class:`CorruptChunk`)."""
        kv = self.codec.decode(data, key=ref.key) if self._decode_key else self.codec.decode(data)
        if kv.start != ref.start or kv.num_tokens != ref.end - ref.start:
            raise CorruptChunk(
                f"chunk {ref.index} decoded to tokens [{kv.start}, {kv.end}), expected [{ref.start}, {ref.end})"
            )
        if like is not None and not like.same_layout(kv):
            raise CorruptChunk(f"chunk {ref.index} has a different layout from the chunks before it")
        return kv

    def decode_into(self, data: bytes, ref: ChunkRef, slot: KVCache) -> None:
        """Decode a chunk fetched for ``ref`` into ``slot``, its range of the load's cache: with the
        codec's own ``decode_into`` (:class:`~cachegen.codec.protocol.DecodesInto`: no chunk-sized
        cache is built), else :meth:`decode` and a copy. A mismatch is :class:`CorruptChunk`; a
        failure may leave ``slot`` partly written (the load then recomputes it)."""
        if self._decode_into:
            if slot.start != ref.start or slot.num_tokens != ref.end - ref.start:
                raise LoaderError(f"chunk {ref.index}: slot [{slot.start}, {slot.end}) is not its range")
            self.codec.decode_into(data, slot, key=ref.key)  # type: ignore[attr-defined]  # checked in __init__
            return
        slot.write(self.decode(data, ref, slot))

    def decode_many_into(self, datas: Sequence[bytes], refs: Sequence[ChunkRef], slot: KVCache) -> None:
        """Decode consecutive chunks fetched for ``refs`` into ``slot``, their ranges of the load's
        cache, in one call of the codec's ``decode_many_into``
        (:class:`~cachegen.codec.protocol.DecodesManyInto`; the load batches chunks only for such a
        codec). A failure may leave ``slot`` partly written, and does not say which chunk failed:
        the load decodes them one by one to find out."""
        if not self.decodes_many:
            raise LoaderError("the codec decodes one chunk at a time (no decode_many_into)")
        if not refs or slot.start != refs[0].start or slot.end != refs[-1].end:
            raise LoaderError(f"slot [{slot.start}, {slot.end}) is not the range of chunks {[r.index for r in refs]}")
        if any(b.start != a.end for a, b in pairwise(refs)):
            raise LoaderError(f"chunks {[r.index for r in refs]} are not consecutive")
        sizes, keys = [r.end - r.start for r in refs], [r.key for r in refs]
        self.codec.decode_many_into(datas, slot, sizes, keys=keys)  # type: ignore[attr-defined]  # checked in __init__

    def recompute_after(self, prefix: KVCache | None, token_ids: list[int]) -> KVCache:
        """The KV of ``token_ids`` after ``prefix`` (from text)."""
        kv = self.recompute(prefix, list(token_ids))
        start = prefix.end if prefix is not None else 0
        if kv.start != start or kv.num_tokens != len(token_ids):
            raise LoaderError(
                f"recompute returned tokens [{kv.start}, {kv.end}), expected [{start}, {start + len(token_ids)})"
            )
        return kv


class _Cache:
    """The load's KV cache: allocated once for every planned token, when the first chunk is placed
    (its layout; ``dtype``, else its dtype); each chunk's decode or recompute writes its range.

    Why: joining the decoded chunks at the end was a copy of the whole context after the last
    decode (time the plan had to keep back from the deadline) and twice its memory at the peak.
    Its full-attention layers have :data:`~cachegen.kv.ROOM_TOKENS` of room after the prefix, which
    the decoding session that takes the result appends into (:meth:`KVCache.take_room`): its first
    step then copies nothing, where it used to copy the whole cache."""

    def __init__(self, num_tokens: int, dtype: torch.dtype | None):
        self.num_tokens, self.dtype = num_tokens, dtype
        self.kv: KVCache | None = None

    def place(self, part: KVCache) -> None:
        if self.kv is None:
            self.kv = KVCache.allocate(part, self.num_tokens, dtype=self.dtype or part.dtype, room_tokens=ROOM_TOKENS)
        self.kv.write(part)

    def prefix(self, end: int) -> KVCache | None:
        """Tokens ``[0, end)`` of the cache (a view), None when ``end`` is 0."""
        if end == 0:
            return None
        if self.kv is None:
            raise LoaderError(f"no chunk before token {end} is in the cache")
        return self.kv.slice(0, end)

    def decode(self, loader: StreamingLoader, data: bytes, ref: ChunkRef) -> None:
        """Decode a chunk into its range. The first one allocates the cache: from its header where
        the loader reads it (:meth:`StreamingLoader.layout`), then decodes into it as every later
        chunk does; else from its decoded values, then copied (a first 8-bit chunk of SmolLM2 took
        10-19 ms that way, against 3-7 ms decoded into the cache)."""
        if self.kv is not None:
            loader.decode_into(data, ref, self.kv.slice(ref.start, ref.end))
            return
        like = loader.layout(data)
        if like is None:
            self.place(loader.decode(data, ref, None))
            return
        kv = KVCache.allocate(like, self.num_tokens, dtype=self.dtype or like.dtype, room_tokens=ROOM_TOKENS)
        loader.decode_into(data, ref, kv.slice(ref.start, ref.end))
        self.kv = kv  # once the chunk decoded: a chunk that fails leaves no cache of its layout

    def decode_many(self, loader: StreamingLoader, datas: list[bytes], refs: list[ChunkRef]) -> None:
        """Decode consecutive chunks into their ranges (the cache is allocated already)."""
        if self.kv is None:
            raise LoaderError("a batch of chunks is decoded only after the first chunk")
        loader.decode_many_into(datas, refs, self.kv.slice(refs[0].start, refs[-1].end))


class _Load:
    """One call of :meth:`StreamingLoader.load`: its deadlines, its compute book and its two stages."""

    def __init__(self, loader: StreamingLoader, tokens: list[int], slo: float | None, t0: float):
        self.l, self.o = loader, loader.options
        self.tokens, self.slo, self.t0 = tokens, slo, t0
        # the load must end by ``limit``; no store call is waited for past it
        self.limit = t0 + (slo - self.o.reserve_s) if slo is not None else math.inf
        self.cpu = _CpuBook(loader.clock, t0)
        self.booked: dict[int, float] = {}  # per position: the compute seconds booked when it was queued
        # the fetch thread's CPU clock (set by the fetch stage when it runs in a thread of its own)
        self.fetch_cpu: Callable[[], float | None] | None = None
        self.consumer = threading.current_thread()  # the compute stage runs in the caller's thread

    def now(self) -> float:
        return self.l.clock() - self.t0

    # -- planning ----------------------------------------------------------------------
    def make_plan(self, infos: list[ChunkInfo]) -> LoadPlan:
        last = max((i for i, inf in enumerate(infos) if inf.sizes), default=-1)
        infos = infos[: last + 1]
        vpt, allowed = self.o.values_per_token or 0, self.o.levels
        chunks = [
            PlanChunk(
                inf.ref.index,
                inf.ref.start,
                inf.ref.end - inf.ref.start,
                (inf.ref.end - inf.ref.start) * vpt,
                {l: s for l, s in inf.sizes.items() if allowed is None or l in allowed},
            )
            for inf in infos
        ]
        chunks = with_recency_boost(chunks, self.o.recency_boost)
        # the last chunk first; second when the estimator is cold: the first fetch is then a probe
        # at the smallest level, which belongs on a chunk that matters little
        order, early = fetch_order(chunks, self.o.policy == ADAPTIVE, not self.l.estimator.known)
        # Chunks are decoded into the load's cache, so nothing is left after the last decode; the
        # plan still keeps the old join's time back (``CostModel.stitch_s``) because the replay
        # (bench/replay.py) still adds it to every load: drop both together.
        itemsize = self.o.dtype.itemsize if self.o.dtype is not None else 2
        stitch = self.l.costs.stitch_s(sum(c.num_values for c in chunks), itemsize)
        return LoadPlan(infos, chunks, order, early, self.limit - stitch)

    def plan_costs(self) -> CostModel:
        """The cost model for the next decision: the fastest policy's is corrected by what this
        machine's decodes (one factor per decoder family of the codec) and recomputes measured and takes the per-request latency this link's
        fetches measure (:meth:`ThroughputEstimator.latency`); a deadline policy keeps the
        calibrated one, whose headroom a median correction would spend."""
        if self.o.policy != FASTEST:
            return self.l.costs
        costs = self.l.rates.corrected(self.l.costs, self.l.families)
        latency = self.l.estimator.latency(costs.fetch_latency_s)  # as this link's fetches measure it
        return costs if latency == costs.fetch_latency_s else replace(costs, fetch_latency_s=latency)

    @staticmethod
    def predicted(costs: CostModel, chunk: PlanChunk, choice: Choice, batched: bool = False) -> float:
        if choice == TEXT:
            return costs.recompute_s(chunk.start, chunk.num_tokens)
        return costs.decode_s(int(choice), chunk.num_values or 1, batched)

    def book(self, pos: int, chunk: PlanChunk, choice: Choice, costs: CostModel, joins: bool = False) -> None:
        """Count chunk ``pos``'s predicted compute as committed (queued for the compute stage). A
        fetched chunk that finds compute still committed waits; after one of its level (``joins``)
        it is decoded in one call with it where the codec can: its batched cost (the planner's
        model, :func:`~cachegen.stream.planner.simulate`)."""
        batched = joins and self.l.decodes_many and self.cpu.busy() > 0
        self.booked[pos] = self.predicted(costs, chunk, choice, batched)
        self.cpu.queued(self.booked[pos])

    def start(self, pos: int) -> None:
        """Chunk ``pos``'s compute begins: what was booked for it is now in progress (the fetch
        stage books every chunk before it sends it)."""
        self.cpu.started(self.booked.pop(pos))

    def measured(self, chunk: PlanChunk, choice: Choice, seconds: float, stolen: float = 0.0) -> None:
        """Teach the loader's rates one chunk's compute time (decoded alone, or recomputed) against
        the uncorrected model, with ``stolen``, the CPU the fetches took while it ran (the rates
        take out what the planner charges to the fetches, :meth:`ComputeRates.observe`)."""
        self.l.rates.observe(choice, self.predicted(self.l.costs, chunk, choice), seconds, stolen)

    def fetch_cpu_now(self) -> float | None:
        """The fetch thread's CPU seconds so far; None when it cannot be read from here (no clock,
        the fetch stage runs in this thread, or it has ended)."""
        return self.fetch_cpu() if self.fetch_cpu is not None else None

    def stolen_since(self, mark: float | None) -> float:
        """The fetch thread's CPU seconds since ``mark`` (a :meth:`fetch_cpu_now`); 0 when unknown."""
        now = self.fetch_cpu_now()
        return max(now - mark, 0.0) if now is not None and mark is not None else 0.0

    def choose(
        self, plan: LoadPlan, k: int, prev: Choice | None, costs: CostModel
    ) -> tuple[Choice, float, _Steady | None]:
        """The choice for the ``k``-th chunk in fetch order by ``costs``, the estimate it was made
        with, and, when the fastest policy finds it steady, what the next chunks may keep."""
        e, o = self.l.estimator, self.o
        g, last = e.next_estimate(first_of_load=prev is None), e.last()
        if o.policy == FASTEST:
            remaining = [plan.chunks[j] for j in plan.order[k:]]
            tail = e.tail_estimate()
            choice, steady = decide_fastest(
                remaining,
                costs,
                time_left_s=None if self.slo is None else plan.deadline - self.l.clock(),
                cpu_busy_s=self.cpu.busy(),
                est_gbps=g,
                tail_gbps=tail,
                known=e.known,
                prev=prev,
                allowed=o.levels,
            )
            keep = _Steady(choice, g, tail, costs) if steady and o.steady_chunks else None
            return choice, g, keep
        n = len(plan.chunks)
        share = max(self.slo - o.reserve_s, 0.0) / n if self.slo is not None else None
        choice = decide(
            o.policy,
            [plan.chunks[j] for j in plan.order[k:]],
            costs,
            time_left_s=None if self.slo is None else plan.deadline - self.l.clock(),
            cpu_busy_s=self.cpu.busy(),
            est_gbps=g,
            last_gbps=last,
            tail_gbps=e.tail_estimate(),
            known=e.known,
            history_s_per_bit=e.s_per_bit_history() if o.risk_quantile else None,
            risk_quantile=o.risk_quantile or RISK_QUANTILE,
            share_s=share,
            prev=prev,
            allowed=o.levels,
            safety=o.safety,
        )
        return choice, (last if o.policy == RULE else g), None

    def keeps(self, steady: _Steady | None, chunk: PlanChunk) -> bool:
        """Whether ``chunk`` takes the steady choice without a decision: fewer than
        ``steady_chunks`` took it since, the chunk is stored at it, and the link's estimates are
        within :data:`STEADY_TOLERANCE` of those it was made with."""
        if steady is None or steady.kept >= self.o.steady_chunks or steady.choice not in chunk.sizes:
            return False
        e = self.l.estimator
        return all(
            abs(now - then) <= STEADY_TOLERANCE * then
            for now, then in (
                (e.next_estimate(first_of_load=False), steady.est_gbps),
                (e.tail_estimate(), steady.tail_gbps),
            )
        )

    # -- the fetch stage ---------------------------------------------------------------
    def fetch_stage(self) -> Stage[None]:
        try:
            infos = yield Call(partial(self.l.plan_infos, self.tokens, self.limit))
            plan = self.make_plan(infos)
        except Exception as e:  # any failure of the plan: nothing is loaded, the caller prefills
            yield Send(PlanFailed(_describe("plan", e), e))
            return
        yield Send(Planned(plan))
        if not plan.chunks:
            return
        # in a thread of its own (not replayed in virtual time), the fetches' CPU is the decodes' loss
        threaded = threading.current_thread() is not self.consumer
        if threaded:
            self.fetch_cpu = thread_cpu_clock()
        self.l.link.begin()
        deferred: TextChosen | None = None
        prev: Choice | None = None
        steady: _Steady | None = None
        for k, pos in enumerate(plan.order):
            chunk = plan.chunks[pos]
            kept = self.keeps(steady, chunk)
            if steady is not None and kept:
                steady.kept += 1
                choice, est, costs = steady.choice, steady.est_gbps, steady.costs
            else:
                costs = self.plan_costs()
                choice, est, steady = self.choose(plan, k, prev, costs)
            before, prev = prev, choice
            if choice == TEXT:
                self.book(pos, chunk, TEXT, costs)
                msg = TextChosen(pos, est, "not stored" if not chunk.sizes else "planned")
                if pos == plan.early:  # a recompute needs the chunks before it: do it last
                    deferred = msg
                else:
                    yield Send(msg)
                continue
            level = int(choice)
            ref = plan.infos[pos].ref
            start = self.now()
            try:
                fetch = partial(self.l.link.fetch, partial(self.l.get, until=self.limit), ref, level)
                data, cpu_s = yield Call(partial(cpu_timed, fetch))
                nbytes = len(data)
            except Exception as e:  # every fetch failure is a fault: the chunk is recomputed
                self.trace(e)
                yield Send(
                    FetchFailed(pos, level, est, start, self.now(), _describe(f"chunk {pos} level {level}", e), kept)
                )
                if pos == plan.early:  # only that chunk is lost: recompute it last, fetch the rest
                    continue
                return
            end = self.now()
            self.l.estimator.record_fetch(nbytes, end - start)
            if threaded:
                self.l.rates.observe_fetch(nbytes, cpu_s)
            measured = self.l.estimator.add(nbytes, transfer_s(end - start, costs.fetch_latency_s))
            self.book(pos, chunk, level, costs, joins=before == level)
            yield Send(Fetched(pos, level, est, start, end, data, measured, kept))
        if deferred is not None:
            yield Send(deferred)

    # -- the compute stage -------------------------------------------------------------
    def compute_stage(self) -> Stage[LoadResult]:
        res = LoadResult(None, 0, [], self.slo)
        msg = yield Receive(self.limit)
        res.plan_s = self.now()
        if isinstance(msg, PlanFailed) and isinstance(msg.error, ConfigError):
            raise msg.error  # not a store fault: the user must hear of it
        if not isinstance(msg, Planned):
            self.fault(res, self.no_message(msg, "plan"))
            res.load_s = self.now()
            return res
        plan = msg.plan
        chunks, n = plan.chunks, len(plan.chunks)
        if not n:
            res.load_s = self.now()
            return res
        decisions = [ChunkDecision(c.index, c.start, c.start + c.num_tokens, TEXT) for c in chunks]
        res.decisions = decisions
        cache = _Cache(chunks[-1].start + chunks[-1].num_tokens, self.o.dtype)
        got: set[int] = set()  # positions whose range of the cache holds their KV
        failed: set[int] = set()
        pending: deque[object] = deque()  # messages taken from the queue ahead of their turn
        handled = 0
        while handled < n:
            msg = pending.popleft() if pending else (yield Receive(self.limit))
            handled += 1
            if isinstance(msg, (Fetched, FetchFailed, TextChosen)):
                d = decisions[msg.pos]
                d.est_gbps = msg.est_gbps
            if isinstance(msg, TextChosen):
                d.choice, d.reason = TEXT, msg.reason
                self.start(msg.pos)
                d.decode_start = self.now()
                mark = self.fetch_cpu_now()
                ref = plan.infos[msg.pos].ref
                if any(j not in got for j in range(msg.pos)):  # text comes in order, the early chunk last
                    raise LoaderError(f"chunk {msg.pos} is to be recomputed before the chunks ahead of it")
                kv = yield Call(
                    partial(self.l.recompute_after, cache.prefix(ref.start), self.tokens[ref.start : ref.end])
                )
                cache.place(kv)
                got.add(msg.pos)
                d.decode_end = self.now()
                d.decode_s = d.decode_end - d.decode_start
                self.measured(chunks[msg.pos], TEXT, d.decode_s, stolen=self.stolen_since(mark))
                continue
            if isinstance(msg, Fetched):
                batch = [msg]
                if cache.kv is not None and self.l.decodes_many:
                    # fetches that ran ahead and wait in the queue: the consecutive ones of this level
                    # decode together (the planner counts on that, and each call times one format)
                    for _ in range(n - handled - len(pending)):
                        waiting = yield Receive(self.l.clock())
                        if waiting is None:
                            break
                        pending.append(waiting)
                    while (
                        pending
                        and isinstance(pending[0], Fetched)
                        and pending[0].pos == batch[-1].pos + 1
                        and pending[0].level == msg.level
                    ):
                        batch.append(pending.popleft())  # type: ignore[arg-type]  # checked just above
                    handled += len(batch) - 1
                if len(batch) > 1:
                    done = yield from self.decode_batch(batch, plan, decisions, cache, got)
                    if done:
                        continue
                go_on = True
                for m in batch:  # one by one: a single chunk, or a batch that failed (which chunk?)
                    go_on = yield from self.decode_fetched(m, plan, decisions, cache, got, failed, res, len(batch) > 1)
                    if not go_on:
                        break
                if go_on:
                    continue
                break
            if isinstance(msg, FetchFailed):
                d.choice, d.kept = msg.level, msg.kept
                d.fetch_start, d.fetch_end = msg.fetch_start, msg.fetch_end
                failed.add(msg.pos)
                self.fault(res, msg.fault)
                if msg.pos == plan.early:
                    continue
                break
            # no message by the deadline (a stalled store), or the fetch stage ended early
            missing = min(j for j in range(n) if j not in got)
            failed.add(missing)
            self.fault(res, self.no_message(msg, f"chunk {missing}"))
            break
        yield StopProducer()  # nothing fetched or decoded after a fault
        fault_at = min((j for j in range(n) if j not in got), default=None)
        if fault_at is not None:  # every range from it on is rewritten: a failed chunk's partial write is never used
            a, b = chunks[fault_at].start, chunks[-1].start + chunks[-1].num_tokens
            t = self.now()
            rest = yield Call(partial(self.l.recompute_after, cache.prefix(a), self.tokens[a:b]))
            cache.place(rest)
            dt = self.now() - t
            for k in range(fault_at, n):
                d = decisions[k]
                d.choice, d.bytes = TEXT, 0
                d.reason = "fault" if k in failed else "after fault"
                d.decode_start, d.decode_end, d.decode_s = t, t + dt, dt * chunks[k].num_tokens / (b - a)
        res.kv = cache.kv
        res.cached_tokens = res.kv.end if res.kv is not None else 0
        res.fetch_s = sum(d.fetch_s for d in decisions)
        res.decode_s = sum(d.decode_s for d in decisions if d.choice != TEXT)
        res.recompute_s = sum(d.decode_s for d in decisions if d.choice == TEXT)
        res.load_s = self.now()
        return res

    def record_fetch(self, d: ChunkDecision, msg: Fetched) -> None:
        d.est_gbps, d.kept = msg.est_gbps, msg.kept
        d.choice, d.bytes, d.measured_gbps = msg.level, len(msg.data), msg.measured_gbps
        d.fetch_start, d.fetch_end, d.fetch_s = msg.fetch_start, msg.fetch_end, msg.fetch_end - msg.fetch_start

    def decode_batch(
        self, batch: list[Fetched], plan: LoadPlan, decisions: list[ChunkDecision], cache: _Cache, got: set[int]
    ) -> Generator[Op, Any, bool]:
        """Decode consecutive fetched chunks in one call (:meth:`StreamingLoader.decode_many_into`):
        True when they are all in the cache. Each chunk's decode time is the batch's, shared by
        tokens. On a failure nothing is recorded (the chunks' compute is started): the caller
        decodes them one by one, which finds the chunk at fault and rewrites each range.

        The rates learn the call against the pipeline model's price for it: the first chunk alone,
        the others at their batched share. Why not each chunk at its batched share: a call's
        fixed part is paid once, so a short call costs far more per chunk than a long one (SmolLM2
        L7 on 2 cores: 25-32 ms a chunk one per call, 12.4-15.8 ms sixteen in one call), and measured
        that way the calls of two or three chunks of a mixed plan taught a factor near 2, which
        then priced a load of L7 alone (one call of 15 chunks) at 24 ms a chunk. The CPU the
        fetches took meanwhile goes with it, shared the same way, as in :meth:`measured`."""
        for m in batch:
            self.record_fetch(decisions[m.pos], m)
            self.start(m.pos)
        refs = [plan.infos[m.pos].ref for m in batch]
        t = self.now()
        mark = self.fetch_cpu_now()
        try:
            yield Call(partial(cache.decode_many, self.l, [m.data for m in batch], refs))
        except Exception as e:  # decoded again one by one, where the fault is reported
            self.trace(e)
            return False
        t_end = self.now()
        stolen = self.stolen_since(mark)
        total = refs[-1].end - refs[0].start
        for m, ref in zip(batch, refs, strict=True):
            d = decisions[m.pos]
            d.decode_start, d.decode_end = t, t_end
            d.decode_s = (t_end - t) * (ref.end - ref.start) / total
            got.add(m.pos)
        costs = self.l.costs
        preds = [self.predicted(costs, plan.chunks[m.pos], m.level, batched=j > 0) for j, m in enumerate(batch)]
        whole = sum(preds)
        for m, p in zip(batch, preds, strict=True):  # each chunk: the call's measured / predicted
            share = p / whole if whole > 0 else 0.0
            self.l.rates.observe(m.level, p, (t_end - t) * share, stolen * share)
        return True

    def decode_fetched(
        self,
        msg: Fetched,
        plan: LoadPlan,
        decisions: list[ChunkDecision],
        cache: _Cache,
        got: set[int],
        failed: set[int],
        res: LoadResult,
        started: bool,
    ) -> Generator[Op, Any, bool]:
        """Decode one fetched chunk into its range; False when it failed and the load must stop
        (every chunk from it on is then recomputed; a failed probe chunk is recomputed last)."""
        d = decisions[msg.pos]
        self.record_fetch(d, msg)
        if not started:
            self.start(msg.pos)
        d.decode_start = self.now()
        mark = self.fetch_cpu_now()
        ref = plan.infos[msg.pos].ref
        # the first decode also allocates the whole cache: not a decode time to learn from
        typical = cache.kv is not None
        try:
            yield Call(partial(cache.decode, self.l, msg.data, ref))
            fault = None
        except Exception as e:  # anything a decode raises means: this chunk is not usable
            fault = _describe(f"chunk {msg.pos} level {msg.level}", e)
            self.trace(e)
        d.decode_end = self.now()
        d.decode_s = d.decode_end - d.decode_start
        if fault is None:
            got.add(msg.pos)
            if typical:
                self.measured(plan.chunks[msg.pos], msg.level, d.decode_s, stolen=self.stolen_since(mark))
            return True
        failed.add(msg.pos)
        self.fault(res, fault)
        return msg.pos == plan.early

    # -- faults ------------------------------------------------------------------------
    def no_message(self, msg: object, what: str) -> str:
        if isinstance(msg, PlanFailed):
            return msg.fault
        if isinstance(msg, ProducerEnded):
            if msg.error is not None:
                self.trace(msg.error)
                return _describe("fetch stage", msg.error)
            return f"{what}: the fetch stage ended early"
        if msg is None:
            return f"{what}: no answer from the store within the deadline ({self.slo}s); recomputing"
        return f"{what}: unexpected message {type(msg).__name__}"

    def fault(self, res: LoadResult, text: str) -> None:
        text = redact(text)
        res.faults.append(text)
        log.warning("load fault, recomputing from text: %s", text)

    @staticmethod
    def trace(e: BaseException) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", redact("".join(traceback.format_exception(e))))
