"""How fast decodes and recomputes really run, learned from a loader's own timings.

The cost model is measured once, in isolation, before any load (:mod:`cachegen.stream.costs`);
inside a load the same decode runs 0.6-1.7x that prediction: the machine's speed drifts (seen
here: one chunk's decode 33 ms one day and 62 ms another, against one calibrated 59 ms),
the fetch thread competes for the cores, and two formats whose isolated times differ by 20%
can decode alike once their payloads are warm. The ``fastest`` policy trades bytes against
decode time, so a prediction off by that much picks the wrong side: at 0.1 Gbit/s a
calibration that overstated decoding mixed bigger, cheaper-to-decode chunks into a load
that was really bound by the link, and ended it 20% later than one level alone.

:class:`ComputeRates` keeps the ratio of measured to predicted seconds of the last few
decodes per format (and of recomputes), and :meth:`ComputeRates.corrected` scales the cost
model by their median over each decoder family: the levels of one codec that run the same
decoding code (:func:`decoder_families`) share one factor. Per level, 20-30% of noise from load
to load was enough at 1 Gbit/s to rank the project codec's L4 above its L7, which is smaller and
decodes as fast; and a level not decoded yet took the median over every format, raw 8-bit KV's
included. It also keeps what a decode loses per MB fetched beside it (the fetch
thread's read and checksum take CPU from the decode pool, :meth:`CostModel.fetch_cpu_s`): the
loader takes that loss out of a decode's measured seconds before it learns from them, so a level
decoded only beside big fetches is not taken for a slow level. Keep one per loader's machine and
model across loads, as the link's
:class:`~cachegen.stream.estimator.ThroughputEstimator` is kept: the next load starts from
what the last one measured. The loader applies it to the ``fastest`` policy only: a deadline
policy keeps the calibrated model and its headroom, since a prediction that is right only
at the median is a missed deadline half the time.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from functools import partial

from cachegen.errors import ConfigError
from cachegen.stream.costs import TEXT, CostModel

# A ratio outside this range is taken as its bound: one decode that waited behind a page fault
# or a garbage collection says little about the next, and a hostile clock cannot scale the plan
# by more than this.
MIN_RATIO, MAX_RATIO = 0.2, 5.0

# The compute seconds a busy compute stage loses per CPU second the fetch thread spends beside it.
# Not 1: the decode pool's threads keep running on the other cores. Measured on 2 cores
# (docs/streaming.md): beside a fetch thread busy 22-77% of a core, L7 decodes ran 0.27-0.8 s
# longer per CPU second of the fetches; at 1 the loader took more than a whole decode's time out
# of the 8-bit KV decodes beside 10 Gbit/s fetches, and they looked 5x too fast.
FETCH_CPU_SHARE = 0.5
# A smaller fetch says little about the CPU per MB: a store's fixed work per request (a SQLite
# query, a round trip) dominates it, and 0.2 ms for 20 kB would predict 30 ms for 3 MB.
MIN_FETCH_BYTES = 1 << 16


@dataclass
class ScaledCosts(CostModel):
    """A :class:`~cachegen.stream.costs.CostModel` whose decode and recompute predictions are
    multiplied by measured factors: ``decode_scale`` per level (a level without one:
    ``decode_scale_default``), ``recompute_scale`` for text. Built by :meth:`ComputeRates.corrected`."""

    decode_scale: dict[int, float] = field(default_factory=dict)
    decode_scale_default: float = 1.0
    recompute_scale: float = 1.0

    def decode_s(self, level: int, num_values: int, batched: bool = False) -> float:
        scale = self.decode_scale.get(int(level), self.decode_scale_default)
        return super().decode_s(level, num_values, batched) * scale

    def recompute_s(self, prefix_tokens: int, n_tokens: int) -> float:
        return super().recompute_s(prefix_tokens, n_tokens) * self.recompute_scale


class ComputeRates:
    """Measured / predicted compute seconds of recent decodes (per level) and recomputes; thread-safe.

    A level takes the median over its decoder family's recent decodes (given a family map); a
    family that has not been decoded yet takes the median over every level's (a machine that runs
    slow runs slow for all of them); text takes only recomputes' (a prefill is bound by other
    things than a decode)."""

    def __init__(self, window: int = 16):
        if window < 1:
            raise ConfigError("window must be >= 1")
        self.window = window
        self._ratios: dict[int | str, deque[float]] = {}
        self._fetch_cpu: deque[float] = deque(maxlen=window)  # CPU seconds per MB of recent fetches
        self._lock = threading.Lock()

    def observe(self, choice: int | str, predicted_s: float, measured_s: float, fetch_cpu_s: float = 0.0) -> None:
        """Record one decode of level ``choice`` (or a recompute, ``TEXT``) that the uncorrected
        cost model predicted at ``predicted_s`` and took ``measured_s``, while the fetches beside it
        spent ``fetch_cpu_s`` of CPU: what it learns is ``measured_s`` less the :data:`FETCH_CPU_SHARE`
        of that which the planner charges to the fetches (:meth:`CostModel.fetch_cpu_s`). Ignores a
        sample that cannot be a time (not finite, negative, or a prediction of nothing)."""
        if not (math.isfinite(predicted_s) and math.isfinite(measured_s)) or predicted_s <= 0 or measured_s < 0:
            return
        measured_s = max(measured_s - FETCH_CPU_SHARE * fetch_cpu_s, 0.0)
        ratio = min(max(measured_s / predicted_s, MIN_RATIO), MAX_RATIO)
        key: int | str = TEXT if choice == TEXT else int(choice)
        with self._lock:
            self._ratios.setdefault(key, deque(maxlen=self.window)).append(ratio)

    def observe_fetch(self, nbytes: int, cpu_s: float) -> None:
        """Record one fetch of ``nbytes`` that took ``cpu_s`` seconds of its thread's CPU (a busy
        compute stage beside it loses :data:`FETCH_CPU_SHARE` of that). Ignores a fetch too small
        to say much (under :data:`MIN_FETCH_BYTES`) and a sample that cannot be a time."""
        if nbytes < MIN_FETCH_BYTES or not math.isfinite(cpu_s) or cpu_s < 0:
            return
        with self._lock:
            self._fetch_cpu.append(FETCH_CPU_SHARE * cpu_s / (nbytes / 1e6))

    def fetch_cpu_s_per_mb(self) -> float | None:
        """What a busy compute stage loses per MB fetched beside it: the median over recent fetches
        of :data:`FETCH_CPU_SHARE` times their CPU seconds per MB; None before the first."""
        return self._snapshot()[1]

    def _snapshot(self) -> tuple[dict[int | str, list[float]], float | None]:
        """The recent ratios per key and :meth:`fetch_cpu_s_per_mb`, read under one lock."""
        with self._lock:
            fetch_cpu = statistics.median(self._fetch_cpu) if self._fetch_cpu else None
            return {k: list(d) for k, d in self._ratios.items()}, fetch_cpu

    @property
    def known(self) -> bool:
        """Whether any decode, recompute or fetch has been recorded."""
        with self._lock:
            return bool(self._ratios) or bool(self._fetch_cpu)

    def factor(self, choice: int | str, families: Mapping[int, str] | None = None) -> float:
        """The median ratio for ``choice`` over its decoder family's recent decodes (``families``:
        level -> family, :func:`decoder_families`; a level outside it is a family of its own); a
        family without samples: :meth:`pooled_factor`; text: the recomputes' (1 without)."""
        snap = self._snapshot()[0]
        if choice == TEXT:
            return _text_factor(snap)
        return _decode_scales(snap, families or {}).get(int(choice), _pooled(snap))

    def pooled_factor(self) -> float:
        """The median ratio over every level's recent decodes (1 before the first)."""
        return _pooled(self._snapshot()[0])

    def corrected(self, costs: CostModel, families: Mapping[int, str] | None = None) -> CostModel:
        """``costs`` with every decode and recompute prediction scaled by its :meth:`factor` (under
        ``families``) and the fetches' CPU time per MB as measured (``costs`` itself when nothing
        has been measured yet); all of it from one snapshot."""
        snap, fetch_cpu = self._snapshot()
        if not snap and fetch_cpu is None:
            return costs
        base = {f.name: getattr(costs, f.name) for f in fields(CostModel)}
        if fetch_cpu is not None:
            base["fetch_cpu_s_per_mb"] = fetch_cpu
        return ScaledCosts(
            **base,
            decode_scale=_decode_scales(snap, families or {}),
            decode_scale_default=_pooled(snap),
            recompute_scale=_text_factor(snap),
        )


