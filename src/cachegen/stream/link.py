"""Bandwidth traces and an in-process throttled link.

A :class:`Trace` is a piecewise-constant bandwidth, indexed either by seconds
since the load began (``by="time"``) or by chunk index (``by="chunk"``).
:class:`ThrottledLink` makes a store fetch take ``latency + bytes * 8 / bandwidth``
by sleeping after the real read; transfers are serialized (one link), and it is
thread-safe.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import threading
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachegen.errors import ConfigError

BUILTIN_TRACES = ("constant", "step", "random", "random-log")


@dataclass
class Trace:
    """Piecewise-constant Gbit/s: ``points`` are ``(x, gbps)`` sorted by x, the first at x=0."""

    points: list[tuple[float, float]]
    by: str = "time"  # "time" (seconds since the load began) or "chunk" (chunk index)
    name: str = "trace"

    def __post_init__(self) -> None:
        if self.by not in ("time", "chunk"):
            raise ConfigError(f"trace must be by 'time' or 'chunk', not {self.by!r}")
        if not self.points:
            raise ConfigError("a trace needs at least one point")
        self.points = sorted((float(x), float(g)) for x, g in self.points)
        if any(g <= 0 for _, g in self.points):
            raise ConfigError("trace bandwidths must be positive")
        if self.points[0][0] > 0:
            self.points.insert(0, (0.0, self.points[0][1]))
        self._xs = [x for x, _ in self.points]

    def gbps_at(self, x: float) -> float:
        i = max(bisect_right(self._xs, x) - 1, 0)
        return self.points[i][1]

    def next_change(self, x: float) -> float:
        i = bisect_right(self._xs, x)
        return self._xs[i] if i < len(self._xs) else math.inf

    def transfer_s(self, t0: float, bits: float) -> float:
        """Seconds to move ``bits`` starting at time ``t0`` (time traces)."""
        t, left = t0, bits
        while True:
            g = self.gbps_at(t) * 1e9
            nxt = self.next_change(t)
            can = (nxt - t) * g
            if can >= left:
                return t + left / g - t0
            left -= can
            t = nxt


def constant(gbps: float) -> Trace:
    return Trace([(0, gbps)], by="chunk", name=f"constant-{gbps:g}")


def step(n_chunks: int, before: float = 1.0, after: float = 0.1) -> Trace:
    """A drop from ``before`` to ``after`` Gbit/s in the middle of the load (by chunk)."""
    return Trace([(0, before), (max(n_chunks // 2, 1), after)], by="chunk", name="step")


def random_trace(n_chunks: int, seed: int, lo: float = 0.1, hi: float = 10.0, log: bool = False) -> Trace:
    """A bandwidth per chunk drawn uniformly in ``[lo, hi]`` Gbit/s (log-uniform if ``log``)."""
    rng = random.Random(seed)
    if log:
        pts = [(float(i), math.exp(rng.uniform(math.log(lo), math.log(hi)))) for i in range(n_chunks)]
    else:
        pts = [(float(i), rng.uniform(lo, hi)) for i in range(n_chunks)]
    return Trace(pts, by="chunk", name="random-log" if log else "random")


def load_trace_file(path: str | Path) -> Trace:
    """A JSON or CSV file of ``(time_s | chunk, gbps)`` rows.

    JSON: ``{"by": "time"|"chunk", "points": [[x, gbps], ...]}`` or a bare list of
    pairs (or of ``{"time_s"|"chunk": x, "gbps": g}`` objects). CSV: a header naming
    ``time_s`` or ``chunk``, and ``gbps``; without a header, columns are time_s, gbps.
    """
    p = Path(path)
    text = p.read_text()
    by = "time"
    pts: list[tuple[float, float]] = []
    if p.suffix.lower() == ".json" or text.lstrip().startswith(("[", "{")):
        d = json.loads(text)
        if isinstance(d, dict):
            by = d.get("by", "time")
            d = d["points"]
        for row in d:
            if isinstance(row, dict):
                if "chunk" in row:
                    by = "chunk"
                    pts.append((row["chunk"], row["gbps"]))
                else:
                    pts.append((row["time_s"], row["gbps"]))
            else:
                pts.append((row[0], row[1]))
    else:
        rows = [r for r in csv.reader(io.StringIO(text)) if r and not r[0].startswith("#")]
        head = [c.strip().lower() for c in rows[0]]
        if head and not _isnum(head[0]):
            if "chunk" in head:
                by, xi = "chunk", head.index("chunk")
            else:
                xi = head.index("time_s") if "time_s" in head else 0
            gi = head.index("gbps") if "gbps" in head else 1
            rows = rows[1:]
        else:
            xi, gi = 0, 1
        pts = [(float(r[xi]), float(r[gi])) for r in rows]
    return Trace(pts, by=by, name=p.stem)


def _isnum(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def make_trace(name_or_file: str, n_chunks: int, seed: int = 0, gbps: float = 1.0) -> Trace:
    """``constant`` (at ``gbps``), ``constant:<gbps>``, ``step``, ``random``, ``random-log``, or a file."""
    if name_or_file.startswith("constant"):
        _, _, g = name_or_file.partition(":")
        return constant(float(g) if g else gbps)
    if name_or_file == "step":
        return step(n_chunks)
    if name_or_file == "random":
        return random_trace(n_chunks, seed)
    if name_or_file == "random-log":
        return random_trace(n_chunks, seed, log=True)
    if Path(name_or_file).is_file():
        return load_trace_file(name_or_file)
    raise ConfigError(f"unknown trace {name_or_file!r}: use one of {', '.join(BUILTIN_TRACES)} or a JSON/CSV file")


class ThrottledLink:
    """Makes fetches as slow as a link following ``trace``; one transfer at a time."""

    kind = "inproc"

    def __init__(
        self,
        trace: Trace,
        latency_s: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.trace = trace
        self.latency_s = latency_s
        self.clock = clock
        self.sleep = sleep
        self._lock = threading.Lock()
        self._t0 = clock()
        self._busy_until = self._t0
        self.log: list[tuple[int, int, float, float]] = []  # (chunk, bytes, start, end) relative to begin()

    def begin(self) -> None:
        """Start of a load: time traces count from here."""
        with self._lock:
            self._t0 = self.clock()
            self._busy_until = self._t0
            self.log.clear()

    def duration(self, nbytes: int, index: int, start: float) -> float:
        bits = nbytes * 8
        if self.trace.by == "chunk":
            return self.latency_s + bits / (self.trace.gbps_at(index) * 1e9)
        return self.latency_s + self.trace.transfer_s(start - self._t0, bits)

    def fetch(self, get: Callable[..., bytes], ref, level: int) -> bytes:
        """``get(ref, level)``, then wait until the bytes would have crossed the link."""
        t_req = self.clock()
        data = get(ref, level)
        with self._lock:
            start = max(t_req, self._busy_until)
            end = start + self.duration(len(data), ref.index, start)
            self._busy_until = end
            self.log.append((ref.index, len(data), start - self._t0, end - self._t0))
        wait = end - self.clock()
        if wait > 0:
            self.sleep(wait)
        return data

    def close(self) -> None:
        pass


class DirectLink:
    """No throttling (the real network, or a link shaped outside the process)."""

    kind = "direct"

    def begin(self) -> None:
        pass

    def fetch(self, get, ref, level):
        return get(ref, level)

    def close(self) -> None:
        pass
