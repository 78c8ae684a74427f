"""Redis and Redis Cluster backends: the same keys as the local store, shared by many nodes.

Per chunk (the ``{KEY}`` hash tag keeps them in one cluster slot, so one
MULTI covers them all):

* ``cg:{KEY}:m`` — a small hash: ``s:<level>`` payload sizes, ``p`` start,
  ``e`` ends-a-context flag, ``w`` write time. The planner reads it alone.
* ``cg:{KEY}:t`` — the token ids (uint32 LE), for recompute.
* ``cg:{KEY}:<level>`` — the payload's CRC-32 (4 bytes) followed by the payload (a value
  written before CRC-32 holds its blake2b-128 instead, and still reads).

A chunk's new levels, their sizes and its tokens are written in one
MULTI/EXEC, so a reader (or a writer that dies mid-way) never sees a size
without its payload. Two writers of the same chunk each write a complete,
consistent copy and the last one stays. Gets are pipelined; every payload's
checksum is verified. Connection failures and timeouts (``?timeout=`` in the
URL) raise :class:`~cachegen.errors.StoreUnavailable`.

A read given ``timeout=`` (the loader's time left) runs on a small pool of
worker threads and is waited for at most that long: a paused or sleeping
server costs the caller ``timeout`` and a ``StoreUnavailable``, whatever the
socket timeout. The abandoned worker ends at the URL's socket timeout.

Settings recorded with the store (a namespace's chunk size) are plain keys
``cgmeta:<name>``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cachegen.errors import ChunkNotFound, CorruptChunk, StoreError, StoreUnavailable
from cachegen.store.backend import (
    CHECKSUM_SIZE,
    LEGACY_CHECKSUM_SIZE,
    Backend,
    ChunkRow,
    ChunkWrite,
    Deadline,
    StoreStats,
    checksum,
    merge_levels,
    verify,
)
from cachegen.store.keys import check_key
from cachegen.store.url import redact

log = logging.getLogger(__name__)

PREFIX = "cg:"
SETTING_PREFIX = "cgmeta:"
DEFAULT_TIMEOUT = 5.0
CALL_WORKERS = 8  # reads waited for with a timeout run on these threads

T = TypeVar("T")


def _meta(key: str) -> str:
    return f"{PREFIX}{{{key}}}:m"


def _tok(key: str) -> str:
    return f"{PREFIX}{{{key}}}:t"


def _payload(key: str, level: int) -> str:
    return f"{PREFIX}{{{key}}}:{int(level)}"


def _checked(value: bytes) -> bytes | None:
    """The payload in a stored value (checksum, then payload), or None when it fails its checksum.
    A value written before CRC-32 begins with a 16-byte blake2b instead: tried when the CRC-32
    fails (such a value passes the CRC-32 check by chance once in 2^32, and then its payload
    begins with 12 digest bytes, which the codec's own header check refuses)."""
    for size in (CHECKSUM_SIZE, LEGACY_CHECKSUM_SIZE):
        if len(value) >= size and verify(value[:size], value[size:]):
            return value[size:]
    return None


def _sizes(meta: dict) -> dict[int, int]:
    return {int(f[2:]): int(v) for f, v in meta.items() if f.startswith(b"s:")}


class RedisBackend(Backend):
    """``redis://host:port/db`` or, with ``cluster=True``, ``redis+cluster://host:port``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 6379,
        db: int = 0,
        *,
        cluster: bool = False,
        password: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        ttl: int | None = None,
        retries: int = 0,
        url: str | None = None,
    ):
        self.host, self.port, self.db, self.cluster = host, port, db, cluster
        self.ttl = ttl
        self.url = redact(url or (f"redis+cluster://{host}:{port}" if cluster else f"redis://{host}:{port}/{db}"))
        self._kw = dict(
            password=password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), retries),  # the loader has a deadline: fail fast, it recomputes
        )
        self._client = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @property
    def client(self):
        """Connected on first use, so opening a store never blocks on the network."""
        if self._client is None:
            with self._errors("connect to"):
                if self.cluster:
                    from redis.cluster import RedisCluster

                    self._client = RedisCluster(host=self.host, port=self.port, **self._kw)
                else:
                    self._client = redis.Redis(host=self.host, port=self.port, db=self.db, **self._kw)
        return self._client

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            raise StoreUnavailable(redact(f"cannot {what} {self.url}: {e}")) from e
        except redis.exceptions.RedisClusterException as e:  # cluster down, no reachable node
            raise StoreUnavailable(redact(f"cannot {what} {self.url}: {e}")) from e
        except redis.exceptions.RedisError as e:
            raise StoreError(redact(f"{self.url} failed to {what} the store: {e}")) from e

    def _call(self, what: str, fn: Callable[[], T], timeout: float | None) -> T:
        """``fn()`` with redis errors translated; with a timeout, never waits longer than it."""
        d = Deadline(timeout)
        if d.end is None:
            with self._errors(what):
                return fn()

        def guarded() -> T:
            with self._errors(what):
                return fn()

        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(CALL_WORKERS, thread_name_prefix="cachegen-redis")
            fut = self._pool.submit(guarded)
        try:
            return fut.result(timeout=d.left())
        except concurrent.futures.TimeoutError:
            fut.cancel()  # still queued behind stalled calls: it never runs
            raise StoreUnavailable(f"{self.url} did not answer within {timeout:.3g} s (cannot {what} it)") from None

    # -- writes --------------------------------------------------------------
    def put_chunks(self, writes: Sequence[ChunkWrite]) -> None:
        keys = [check_key(w.key) for w in writes]
        existing = self.sizes_many(keys)
        now = int(time.time())
        with self._errors("write to"):
            for w, have in zip(writes, existing):
                new = {int(l): d for l, d in w.payloads.items() if int(l) not in have}
                if not new and (not have or not w.ends_context):
                    continue  # nothing new (or nothing stored at all: no meta without sizes)
                p = self.client.pipeline(transaction=True)  # one slot per chunk: MULTI works in a cluster too
                fields: dict[str, int | str] = {"p": w.start, "w": now}
                if w.ends_context:
                    fields["e"] = 1
                if w.prev:
                    fields["q"] = check_key(w.prev)
                for level, data in new.items():
                    p.set(_payload(w.key, level), checksum(data) + data)
                    fields[f"s:{level}"] = len(data)
                p.hset(_meta(w.key), mapping=fields)
                p.set(_tok(w.key), w.tokens)
                if self.ttl:
                    for k in [_meta(w.key), _tok(w.key)] + [_payload(w.key, l) for l in set(new) | set(have)]:
                        p.expire(k, self.ttl)
                p.execute()

    # -- reads ---------------------------------------------------------------
    def get_many(self, items: Sequence[tuple[str, int]], *, timeout: float | None = None) -> list[bytes]:
        names = [_payload(check_key(key), level) for key, level in items]

        def run() -> list:
            p = self.client.pipeline(transaction=False)
            for n in names:
                p.get(n)
            return p.execute()

        raw = self._call("read from", run, timeout)
        out = []
        for (key, level), value in zip(items, raw):
            if value is None:
                raise ChunkNotFound(f"chunk {key[:16]} level {level} is not in {self.url}")
            data = _checked(value)
            if data is None:
                raise CorruptChunk(f"chunk {key[:16]} level {level} in {self.url} fails its checksum")
            out.append(data)
        return out

    def sizes_many(self, keys: Sequence[str], *, timeout: float | None = None) -> list[dict[int, int]]:
        if not keys:
            Deadline(timeout)
            return []
        names = [_meta(check_key(key)) for key in keys]

        def run() -> list:
            p = self.client.pipeline(transaction=False)
            for n in names:
                p.hgetall(n)
            return p.execute()

        return [_sizes(m) for m in self._call("read from", run, timeout)]

    # -- settings --------------------------------------------------------------
    def get_setting(self, name: str, *, timeout: float | None = None) -> str | None:
        value = self._call("read from", lambda: self.client.get(SETTING_PREFIX + name), timeout)
        return None if value is None else value.decode()

    def claim_setting(self, name: str, value: str) -> str:
        with self._errors("write to"):
            self.client.set(SETTING_PREFIX + name, value, nx=True)
            stored = self.client.get(SETTING_PREFIX + name)
        return value if stored is None else stored.decode()

    # -- contexts ----------------------------------------------------------------
    def chunk_rows(self) -> list[ChunkRow]:
        metas = [(k, m) for k, m in self._metas() if _sizes(m)]
        with self._errors("read from"):
            p = self.client.pipeline(transaction=False)
            for k, _ in metas:
                p.strlen(_tok(k))
            lengths = p.execute() if metas else []
        return [
            ChunkRow(
                k, int(m.get(b"p", 0)), int(n) // 4, m.get(b"q", b"").decode(), bool(int(m.get(b"e", 0))), _sizes(m)
            )
            for (k, m), n in zip(metas, lengths)
        ]

    def delete_chunks(self, keys: Sequence[str]) -> int:
        present = [(k, list(s)) for k, s in zip(keys, self.sizes_many(list(keys))) if s]
        self._delete(present)
        return len(present)

    def unmark_end(self, key: str) -> None:
        with self._errors("write to"):
            self.client.hdel(_meta(check_key(key)), "e")

    def tokens(self, key: str) -> bytes:
        with self._errors("read from"):
            value = self.client.get(_tok(check_key(key)))
        if value is None:
            raise ChunkNotFound(f"tokens of chunk {key[:16]} are not in {self.url}")
        return value

    # -- maintenance ---------------------------------------------------------
    def _metas(self) -> list[tuple[str, dict]]:
        with self._errors("scan"):
            names = list(self.client.scan_iter(match=f"{PREFIX}{{*}}:m", count=1000))
            p = self.client.pipeline(transaction=False)
            for n in names:
                p.hgetall(n)
            metas = p.execute() if names else []
        return [(n.decode()[len(PREFIX) + 1 : -3], m) for n, m in zip(names, metas) if m]

    def stats(self) -> StoreStats:
        s = StoreStats()
        for _, m in self._metas():
            if not _sizes(m):
                continue  # a meta without payload sizes (from before empty writes were skipped)
            s.chunks += 1
            s.contexts += int(m.get(b"e", 0))
            merge_levels(s, _sizes(m).items())
        return s

    def evict(self, max_bytes: int | None = None) -> int:
        """Redis evicts on its own (``maxmemory`` and the TTL); this trims to ``max_bytes`` if given,
        oldest writes first and a context's tail before its head."""
        if max_bytes is None:
            return 0
        metas = self._metas()
        total = sum(sum(_sizes(m).values()) for _, m in metas)
        metas.sort(key=lambda km: (int(km[1].get(b"w", 0)), -int(km[1].get(b"p", 0))))
        victims = []
        for key, m in metas:
            if total <= max_bytes:
                break
            victims.append((key, list(_sizes(m))))
            total -= sum(_sizes(m).values())
        self._delete(victims)
        return len(victims)

    def _delete(self, chunks: list[tuple[str, list[int]]]) -> None:
        with self._errors("delete from"):
            for key, levels in chunks:
                p = self.client.pipeline(transaction=True)
                p.delete(_meta(key))  # meta first, inside MULTI: no reader sees sizes without payloads
                p.delete(_tok(key))
                for l in levels:
                    p.delete(_payload(key, l))
                p.execute()

    def clear(self) -> int:
        n = 0
        with self._errors("clear"):
            names = list(self.client.scan_iter(match=f"{PREFIX}{{*}}:*", count=1000))
            p = self.client.pipeline(transaction=False)
            for name in names:
                p.delete(name)
                n += name.endswith(b":m")
            for name in self.client.scan_iter(match=f"{SETTING_PREFIX}chunk_tokens:*", count=1000):
                p.delete(name)  # an empty store takes any chunk size
                names.append(name)
            if names:
                p.execute()
        return n

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(redis.exceptions.RedisError):
                self._client.close()
            self._client = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