def _pooled(snap: dict[int | str, list[float]]) -> float:
    pooled = [r for k, rs in snap.items() if k != TEXT for r in rs]
    return statistics.median(pooled) if pooled else 1.0


def _decode_scales(snap: dict[int | str, list[float]], families: Mapping[int, str]) -> dict[int, float]:
    """The factor of every level in ``snap`` or ``families``: the median over its family's recent
    decodes (each family's taken once), its own where it has no family, :func:`_pooled` for a family
    without samples (and for any level in neither: the caller's default)."""
    pooled: dict[str, list[float]] = {}
    for k, rs in snap.items():
        if k != TEXT and int(k) in families:
            pooled.setdefault(families[int(k)], []).extend(rs)
    medians = {f: statistics.median(rs) for f, rs in pooled.items() if rs}
    scales = {int(k): statistics.median(rs) for k, rs in snap.items() if k != TEXT and rs}
    default = _pooled(snap)
    for lv, f in families.items():
        scales[lv] = medians.get(f, default)
    return scales


def _text_factor(snap: dict[int | str, list[float]]) -> float:
    """The recomputes' median ratio (1 before the first): a prefill is not pooled with decodes."""
    own = snap.get(TEXT)
    return statistics.median(own) if own else 1.0


def decoder_family(codec: object, level: int) -> str:
    """Which code of ``codec`` decodes ``level``: its ``decoder_family(level)`` where it names one
    (:class:`~cachegen.codec.protocol.NamesDecoders`), else the level alone."""
    name = getattr(codec, "decoder_family", None)
    return str(name(level)) if callable(name) else f"level {level}"


