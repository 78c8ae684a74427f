"""What the streaming loader needs of its collaborators, as typed protocols.

The loader is written against these, not against concrete classes, so that the
same fetch -> decode -> stitch code runs on a real store, model and clock, and on
the virtual ones of the replay (:mod:`cachegen.bench.replay`) and the tests. The
codec is ``cachegen.codec.ChunkCodec`` (the loader decodes with ``key=ref.key``:
a chunk written for another key raises :class:`~cachegen.errors.KeyMismatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from cachegen.codec import ChunkCodec
    from cachegen.kv import KVCache
    from cachegen.store import ChunkInfo, ChunkRef

__all__ = ["ChunkCodec", "ChunkSource", "Clock", "Link", "Predicts", "Recompute"]


@runtime_checkable
class ChunkSource(Protocol):
    """The store, as the loader sees it (:class:`cachegen.store.ContextStore` is one).

    ``timeout``: seconds the call may take (derived from the load's deadline); a
    call that cannot finish in time raises :class:`~cachegen.errors.StoreUnavailable`.
    The loader passes it only to a store whose methods accept it, and never waits
    for a call past its deadline either way."""

    def plan(self, tokens: Sequence[int], /, *, timeout: float | None = None) -> Sequence[ChunkInfo]: ...

    def get(self, ref: ChunkRef, level: int, /, *, timeout: float | None = None) -> bytes: ...


class Recompute(Protocol):
    """The model: the KV of ``token_ids`` after ``prefix`` (from text)."""

    def __call__(self, prefix: KVCache | None, token_ids: list[int], /) -> KVCache: ...


class Link(Protocol):
    """How fetched bytes cross the network: :class:`~cachegen.stream.link.ThrottledLink`
    (an emulated link), :class:`~cachegen.stream.link.DirectLink` (the real one)."""

    def begin(self) -> None: ...

    def fetch(self, get: Callable[[ChunkRef, int], bytes], ref: ChunkRef, level: int, /) -> bytes: ...

    def close(self) -> None: ...


class Clock(Protocol):
    """Seconds, monotonic: ``time.perf_counter`` or a :class:`~cachegen.stream.pipeline.VirtualClock`."""

    def __call__(self) -> float: ...


class Predicts(Protocol):
    """What the planner's pipeline model asks of a cost model: :class:`~cachegen.stream.costs.CostModel`
    (and its corrected form, :class:`~cachegen.stream.compute_rates.ScaledCosts`), or the planner's
    memo over one for the length of a decision."""

    def fetch_s(self, nbytes: int, gbps: float) -> float: ...

    def fetch_cpu_s(self, nbytes: int) -> float: ...

    def decode_s(self, level: int, num_values: int, batched: bool = False) -> float: ...

    def recompute_s(self, prefix_tokens: int, n_tokens: int) -> float: ...
