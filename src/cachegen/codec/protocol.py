"""The one chunk-codec protocol every codec of the project implements.

The store encodes a context's chunks through it, the loader decodes them,
and the benchmarks compare codecs through it: :class:`cachegen.codec.Codec`,
the baselines in ``cachegen.bench.baselines`` and the test fakes all satisfy it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cachegen.kv import KVCache


@runtime_checkable
class ChunkCodec(Protocol):
    """Chunks of KV cache to bytes and back.

    ``levels`` are the levels :meth:`encode` accepts (0 is lossless where a
    codec has it). ``key`` is the store's chunk key (hex, ``ChunkRef.key``):
    the chunk carries a digest of it, covered by its checksum, and
    :meth:`decode` with a ``key`` raises :class:`cachegen.errors.KeyMismatch`
    (a :class:`~cachegen.errors.CorruptChunk`) when the chunk was written for
    another key, so a swapped or foreign chunk is never used."""

    @property
    def levels(self) -> tuple[int, ...]: ...

    def encode(self, kv: KVCache, level: int, *, key: str | None = None) -> bytes: ...

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache: ...