def decoder_families(codec: object) -> dict[int, str]:
    """Level -> :func:`decoder_family` for every level of ``codec`` (none where it lists none):
    what :meth:`ComputeRates.corrected` pools the decodes of."""
    levels = getattr(codec, "levels", ())
    return {int(lv): decoder_family(codec, int(lv)) for lv in levels}


def thread_cpu_clock() -> Callable[[], float | None] | None:
    """A function that reads the calling thread's CPU seconds from any thread (None once the
    thread has ended and its clock is gone); None where the platform cannot read another thread's
    CPU clock.

    The loader's compute stage reads its fetch thread's clock around each decode: the difference is
    the CPU the fetches took while that decode ran (the decode's own threads are not counted)."""
    try:
        clock = time.pthread_getcpuclockid(threading.get_ident())
        time.clock_gettime(clock)
    except (AttributeError, OSError):  # not a POSIX platform, or no per-thread CPU clocks
        return None
    return partial(_read_clock, clock)


def _read_clock(clock: int) -> float | None:
    try:
        return time.clock_gettime(clock)
    except OSError:  # the thread has ended and the system has let go of it
        return None


def cpu_timed(fn: Callable[[], object]) -> tuple[object, float]:
    """``(fn(), CPU seconds the calling thread spent in it)``: a fetch's read and checksum, not
    its wait on the link."""
    t = time.thread_time()
    out = fn()
    return out, time.thread_time() - t
