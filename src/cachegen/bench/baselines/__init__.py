"""Baseline KV codecs for the evaluation harness, each a :class:`cachegen.codec.ChunkCodec`.

Every codec turns a :class:`~cachegen.kv.KVCache` (usually one 256-token
chunk) into real bytes and back. Sizes are ``len(bytes)``: headers, scales,
zero points, probability tables and stream offsets are all inside, so
``bits_per_value = 8 * len(bytes) / kv.num_values`` is honest. Nothing is
pickled (:mod:`._format`).

Codecs (the ``name`` is the contract used in JSON results):

- ``fp16`` / ``bf16``: the raw KV cast to 16 bits (:mod:`.raw`).
- ``uniform8`` / ``uniform4``: asymmetric min/max per channel (per layer, K/V,
  head and channel, over the chunk's tokens), fp16 min and step (:mod:`.uniform`).
- ``kivi2`` / ``kivi4``: KIVI-style asymmetric quantization; K per channel in
  groups of 32 tokens, V per token in groups of 32 channels; fp16 scale and
  zero per group (:mod:`.kivi`).
- ``cachegen-released`` (levels 1, 2, 3): CacheGen as released with LMCache,
  see :class:`CacheGenReleasedCodec` and ``docs/evaluation.md`` (:mod:`.released`).
- ``cachegen``: the project codec, :class:`cachegen.codec.Codec` itself.

The harness compares :class:`Variant` s: one codec at one level (one row of
results). Text recompute (``recompute``) is not a codec: the harness prefills it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from cachegen.bench.baselines._format import (
    CHUNK_TOKENS,
    FORMAT_VERSION,
    MAGIC,
    _read_header,
    header_size,
    pack_bits,
    packed_len,
    unpack_bits,
)
from cachegen.bench.baselines.kivi import KiviCodec
from cachegen.bench.baselines.raw import RawCodec
from cachegen.bench.baselines.released import (
    CDF_ENTRIES,
    CDF_TOTAL,
    RANS_PRECISION,
    RELEASED_LEVELS,
    CacheGenReleasedCodec,
    ReleasedBins,
    _cdf_to_freqs,
    released_cdf,
    released_dequantize,
    released_quantize,
)
from cachegen.bench.baselines.uniform import UniformCodec
from cachegen.codec import ChunkCodec
from cachegen.codec.protocol import takes_context_end
from cachegen.errors import ConfigError
from cachegen.kv import KVCache

log = logging.getLogger(__name__)

__all__ = [
    "BASELINE_NAMES",
    "CDF_ENTRIES",
    "CDF_TOTAL",
    "CHUNK_TOKENS",
    "DEFAULT_BASELINES",
    "FORMAT_VERSION",
    "MAGIC",
    "RANS_PRECISION",
    "RELEASED_LEVELS",
    "CacheGenReleasedCodec",
    "KiviCodec",
    "RawCodec",
    "ReleasedBins",
    "UniformCodec",
    "Variant",
    "_cdf_to_freqs",
    "_read_header",
    "baseline",
    "header_size",
    "make_codecs",
    "pack_bits",
    "packed_len",
    "project_codec",
    "released_cdf",
    "released_dequantize",
    "released_quantize",
    "roundtrip_chunks",
    "unpack_bits",
]

BASELINE_NAMES = ("fp16", "bf16", "uniform8", "uniform4", "kivi2", "kivi4", "cachegen-released")
DEFAULT_BASELINES = ("fp16", "uniform8", "uniform4", "kivi4", "kivi2", "cachegen-released")


class Variant(NamedTuple):
    """One codec at one level: a row of the harness's results (not a codec of its own)."""

    codec: ChunkCodec
    level: int

    @property
    def name(self) -> str:
        return getattr(self.codec, "name", type(self.codec).__name__)

    @property
    def row_level(self) -> int | None:
        """The level as results report it: None for a codec with a single setting."""
        return None if len(self.codec.levels) == 1 else self.level

    @property
    def label(self) -> str:
        """``name`` or ``name/Lk`` for display."""
        return self.name if self.row_level is None else f"{self.name}/L{self.level}"

    def encode_context(self, kv: KVCache, chunk_tokens: int) -> list[bytes]:
        """Every ``chunk_tokens``-token chunk of a context's KV, as a store writes them: a codec
        that reads where the context ends (:func:`~cachegen.codec.protocol.takes_context_end`)
        is told ``kv.end``, where the harness's continuation or question follows."""
        if takes_context_end(self.codec):
            return [self.codec.encode(c, self.level, context_end=kv.end) for c in kv.chunks(chunk_tokens)]
        return [self.codec.encode(c, self.level) for c in kv.chunks(chunk_tokens)]


