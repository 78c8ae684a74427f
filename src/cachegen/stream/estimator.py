"""Throughput estimation from recent chunk fetches.

The estimate is the harmonic mean of the last few samples (the right mean for
predicting *time*, which is what the planner needs), but never more than the
latest sample: a drop shows up in the very next estimate, while a rise is
trusted only gradually.

Keep one estimator per link and pass it to every load (the bench and the Engine
do): the next load then starts from the last estimate instead of a guess. A
fresh estimator without ``prior_gbps`` is *cold*: the loader fetches its first
chunk at the smallest level, which is both safe and a quick measurement.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

from cachegen.errors import ConfigError

LATENCY_WINDOW = 16  # fetches the per-request latency is fitted to
LATENCY_MIN_FETCHES = 4


class ThroughputEstimator:
    """Gbit/s from ``(bytes, seconds)`` samples; thread-safe."""

    DEFAULT_PRIOR_GBPS = 1.0

    def __init__(self, window: int = 5, prior_gbps: float | None = None, min_bytes: int = 16 * 1024, history: int = 64):
        if window < 1 or (prior_gbps is not None and prior_gbps <= 0):
            raise ConfigError("window must be >= 1 and prior_gbps > 0")
        self.window = window
        # None: nothing is known before the first sample (the loader then probes with its
        # smallest payload); a number is trusted like a measurement until samples arrive
        self.has_prior = prior_gbps is not None
        self.prior_gbps = float(prior_gbps) if prior_gbps is not None else self.DEFAULT_PRIOR_GBPS
        self.min_bytes = min_bytes  # smaller transfers say little about bandwidth
        self._samples: deque[float] = deque(maxlen=window)
        self._history: deque[float] = deque(maxlen=history)  # longer memory: the planner's futures
        self._fetches: deque[tuple[int, float]] = deque(maxlen=LATENCY_WINDOW)  # (bytes, seconds)
        self._lock = threading.Lock()

    def add(self, nbytes: int, seconds: float) -> float | None:
        """Record one fetch; returns its throughput in Gbit/s (None if too small to count)."""
        if nbytes < self.min_bytes or seconds <= 0:
            return None
        gbps = nbytes * 8 / seconds / 1e9
        with self._lock:
            self._samples.append(gbps)
            self._history.append(gbps)
        return gbps

    def record_fetch(self, nbytes: int, seconds: float) -> None:
        """Record one whole fetch, latency included, for :meth:`latency` (any size counts)."""
        if nbytes >= 0 and seconds > 0:
            with self._lock:
                self._fetches.append((int(nbytes), float(seconds)))

    def latency(self, default: float) -> float:
        """The link's per-request seconds, fitted to the recent fetches as ``seconds = latency +
        bytes * c`` (Theil-Sen: the median slope over pairs whose sizes differ at least twofold,
        then the median intercept; one stalled fetch moves neither), clamped to ``[0, fastest
        fetch]``; ``default`` (the cost model's) until there are :data:`LATENCY_MIN_FETCHES`
        fetches with such pairs.

        Why: a fetch's fixed cost (the request, the store's index lookup, a file open, waking
        the fetch thread on a busy machine) is what the planner adds to every fetch, and what the
        estimator takes off each sample (:func:`~cachegen.stream.loader.transfer_s`). Measured
        once in isolation it was 0.5 ms; inside a 10 Gbit/s load with both cores decoding,
        200 KB chunks took 0.9-1.8 ms, so their samples still made the link look half as fast
        as the 3 MB chunks' did, and the plan took more small chunks, whose samples kept it so."""
        with self._lock:
            f = list(self._fetches)
        if len(f) < LATENCY_MIN_FETCHES:
            return default
        slopes = [
            (tj - ti) / (bj - bi)
            for i, (bi, ti) in enumerate(f)
            for bj, tj in f[i + 1 :]
            if max(bi, bj) >= 2 * min(bi, bj) and bi != bj
        ]
        if not slopes:
            return default
        c = statistics.median(slopes)
        if c <= 0:  # bigger fetches were not slower: nothing to split
            return default
        fit = statistics.median(t - b * c for b, t in f)
        return min(max(fit, 0.0), min(t for _, t in f))

    def add_gbps(self, gbps: float) -> None:
        with self._lock:
            self._samples.append(float(gbps))
            self._history.append(float(gbps))

    def s_per_bit_history(self) -> list[float]:
        """Seconds per bit of the last ``history`` samples: possible futures for the planner."""
        with self._lock:
            return [1.0 / (g * 1e9) for g in self._history]

    @property
    def known(self) -> bool:
        """True once there is a sample (or an explicit prior) to plan with."""
        with self._lock:
            return self.has_prior or bool(self._samples)

    @property
    def samples(self) -> list[float]:
        with self._lock:
            return list(self._samples)

    def last(self) -> float:
        with self._lock:
            return self._samples[-1] if self._samples else self.prior_gbps

    def harmonic_mean(self) -> float:
        with self._lock:
            s = list(self._samples)
        if not s:
            return self.prior_gbps
        return len(s) / sum(1.0 / x for x in s)

    def tail_estimate(self) -> float:
        """Rate to plan the *later* chunks of a load with: the window's harmonic mean, unless the
        link has shifted down (the last two samples both slower than every older one in the
        window), then the faster of those two.

        Why not :meth:`estimate` (the latest sample when it is the slowest): one slow fetch on a
        jittery link says little about the next ones, and planning every remaining chunk at its
        rate made the loader give up (recompute a chunk, then the most aggressive level for the
        rest) after any dip: 3% missed deadlines and its worst KL on the random trace. Two in a
        row below everything before them is a step, and the plan follows it one chunk later."""
        with self._lock:
            s = list(self._samples)
        if not s:
            return self.prior_gbps
        hm = len(s) / sum(1.0 / x for x in s)
        if len(s) >= 3 and max(s[-1], s[-2]) < min(s[:-2]):
            return min(hm, max(s[-1], s[-2]))
        return hm

    def next_estimate(self, first_of_load: bool) -> float:
        """Rate to plan the fetch about to start with: :meth:`estimate`, except for a load's first
        fetch, whose latest sample comes from an earlier load, maybe long ago: then
        :meth:`tail_estimate` (one stale slow sample had sent the most important chunk, fetched
        first, to the most aggressive level)."""
        return self.tail_estimate() if first_of_load else self.estimate()

    def estimate(self) -> float:
        """min(latest sample, harmonic mean of the window)."""
        with self._lock:
            s = list(self._samples)
        if not s:
            return self.prior_gbps
        return min(s[-1], len(s) / sum(1.0 / x for x in s))

    def reset(self) -> None:
        with self._lock:
            self._samples.clear()
            self._history.clear()
            self._fetches.clear()
