"""The one chunk-codec protocol every codec of the project implements.

The store encodes a context's chunks through it, the loader decodes them,
and the benchmarks compare codecs through it: :class:`cachegen.codec.Codec`,
the baselines in ``cachegen.bench.baselines`` and the test fakes all satisfy it.

A codec may also decode straight into a slice of a preallocated cache
(:class:`DecodesInto`); :func:`decode_into` uses that where a codec has it and
falls back to ``decode`` plus a copy where it does not, so every codec works with
the loader's preallocated cache. A codec may decode several consecutive chunks in
one call (:class:`DecodesManyInto`), sharing per-call costs; :func:`decode_many_into`
falls back to one :func:`decode_into` per chunk. A codec may say which of its
levels share decoding code (:class:`NamesDecoders`), and read a chunk's layout from its
header without decoding it (:class:`ReadsLayout`), so the loader allocates its cache before the
first chunk's decode and decodes that chunk into it too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeGuard, runtime_checkable

import torch

from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import KVCache, KVLayer, LayerKind


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


@runtime_checkable
class DecodesInto(Protocol):
    """A codec that writes a decoded chunk into ``out``: a view of the chunk's token range in a
    preallocated cache (:meth:`cachegen.kv.KVCache.allocate`, then ``.slice``), cast to its dtype.

    It raises :class:`~cachegen.errors.CorruptChunk` when the chunk's token range or layout is
    not ``out``'s. A chunk that fails mid-way may leave ``out`` partly written: the caller must
    not use that range (the loader recomputes it)."""

    def decode_into(self, data: bytes, out: KVCache, *, key: str | None = None) -> KVCache: ...


@runtime_checkable
class ReadsLayout(Protocol):
    """A codec that reads a chunk's start and layer layout (kinds, windows, heads, K and V widths)
    from its header, without decoding it.

    :meth:`layout` returns a cache of no tokens with that layout, the chunk's start, and the dtype
    and ``meta`` that ``decode`` gives, or None when this chunk's format cannot tell; it raises
    :class:`~cachegen.errors.CorruptChunk` for a header ``decode`` would refuse. Why: the loader
    allocates its cache from the first chunk's layout and decodes that chunk into it, instead of
    decoding it into a chunk-sized cache and copying (a first 8-bit chunk of SmolLM2 took 10-19 ms
    that way, against 3-7 ms decoded into the cache)."""

    def layout(self, data: bytes) -> KVCache | None: ...


def empty_layers_cache(
    layers: Iterable[tuple[LayerKind, int | None, int, int, int]],
    start: int,
    dtype: torch.dtype,
    meta: dict | None = None,
) -> KVCache:
    """A cache of no tokens with ``layers``' layout: ``(kind, window, heads, k_dim, v_dim)`` each
    (what :meth:`ReadsLayout.layout` returns)."""
    return KVCache(
        [
            KVLayer(torch.empty((h, 0, dk), dtype=dtype), torch.empty((h, 0, dv), dtype=dtype), kind, window)
            for kind, window, h, dk, dv in layers
        ],
        start=start,
        meta=dict(meta or {}),
    )


@runtime_checkable
class DecodesManyInto(Protocol):
    """A codec that decodes consecutive chunks ``datas`` of ``sizes`` tokens into ``out``, which
    they tile in order, in one call: the values :meth:`DecodesInto.decode_into` gives each on its range.
    ``keys``: per chunk, as ``decode_into``'s ``key``. It raises
    :class:`~cachegen.errors.CorruptChunk` as ``decode_into`` does, and also when the chunks do
    not tile ``out``; on a failure ``out`` may be partly written (the loader then decodes the
    chunks one by one, to find which one failed)."""

    def decode_many_into(
        self, datas: Sequence[bytes], out: KVCache, sizes: Sequence[int], *, keys: Sequence[str | None] | None = None
    ) -> KVCache: ...


@runtime_checkable
class NamesDecoders(Protocol):
    """A codec that says which of its levels share decoding code: two levels with the same
    ``decoder_family`` run alike on a machine, whatever their calibrated times. The loader learns
    one correction per family (:class:`cachegen.stream.ComputeRates`), so that the noise of a few
    decodes cannot rank a bigger level above a smaller one that decodes as fast. A codec without
    it is taken to have one decoder per level."""

    def decoder_family(self, level: int) -> str: ...


@runtime_checkable
class EncodesInContext(Protocol):
    """A codec whose ``encode`` also takes ``context_end``: where the context that holds the chunk
    ends (the continuation starts there), so it can spend its bits on the tokens the next ones
    will attend to most (:class:`cachegen.codec.Codec`: ``docs/codec.md``). The chunk decodes
    the same without it; writers that know the end pass it (:func:`takes_context_end`)."""

    encodes_in_context: bool

    def encode(self, kv: KVCache, level: int, *, key: str | None = None, context_end: int | None = None) -> bytes: ...


def takes_context_end(codec: object) -> TypeGuard[EncodesInContext]:
    """Whether ``codec.encode`` takes ``context_end`` (it says so: ``encodes_in_context = True``)."""
    return getattr(codec, "encodes_in_context", False) is True


def check_fits(kv: KVCache, out: KVCache, what: str = "chunk") -> None:
    """:class:`CorruptChunk` unless ``kv`` covers exactly ``out``'s token range with its layout."""
    if kv.start != out.start or kv.num_tokens != out.num_tokens:
        raise CorruptChunk(f"{what} decoded to tokens [{kv.start}, {kv.end}), expected [{out.start}, {out.end})")
    if not out.same_layout(kv):
        raise CorruptChunk(f"{what} has a different layout from the cache it is written into")


def decode_into(codec: ChunkCodec, data: bytes, out: KVCache, *, key: str | None = None) -> KVCache:
    """Decode ``data`` into ``out`` with ``codec``'s own ``decode_into``, else ``decode`` and a copy."""
    if isinstance(codec, DecodesInto):
        return codec.decode_into(data, out, key=key)
    kv = codec.decode(data, key=key)
    check_fits(kv, out)
    out.write(kv)
    return out


def check_tiling(datas: Sequence[bytes], out: KVCache, sizes: Sequence[int], keys: Sequence[str | None] | None) -> None:
    """:class:`ConfigError` unless chunks of ``sizes`` tokens, one per payload (and key), tile ``out``."""
    if len(sizes) != len(datas) or any(n < 0 for n in sizes) or sum(sizes) != out.num_tokens:
        raise ConfigError(f"chunks of {list(sizes)} tokens do not tile tokens [{out.start}, {out.end})")
    if keys is not None and len(keys) != len(datas):
        raise ConfigError(f"{len(keys)} keys for {len(datas)} chunks")


def decode_many_into(
    codec: ChunkCodec,
    datas: Sequence[bytes],
    out: KVCache,
    sizes: Sequence[int],
    *,
    keys: Sequence[str | None] | None = None,
) -> KVCache:
    """Decode consecutive chunks ``datas`` of ``sizes`` tokens, which tile ``out`` in order, with
    ``codec``'s own ``decode_many_into``, else one :func:`decode_into` per chunk's range."""
    check_tiling(datas, out, sizes, keys)
    if isinstance(codec, DecodesManyInto):
        return codec.decode_many_into(datas, out, sizes, keys=keys)
    pos = out.start
    for j, (data, n) in enumerate(zip(datas, sizes, strict=True)):
        part = out if n == out.num_tokens else out.slice(pos, pos + n)
        decode_into(codec, data, part, key=keys[j] if keys else None)
        pos += n
    return out
