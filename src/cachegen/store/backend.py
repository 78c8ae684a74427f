"""The interface every store backend implements, and what it reports.

A backend stores, per chunk key: the chunk's token ids (what recompute needs),
one payload per quality level, and each payload's size (readable without the
payload, for the streaming planner). A payload is visible only once it and its
size are both in place, and every read verifies a checksum, so a backend never
returns torn or wrong bytes: it returns the right bytes or raises
:class:`~cachegen.errors.ChunkNotFound`, :class:`~cachegen.errors.StoreUnavailable`
or :class:`~cachegen.errors.CorruptChunk`.
"""

from __future__ import annotations

import hashlib
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cachegen.errors import StoreUnavailable

CHECKSUM_SIZE = 4  # a payload's CRC-32 (:func:`checksum`)
LEGACY_CHECKSUM_SIZE = 16  # blake2b-128, written before CRC-32; still verified on read


class Deadline:
    """The end of a store call that was given ``timeout`` seconds (``None``: no limit).

    A timeout of zero or less means the caller has no time left: the call
    fails at once with ``StoreUnavailable``, as one that ran out would."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self.end = None if timeout is None else time.monotonic() + timeout
        self.left()

    def left(self) -> float | None:
        """Seconds left; raises ``StoreUnavailable`` once none are."""
        if self.end is None:
            return None
        left = self.end - time.monotonic()
        if left <= 0:
            raise StoreUnavailable(f"the store call ran out of its {self.timeout:.3g} s")
        return left

    @property
    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


def checksum(data: bytes) -> bytes:
    """A payload's checksum: its CRC-32, 4 bytes little-endian.

    Why not a cryptographic hash: the checksum is there to catch torn writes, truncation and bit
    rot, which CRC-32 detects (every burst of up to 32 bits, anything else but 1 in 2^32); whoever
    can write a payload can write its checksum too, and a payload stored under another key is
    caught by the codec (each chunk carries its key's digest). blake2b-128 took 3.6-5.4 ms over 3 MB
    here, more than the 2.4 ms the transfer takes at 10 Gbit/s, and every fetch paid it; CRC-32
    takes 0.8-1.4 ms (``tools/time_checksum.py``)."""
    return zlib.crc32(data).to_bytes(CHECKSUM_SIZE, "little")


def verify(digest: bytes, data: bytes) -> bool:
    """Whether ``data`` matches ``digest``: a CRC-32 (:func:`checksum`), or the blake2b-128 of a
    payload written by an older cachegen (told apart by its length)."""
    if len(digest) == CHECKSUM_SIZE:
        return checksum(data) == digest
    if len(digest) == LEGACY_CHECKSUM_SIZE:
        return hashlib.blake2b(data, digest_size=LEGACY_CHECKSUM_SIZE).digest() == digest
    return False


@dataclass
class ChunkWrite:
    """One chunk to store: its key, its token ids (uint32 LE bytes) and payloads by level."""

    key: str
    tokens: bytes
    payloads: Mapping[int, bytes]
    start: int = 0  # first token position, used to evict a context's tail before its head
    ends_context: bool = False  # the last chunk of an ingested context (counted by stats)
    prev: str = ""  # the key of the chunk before it in its context ("" for the first), for `store ls`


@dataclass
class ChunkRow:
    """What a backend knows of one stored chunk, without its payloads (for listing contexts)."""

    key: str
    start: int
    num_tokens: int
    prev: str
    ends_context: bool
    sizes: dict[int, int]


@dataclass
class LevelStats:
    chunks: int = 0
    bytes: int = 0


@dataclass
class StoreStats:
    """What ``cachegen store stats`` prints."""

    contexts: int = 0  # ingested contexts whose last chunk is still stored
    chunks: int = 0
    bytes: int = 0  # payload bytes, all levels
    levels: dict[int, LevelStats] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "contexts": self.contexts,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "levels": {str(l): {"chunks": s.chunks, "bytes": s.bytes} for l, s in sorted(self.levels.items())},
        }


class Backend(ABC):
    """A place to keep chunks; chosen by URL with :func:`cachegen.store.open_backend`."""

    url: str  # with any password masked (see ``cachegen.store.url.redact``)
    local = False  # True when calls never wait on a network (checks may run when the store opens)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @abstractmethod
    def put_chunks(self, writes: Sequence[ChunkWrite]) -> None:
        """Store chunks; levels already present are kept as they are (first copy wins)."""

    def put_chunk(self, key: str, tokens: bytes, payloads: Mapping[int, bytes], **kw) -> None:
        self.put_chunks([ChunkWrite(key, tokens, payloads, **kw)])

    @abstractmethod
    def get_many(self, items: Sequence[tuple[str, int]], *, timeout: float | None = None) -> list[bytes]:
        """Payloads of ``(key, level)`` pairs, fetched together; checksums verified.

        Raises ``StoreUnavailable`` rather than take more than ``timeout`` seconds."""

    def get(self, key: str, level: int, *, timeout: float | None = None) -> bytes:
        return self.get_many([(key, level)], timeout=timeout)[0]

    @abstractmethod
    def sizes_many(self, keys: Sequence[str], *, timeout: float | None = None) -> list[dict[int, int]]:
        """Payload size per level for each key; ``{}`` for a key that is not stored."""

    def sizes(self, key: str, *, timeout: float | None = None) -> dict[int, int]:
        return self.sizes_many([key], timeout=timeout)[0]

    def has(self, key: str) -> bool:
        return bool(self.sizes(key))

    def ping(self, *, timeout: float | None = None) -> None:
        """One cheap read: raises ``StoreUnavailable`` if the store does not answer within ``timeout``."""
        self.sizes_many(["0" * 64], timeout=timeout)

    @abstractmethod
    def tokens(self, key: str) -> bytes:
        """The chunk's token ids (uint32 LE bytes); raises ChunkNotFound."""

    @abstractmethod
    def stats(self) -> StoreStats: ...

    @abstractmethod
    def get_setting(self, name: str, *, timeout: float | None = None) -> str | None:
        """A value recorded with the store (e.g. a namespace's chunk size), or ``None``."""

    @abstractmethod
    def claim_setting(self, name: str, value: str) -> str:
        """Record ``value`` unless a value is recorded already; returns the recorded one."""

    @abstractmethod
    def chunk_rows(self) -> list[ChunkRow]:
        """Every stored chunk (with at least one payload), without payloads."""

    @abstractmethod
    def delete_chunks(self, keys: Sequence[str]) -> int:
        """Remove these chunks, all levels; returns how many were stored."""

    @abstractmethod
    def unmark_end(self, key: str) -> None:
        """The chunk no longer ends an ingested context (another context goes on through it)."""

    @abstractmethod
    def evict(self, max_bytes: int | None = None) -> int:
        """Drop least recently used chunks until at most ``max_bytes`` remain (default: the
        backend's cap, if any); also removes debris of crashed writers. Returns chunks dropped."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every chunk of this store; returns how many."""

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing to release
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def merge_levels(stats: StoreStats, sizes: Iterable[tuple[int, int]]) -> None:
    for level, size in sizes:
        s = stats.levels.setdefault(level, LevelStats())
        s.chunks += 1
        s.bytes += size
        stats.bytes += size