def baseline(name: str) -> ChunkCodec:
    """The baseline codec called ``name``."""
    if name in ("fp16", "bf16"):
        return RawCodec(name)
    if name.startswith("uniform") and name[7:].isdigit():
        return UniformCodec(int(name[7:]))
    if name.startswith("kivi") and name[4:].isdigit():
        return KiviCodec(int(name[4:]))
    if name == "cachegen-released":
        return CacheGenReleasedCodec()
    raise ConfigError(f"unknown baseline {name!r}: use one of {', '.join(BASELINE_NAMES)}")


def project_codec(loaded_model) -> ChunkCodec:
    """:class:`cachegen.codec.Codec` with the model's profile (calibrated once and cached)."""
    from cachegen.calibrate import load_or_calibrate
    from cachegen.codec import Codec

    return Codec(load_or_calibrate(loaded_model), loaded_model.fingerprint)


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``name`` or ``name:level`` -> (name, level or None); refuses an unknown codec or level.

    Needs no model (the project codec's levels are fixed), so the CLI checks ``--codecs`` with it
    before loading anything."""
    from cachegen.codec.profile import LEVELS

    name, _, lv = spec.partition(":")
    if lv and not lv.isdigit():
        raise ConfigError(f"bad codec spec {spec!r}: the level after ':' is a number")
    levels = LEVELS if name == "cachegen" else baseline(name).levels
    if lv and int(lv) not in levels:
        raise ConfigError(f"{name} has no level {lv} (levels: {', '.join(map(str, levels))})")
    return name, int(lv) if lv else None


def check_specs(names: Sequence[str]) -> None:
    """Refuse a bad ``--codecs`` list (one ConfigError naming the first bad entry)."""
    for spec in names:
        parse_spec(spec)


def make_codecs(names: Sequence[str], loaded_model=None) -> list[Variant]:
    """Variants for ``names``: ``cachegen`` = the project codec at every lossy level, a baseline at each
    of its levels; ``name:level`` picks one level."""
    from cachegen.codec import LEVELS

    out: list[Variant] = []
    for spec in names:
        name, level = parse_spec(spec)
        if name == "cachegen":
            if loaded_model is None:
                raise ConfigError("the project codec needs a loaded model (for its profile)")
            codec, levels = project_codec(loaded_model), LEVELS
        else:
            codec = baseline(name)
            levels = codec.levels
        if level is not None:
            levels = (level,)
        out += [Variant(codec, lv) for lv in levels]
    return out


def roundtrip_chunks(v: Variant, kv: KVCache, chunk_tokens: int = CHUNK_TOKENS) -> tuple[KVCache, int, list[bytes]]:
    """Encode ``kv`` in ``chunk_tokens`` chunks as stored; returns (decoded KV, total bytes, blobs)."""
    blobs = [v.codec.encode(c, v.level) for c in kv.chunks(chunk_tokens)]
    back = KVCache.concat([v.codec.decode(b) for b in blobs])
    back.meta = dict(kv.meta)
    return back, sum(len(b) for b in blobs), blobs
