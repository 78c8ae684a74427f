"""``mock://NAME``: an in-memory store with optional fault injection, for tests.

Every backend opened with the same ``NAME`` in one process shares one store,
so a test and the code under test meet by URL alone. Faults are drawn from a
seeded generator per read call, so a test sees the same faults in every run:

* ``latency=S`` — every read takes ``S`` seconds (a read given a shorter
  ``timeout`` waits that long and raises ``StoreUnavailable``, as a stalled
  server would);
* ``fail=P`` — a read raises ``StoreUnavailable`` with probability ``P``;
* ``missing=P`` — a payload read raises ``ChunkNotFound`` with probability ``P``;
* ``corrupt=P`` — a payload read raises ``CorruptChunk`` with probability ``P``
  (a backend never returns wrong bytes: it detects them);
* ``seed=N`` — the generator's seed (default 0).

Example: ``mock://faulty?latency=0.05&fail=0.2&seed=3``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from cachegen.errors import ChunkNotFound, ConfigError, CorruptChunk, StoreUnavailable
from cachegen.store.backend import Backend, ChunkRow, ChunkWrite, Deadline, StoreStats, merge_levels
from cachegen.store.keys import check_key


@dataclass
class _Chunk:
    tokens: bytes
    start: int
    prev: str
    ends_context: bool
    written: int  # write order, for evict
    payloads: dict[int, bytes] = field(default_factory=dict)


@dataclass
class _Store:
    chunks: dict[str, _Chunk] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)
    writes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_STORES: dict[str, _Store] = {}
_STORES_LOCK = threading.Lock()


@dataclass(frozen=True)
class Faults:
    latency: float = 0.0
    fail: float = 0.0
    missing: float = 0.0
    corrupt: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.latency < 0:
            raise ConfigError("mock store option latency must not be negative")
        for name in ("fail", "missing", "corrupt"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"mock store option {name} is a probability: give a number from 0 to 1")


class MockBackend(Backend):
    """An in-memory backend shared by name; see the module docstring for the faults."""

    local = True

    def __init__(self, name: str, faults: Faults | None = None):
        if not name:
            raise ConfigError("mock:// needs a name, e.g. mock://test")
        self.name, self.faults = name, faults or Faults()
        self.url = f"mock://{name}"
        self._rng = random.Random(self.faults.seed)
        self._rng_lock = threading.Lock()
        with _STORES_LOCK:
            self._store = _STORES.setdefault(name, _Store())

    def _draw(self) -> float:
        with self._rng_lock:
            return self._rng.random()

    def _read(self, timeout: float | None, payload: bool) -> None:
        """Apply the read faults: latency (bounded by the timeout), then failures."""
        d = Deadline(timeout)
        f = self.faults
        if f.latency:
            left = d.left()
            if left is not None and left < f.latency:
                time.sleep(left)
                raise StoreUnavailable(f"{self.url} did not answer within {timeout:.3g} s")
            time.sleep(f.latency)
        if f.fail and self._draw() < f.fail:
            raise StoreUnavailable(f"{self.url}: injected failure")
        if payload and f.missing and self._draw() < f.missing:
            raise ChunkNotFound(f"{self.url}: injected missing chunk")
        if payload and f.corrupt and self._draw() < f.corrupt:
            raise CorruptChunk(f"{self.url}: injected checksum failure")

    # -- writes --------------------------------------------------------------
    def put_chunks(self, writes: Sequence[ChunkWrite]) -> None:
        s = self._store
        with s.lock:
            for w in writes:
                check_key(w.key)
                c = s.chunks.get(w.key)
                new = {int(l): bytes(d) for l, d in w.payloads.items() if c is None or int(l) not in c.payloads}
                if c is None:
                    if not new:
                        continue  # nothing to store: no empty chunk
                    s.writes += 1
                    c = s.chunks[w.key] = _Chunk(bytes(w.tokens), w.start, w.prev, w.ends_context, s.writes)
                c.payloads.update(new)
                c.ends_context = c.ends_context or w.ends_context
                c.prev = c.prev or w.prev

    # -- reads ---------------------------------------------------------------
    def get_many(self, items: Sequence[tuple[str, int]], *, timeout: float | None = None) -> list[bytes]:
        self._read(timeout, payload=True)
        out = []
        with self._store.lock:
            for key, level in items:
                c = self._store.chunks.get(check_key(key))
                if c is None or level not in c.payloads:
                    raise ChunkNotFound(f"chunk {key[:16]} level {level} is not in {self.url}")
                out.append(c.payloads[level])
        return out

    def sizes_many(self, keys: Sequence[str], *, timeout: float | None = None) -> list[dict[int, int]]:
        self._read(timeout, payload=False)
        with self._store.lock:
            out = []
            for k in keys:
                c = self._store.chunks.get(check_key(k))
                out.append({} if c is None else {l: len(p) for l, p in c.payloads.items()})
        return out

    def tokens(self, key: str) -> bytes:
        c = self._store.chunks.get(check_key(key))
        if c is None:
            raise ChunkNotFound(f"chunk {key[:16]} is not in {self.url}")
        return c.tokens

    # -- settings and contexts ---------------------------------------------------
    def get_setting(self, name: str, *, timeout: float | None = None) -> str | None:
        self._read(timeout, payload=False)
        return self._store.settings.get(name)

    def claim_setting(self, name: str, value: str) -> str:
        with self._store.lock:
            return self._store.settings.setdefault(name, value)

    def chunk_rows(self) -> list[ChunkRow]:
        with self._store.lock:
            return [
                ChunkRow(
                    k, c.start, len(c.tokens) // 4, c.prev, c.ends_context, {l: len(p) for l, p in c.payloads.items()}
                )
                for k, c in self._store.chunks.items()
            ]

    def delete_chunks(self, keys: Sequence[str]) -> int:
        with self._store.lock:
            return sum(self._store.chunks.pop(k, None) is not None for k in keys)

    def unmark_end(self, key: str) -> None:
        with self._store.lock:
            c = self._store.chunks.get(key)
            if c is not None:
                c.ends_context = False

    # -- maintenance ---------------------------------------------------------
    def stats(self) -> StoreStats:
        s = StoreStats()
        with self._store.lock:
            for c in self._store.chunks.values():
                s.chunks += 1
                s.contexts += c.ends_context
                merge_levels(s, ((l, len(p)) for l, p in c.payloads.items()))
        return s

    def evict(self, max_bytes: int | None = None) -> int:
        """Oldest writes first, a context's tail before its head (as Redis' evict)."""
        if max_bytes is None:
            return 0
        with self._store.lock:
            chunks = self._store.chunks
            total = sum(len(p) for c in chunks.values() for p in c.payloads.values())
            dropped = 0
            for key in sorted(chunks, key=lambda k: (chunks[k].written, -chunks[k].start)):
                if total <= max_bytes:
                    break
                total -= sum(len(p) for p in chunks.pop(key).payloads.values())
                dropped += 1
        return dropped

    def clear(self) -> int:
        with self._store.lock:
            n = len(self._store.chunks)
            self._store.chunks.clear()
            for name in [n for n in self._store.settings if n.startswith("chunk_tokens:")]:
                del self._store.settings[name]
        return n


def forget(name: str) -> None:
    """Drop the named in-memory store (tests call it to start fresh)."""
    with _STORES_LOCK:
        _STORES.pop(name, None)
