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
model by their median. Keep one per loader's machine and model across loads, as the link's
:class:`~cachegen.stream.estimator.ThroughputEstimator` is kept: the next load starts from
what the last one measured. The loader applies it to the ``fastest`` policy only: a deadline
policy keeps the calibrated model and its headroom, since a prediction that is right only
at the median is a missed deadline half the time.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field, fields

from cachegen.errors import ConfigError
from cachegen.stream.costs import TEXT, CostModel

# A ratio outside this range is taken as its bound: one decode that waited behind a page fault
# or a garbage collection says little about the next, and a hostile clock cannot scale the plan
# by more than this.
MIN_RATIO, MAX_RATIO = 0.2, 5.0


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

    A level that has not been decoded yet takes the median over every level's recent decodes
    (a machine that runs slow runs slow for all of them); text takes only recomputes' (a
    prefill is bound by other things than a decode)."""

    def __init__(self, window: int = 16):
        if window < 1:
            raise ConfigError("window must be >= 1")
        self.window = window
        self._ratios: dict[int | str, deque[float]] = {}
        self._lock = threading.Lock()

    def observe(self, choice: int | str, predicted_s: float, measured_s: float) -> None:
        """Record one decode of level ``choice`` (or a recompute, ``TEXT``) that the uncorrected
        cost model predicted at ``predicted_s`` and took ``measured_s``. Ignores a sample that
        cannot be a time (not finite, negative, or a prediction of nothing)."""
        if not (math.isfinite(predicted_s) and math.isfinite(measured_s)) or predicted_s <= 0 or measured_s < 0:
            return
        ratio = min(max(measured_s / predicted_s, MIN_RATIO), MAX_RATIO)
        key: int | str = TEXT if choice == TEXT else int(choice)
        with self._lock:
            self._ratios.setdefault(key, deque(maxlen=self.window)).append(ratio)

    def _snapshot(self) -> dict[int | str, list[float]]:
        with self._lock:
            return {k: list(d) for k, d in self._ratios.items()}

    @property
    def known(self) -> bool:
        """Whether any sample has been recorded."""
        with self._lock:
            return bool(self._ratios)

    def factor(self, choice: int | str) -> float:
        """The median ratio for ``choice``; a level without samples: :meth:`pooled_factor`; text without: 1."""
        return _factor(self._snapshot(), TEXT if choice == TEXT else int(choice))

    def pooled_factor(self) -> float:
        """The median ratio over every level's recent decodes (1 before the first)."""
        return _pooled(self._snapshot())

    def corrected(self, costs: CostModel) -> CostModel:
        """``costs`` with every decode and recompute prediction scaled by its :meth:`factor`
        (``costs`` itself when nothing has been measured yet); all factors from one snapshot."""
        snap = self._snapshot()
        if not snap:
            return costs
        base = {f.name: getattr(costs, f.name) for f in fields(CostModel)}
        return ScaledCosts(
            **base,
            decode_scale={int(k): _factor(snap, k) for k in snap if k != TEXT},
            decode_scale_default=_pooled(snap),
            recompute_scale=_factor(snap, TEXT),
        )


def _pooled(snap: dict[int | str, list[float]]) -> float:
    pooled = [r for k, rs in snap.items() if k != TEXT for r in rs]
    return statistics.median(pooled) if pooled else 1.0


def _factor(snap: dict[int | str, list[float]], key: int | str) -> float:
    own = snap.get(key)
    if own:
        return statistics.median(own)
    return 1.0 if key == TEXT else _pooled(snap)
