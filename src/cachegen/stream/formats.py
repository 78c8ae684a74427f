"""A ladder of chunk formats from several codecs, as one codec the loader plans over.

The loader picks, per chunk, one of the levels its codec exposes (or text).
:class:`FormatLadder` makes the levels of several codecs one such list, so the
same planner can weigh a compact format that is slow to decode (the project
codec's levels) against a big one that is cheap to decode (raw 8- or 16-bit KV):
on a fast link the second ends a load sooner, on a slow one the first. The
store keeps each chunk at every rung (``put_context(..., levels=ladder.levels)``)
and the cost model is calibrated per rung (:func:`~cachegen.stream.costs.calibrate_decode`
over ``ladder.levels``), exactly as for a single codec.

Each payload is the rung's own payload after one byte naming the rung, so the
ladder decodes a chunk without being told its level; a wrong byte sends the
payload to a codec that refuses it (every codec checks its own header and
checksum), and the loader then recomputes that chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import KVCache
from cachegen.stream.compute_rates import decoder_family

if TYPE_CHECKING:  # importing the stream package loads no codec
    from cachegen.codec import ChunkCodec

log = logging.getLogger(__name__)

MAX_RUNGS = 256  # one byte names the rung


@dataclass(frozen=True)
class Rung:
    """One format of the ladder: ``codec`` at ``level``, shown as ``label`` (e.g. ``cachegen/L3``, ``uniform8``)."""

    label: str
    codec: ChunkCodec
    level: int


class FormatLadder:
    """A :class:`~cachegen.codec.ChunkCodec` whose level ``i`` is ``rungs[i]`` (give them best
    quality first: the adaptive policy reads a lower level as better; the ``"fastest"`` policy
    breaks ties that way). It decodes into a preallocated cache where the rung's codec can
    (:class:`~cachegen.codec.protocol.DecodesInto`), with a copy where it cannot."""

    name = "ladder"

    def __init__(self, rungs: Sequence[Rung]):
        if not rungs:
            raise ConfigError("a format ladder needs at least one rung")
        if len(rungs) > MAX_RUNGS:
            raise ConfigError(f"a format ladder has at most {MAX_RUNGS} rungs")
        labels = [r.label for r in rungs]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"rung labels must be distinct: {labels}")
        for r in rungs:
            if r.level not in r.codec.levels:
                raise ConfigError(f"rung {r.label}: its codec has no level {r.level} (levels {r.codec.levels})")
        self.rungs = tuple(rungs)

    @property
    def levels(self) -> tuple[int, ...]:
        return tuple(range(len(self.rungs)))

    def label(self, level: int) -> str:
        """The rung's label (what a result row calls the format)."""
        return self._rung(level).label

    def level_of(self, label: str) -> int:
        for i, r in enumerate(self.rungs):
            if r.label == label:
                return i
        raise ConfigError(f"no rung {label!r} (rungs: {', '.join(r.label for r in self.rungs)})")

    def _rung(self, level: int) -> Rung:
        if not 0 <= level < len(self.rungs):
            raise ConfigError(f"no level {level}: the ladder has levels 0..{len(self.rungs) - 1}")
        return self.rungs[level]

    def decoder_family(self, level: int) -> str:
        """The rung's codec and, where that codec names them, its decoder family (a
        :class:`~cachegen.codec.protocol.NamesDecoders`): the project codec's lossy rungs are one
        family; each other codec's rung is its own."""
        r = self._rung(level)
        return f"{getattr(r.codec, 'name', type(r.codec).__name__)}/{decoder_family(r.codec, r.level)}"

    encodes_in_context = True  # passed on to the rungs whose codecs take it

    def encode(self, kv: KVCache, level: int, *, key: str | None = None, context_end: int | None = None) -> bytes:
        from cachegen.codec.protocol import takes_context_end

        r = self._rung(level)
        if context_end is not None and takes_context_end(r.codec):
            return bytes([level]) + r.codec.encode(kv, r.level, key=key, context_end=context_end)
        return bytes([level]) + r.codec.encode(kv, r.level, key=key)

    def _split(self, data: bytes) -> tuple[Rung, memoryview]:
        if len(data) < 2:
            raise CorruptChunk("ladder chunk too short")
        tag = data[0]
        if tag >= len(self.rungs):
            raise CorruptChunk(f"ladder chunk names rung {tag}, the ladder has {len(self.rungs)}")
        return self.rungs[tag], memoryview(data)[1:]

    # The rung's codec reads its payload from a view (no copy of a chunk per decode): the
    # project's codecs take ``bytes | memoryview`` (``Reader``, ``parse_header``).
    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        r, body = self._split(data)
        return r.codec.decode(cast(bytes, body), key=key)

    def layout(self, data: bytes) -> KVCache | None:
        """The chunk's start and layout from its rung's header, where the rung's codec reads it (a
        :class:`~cachegen.codec.protocol.ReadsLayout`); None where it does not."""
        r, body = self._split(data)
        read = getattr(r.codec, "layout", None)
        return read(cast(bytes, body)) if callable(read) else None

    def decode_into(self, data: bytes, out: KVCache, *, key: str | None = None) -> KVCache:
        from cachegen.codec.protocol import decode_into

        r, body = self._split(data)
        return decode_into(r.codec, cast(bytes, body), out, key=key)

    def decode_many_into(
        self, datas: Sequence[bytes], out: KVCache, sizes: Sequence[int], *, keys: Sequence[str | None] | None = None
    ) -> KVCache:
        """Consecutive chunks of ``sizes`` tokens into ``out``, which they tile (a
        :class:`~cachegen.codec.protocol.DecodesManyInto`): each run of chunks whose rungs share a
        codec goes to it in one call (its ``decode_many_into`` where it has one), so chunks at
        several levels of the project codec still decode together."""
        from cachegen.codec.protocol import DecodesManyInto, check_tiling, decode_many_into

        check_tiling(datas, out, sizes, keys)
        split = [self._split(d) for d in datas]
        runs: list[list[int]] = []
        for j, (r, _) in enumerate(split):
            prev = split[runs[-1][-1]][0].codec if runs else None
            if prev is r.codec and isinstance(r.codec, DecodesManyInto):
                runs[-1].append(j)
            else:
                runs.append([j])
        pos = out.start
        for run in runs:
            n = sum(sizes[j] for j in run)
            decode_many_into(
                split[run[0]][0].codec,
                [cast(bytes, split[j][1]) for j in run],
                out if n == out.num_tokens else out.slice(pos, pos + n),
                [sizes[j] for j in run],
                keys=[keys[j] for j in run] if keys is not None else None,
            )
            pos += n
        return out
