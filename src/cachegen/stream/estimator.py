"""Throughput estimation from recent chunk fetches.

The estimate is the harmonic mean of the last few samples (the right mean for
predicting *time*, which is what the planner needs), but never more than the
latest sample: a drop shows up in the very next estimate, while a rise is
trusted only gradually.
"""

from __future__ import annotations

import threading
from collections import deque

from cachegen.errors import ConfigError


class ThroughputEstimator:
    """Gbit/s from ``(bytes, seconds)`` samples; thread-safe."""

    def __init__(self, window: int = 5, prior_gbps: float = 1.0, min_bytes: int = 16 * 1024):
        if window < 1 or prior_gbps <= 0:
            raise ConfigError("window must be >= 1 and prior_gbps > 0")
        self.window = window
        self.prior_gbps = float(prior_gbps)
        self.min_bytes = min_bytes  # smaller transfers say little about bandwidth
        self._samples: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def add(self, nbytes: int, seconds: float) -> float | None:
        """Record one fetch; returns its throughput in Gbit/s (None if too small to count)."""
        if nbytes < self.min_bytes or seconds <= 0:
            return None
        gbps = nbytes * 8 / seconds / 1e9
        with self._lock:
            self._samples.append(gbps)
        return gbps

    def add_gbps(self, gbps: float) -> None:
        with self._lock:
            self._samples.append(float(gbps))

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
