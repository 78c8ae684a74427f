"""The codec: KVCache <-> bytes, lossy (levels 1..7) or lossless (level 0).

Lossy path per section (layer x K/V): the first ``n_sink`` tokens of the
context (attention sink) are stored exactly; the rest go through the
profile's transform (mean, per-head PCA basis), a uniform quantizer with a
step per basis component (weighted by that component's Fisher sensitivity),
and static rANS with the profile's tables: one interleaved word stream per
section, 16 shared states. Lossless path: the raw bytes of each value, split
into byte planes, rANS-coded with per-chunk tables (one stream per column).
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import pairwise
from typing import cast

import numpy as np
import torch

from cachegen.codec import importance, quant, rans
from cachegen.codec.container import (
    FORMAT_VERSION,
    MAX_POSITION,
    ChunkHeader,
    LayerShape,
    Reader,
    check_key,
    key_digest,
    pack_header,
    parse_header,
    section_bytes,
)
from cachegen.codec.fit import calibrate
from cachegen.codec.profile import LEVELS, PRECISION, TABLE_PAD, Profile
from cachegen.codec.protocol import check_tiling, empty_layers_cache
from cachegen.codec.transform import forward_section, inverse_section_into
from cachegen.errors import CodecError, ConfigError, CorruptChunk, ProfileMismatch
from cachegen.kv import KVCache, KVLayer

LOSSLESS = 0
DEFAULT_MAX_TOKENS = 1 << 15  # per chunk: beyond the context of the models served here (chunks are 256)
MAX_VALUES_NO_PROFILE = 1 << 27  # per chunk, for a codec without a profile (no model layout to check against)
# Lossless byte-plane tables give no symbol more than this frequency (of 4096): every symbol
# costs >= 1/8 bit, so a chunk's declared size is bounded by its payload (at most 64 values
# per payload byte and plane) whatever its own table says (a table with p = 1 bounds nothing).
LOSSLESS_MAX_FREQ = int((1 << PRECISION) * 2 ** (-1 / 8))
LOSSLESS_MIN_BITS = 1 / 8


def _bytes_view(x: torch.Tensor) -> np.ndarray:
    """Raw bytes of a tensor as uint8 (no bf16 in numpy: go through int views)."""
    x = x.contiguous()
    if x.numel() == 0:
        return np.empty((*x.shape, x.element_size()), dtype=np.uint8)
    iv = {4: torch.int32, 2: torch.int16}[x.element_size()]
    return x.view(iv).numpy().view(np.uint8)


def _from_bytes(b: np.ndarray | memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    iv = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    arr = np.frombuffer(b, dtype=np.uint8).copy()
    if arr.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(arr).view(iv).view(dtype).reshape(shape)


class Codec:
    """Encode/decode KV chunks (a :class:`~cachegen.codec.ChunkCodec`). ``profile=None`` makes chunks carry their own tables.

    ``max_tokens`` bounds every chunk this codec encodes or decodes: a chunk that claims
    more is refused from its header, before anything is allocated (with a profile the
    layout must be the profile's too, so a chunk's memory is bounded by the model's)."""

    name = "cachegen"
    jobs_per_thread = 2  # lossy decode jobs per pool thread (:func:`decode_jobs`)

    def __init__(
        self,
        profile: Profile | None = None,
        model_fingerprint: str = "",
        threads: int = 2,
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ):
        if not 1 <= max_tokens <= MAX_POSITION:
            raise ConfigError(f"max_tokens must be 1..{MAX_POSITION}, not {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.profile = profile
        self.model_fingerprint = model_fingerprint or (profile.model_fingerprint if profile else "")
        if (
            profile is not None
            and model_fingerprint
            and profile.model_fingerprint
            and model_fingerprint != profile.model_fingerprint
        ):
            raise ProfileMismatch(f"profile is for model {profile.model_fingerprint}, codec for {model_fingerprint}")
        self.threads = max(1, int(threads))
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def _map(self, fn, items):
        return self._pool.map(fn, items) if self._pool else map(fn, items)

    # -- encode ----------------------------------------------------------------
    @property
    def levels(self) -> tuple[int, ...]:
        """Levels :meth:`encode` accepts: lossless and the profile's (every lossy level without one)."""
        return (LOSSLESS, *(sorted(self.profile.levels) if self.profile is not None else quant_levels()))

    def decoder_family(self, level: int) -> str:
        """Which code decodes ``level`` (a :class:`~cachegen.codec.protocol.NamesDecoders`): every
        lossy level runs the same dequantize, inverse transform and rANS decoder, so the loader
        learns one speed for them all; lossless decodes otherwise."""
        return "lossless" if level == LOSSLESS else "lossy"

    # encode() reads where the context ends (a :class:`~cachegen.codec.protocol.EncodesInContext`)
    encodes_in_context = True

    def encode(self, kv: KVCache, level: int, *, key: str | None = None, context_end: int | None = None) -> bytes:
        """``kv`` as one chunk at ``level``; ``key`` is the store's chunk key the chunk is bound to.

        ``context_end``: the position the context that holds ``kv`` ends at (its length: the
        continuation starts there), when known. Tokens near it get finer steps and distant ones
        coarser (the profile's predictor for a known end); the decoder needs nothing of it."""
        dtype = kv.dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ConfigError(f"unsupported dtype {dtype}")
        if any(l.k.dtype != dtype or l.v.dtype != dtype for l in kv.layers):
            raise ConfigError("all layers must share one dtype")
        if kv.num_tokens > self.max_tokens:
            raise ConfigError(f"a chunk of {kv.num_tokens} tokens is over this codec's max_tokens ({self.max_tokens})")
        if not 0 <= kv.start <= MAX_POSITION - kv.num_tokens:
            raise ConfigError(f"chunk start {kv.start} out of range")
        if context_end is not None and not (
            isinstance(context_end, int) and not isinstance(context_end, bool) and kv.end <= context_end <= MAX_POSITION
        ):
            raise ConfigError(
                f"context_end {context_end!r} must be an int from the chunk's end ({kv.end}) to {MAX_POSITION}"
            )
        if not all(all_finite(t) for l in kv.layers for t in (l.k, l.v)):
            raise CodecError("the KV holds NaN or Inf: no chunk carries non-finite values (a decoder refuses them)")
        layers = tuple(
            LayerShape(l.kind, l.window, int(l.k.shape[0]), int(l.k.shape[2]), int(l.v.shape[2])) for l in kv.layers
        )
        xs = [t for l in kv.layers for t in (l.k, l.v)]
        inline: bytes | None = None
        pid = ""
        if level == LOSSLESS:
            sink = 0
            bodies = list(self._map(_encode_lossless, xs))
        else:
            if self.profile is not None:
                prof = self.profile
                prof.check_layout(kv)
                if level not in prof.levels:
                    raise ConfigError(f"level {level} not in the profile (has {sorted(prof.levels)})")
                pid = prof.id
            else:
                if level not in quant_levels():
                    raise ConfigError(f"unknown level {level}; lossy levels are {quant_levels()}")
                prof = calibrate([kv], self.model_fingerprint, use_pca=False, levels=[level], n_sink=4)
                inline = prof.to_bytes()
            sink = max(0, min(kv.num_tokens, prof.n_sink - kv.start))
            lp = prof.levels[level]
            tables, cls = lp.padded_tables(), lp.classes(prof.sections)
            u_tables = prof.u_tables() if prof.u_freqs is not None else None
            end = context_end if all(sp.imp_end is not None for sp in prof.sections if sp.imp is not None) else None
            jobs = [
                (
                    kv.layers[li],
                    prof.sections[2 * li : 2 * li + 2],
                    lp.steps[2 * li : 2 * li + 2],
                    cls[2 * li : 2 * li + 2],
                    tables,
                    u_tables,
                    sink,
                    kv.start,
                    end,
                )
                for li in range(len(kv.layers))
            ]
            bodies = [b for pair in self._map(_encode_layer, jobs) for b in pair]
        secs = ([inline] if inline is not None else []) + bodies
        h = ChunkHeader(
            FORMAT_VERSION,
            self.model_fingerprint,
            pid,
            level,
            key_digest(key),
            kv.start,
            kv.num_tokens,
            dtype,
            layers,
            sink,
            inline is not None,
            tuple(len(s) for s in secs),
            tuple(zlib.crc32(s) for s in secs),
            0,
        )
        return pack_header(h) + b"".join(secs)

    # -- decode ----------------------------------------------------------------
    def peek(self, data: bytes) -> ChunkHeader:
        """The chunk's header (validated), without decoding the payload."""
        return parse_header(data)

    def layout(self, data: bytes) -> KVCache:
        """The chunk's start and layout as a cache of no tokens, in the dtype and with the ``meta``
        :meth:`decode` gives (a :class:`~cachegen.codec.protocol.ReadsLayout`), from the header
        alone: checked as :meth:`decode` checks it (limits, the profile's layout, the model)."""
        h = parse_header(data)
        self._check_bounds(h)
        self._check_model(h)
        return empty_layers_cache(
            ((l.kind, l.window, l.heads, l.k_dim, l.v_dim) for l in h.layers),
            h.start,
            h.dtype,
            {"model_fingerprint": h.model_fingerprint},
        )

    def _check_bounds(self, h: ChunkHeader) -> None:
        """The chunk's size against this codec's limits and its layout against the profile, from the header alone."""
        if h.num_tokens > self.max_tokens:
            raise CorruptChunk(f"chunk claims {h.num_tokens} tokens, this codec takes at most {self.max_tokens}")
        if self.profile is not None:
            dims = [(l.heads, l.k_dim, l.v_dim) for l in h.layers]
            if dims != [tuple(d) for d in self.profile.layer_dims]:
                raise CorruptChunk("chunk layout does not match the model's (the profile's)")
        elif h.num_values > MAX_VALUES_NO_PROFILE:
            raise CorruptChunk(f"chunk claims {h.num_values} values, over {MAX_VALUES_NO_PROFILE}")

    def _check_model(self, h: ChunkHeader) -> None:
        """ProfileMismatch when the chunk names another model than this codec's (either may name none)."""
        if self.model_fingerprint and h.model_fingerprint and self.model_fingerprint != h.model_fingerprint:
            raise ProfileMismatch(f"chunk is for model {h.model_fingerprint}, this codec for {self.model_fingerprint}")

    def _profile_for(self, data: bytes, h: ChunkHeader) -> Profile | None:
        self._check_model(h)
        if h.level == LOSSLESS:
            if h.inline_profile or h.profile_id:
                raise CorruptChunk("lossless chunk names a profile")
            return None
        if h.inline_profile:
            prof = Profile.from_bytes(section_bytes(data, h, 0))
            if h.level not in prof.levels:
                raise CorruptChunk("inline profile lacks the chunk's level")
        else:
            if not h.profile_id:
                raise CorruptChunk("lossy chunk names no profile")
            if self.profile is None:
                raise ProfileMismatch(f"chunk was encoded with profile {h.profile_id}; pass that profile to Codec()")
            if self.profile.id != h.profile_id:
                raise ProfileMismatch(f"chunk needs profile {h.profile_id}, this codec has {self.profile.id}")
            prof = self.profile
            if h.level not in prof.levels:
                raise CorruptChunk(f"level {h.level} not in the profile")
        dims = [(l.heads, l.k_dim, l.v_dim) for l in h.layers]
        if dims != [tuple(d) for d in prof.layer_dims]:
            raise CorruptChunk("chunk layout does not match its profile")
        if h.sink_tokens != max(0, min(h.num_tokens, prof.n_sink - h.start)):
            raise CorruptChunk("sink token count inconsistent")
        return prof

    def decode_layers(self, data: bytes, *, key: str | None = None) -> Iterator[tuple[int, KVLayer]]:
        """Yield ``(layer_index, KVLayer)`` in order as sections are decoded.

        Raises CorruptChunk (KeyMismatch when ``key`` is given and the chunk was written for
        another key) before any section is decoded when the header is wrong."""
        h = parse_header(data)
        check_key(h, key)
        self._check_bounds(h)
        prof = self._profile_for(data, h)
        layers = [
            KVLayer(
                torch.empty((l.heads, h.num_tokens, l.k_dim), dtype=h.dtype),
                torch.empty((l.heads, h.num_tokens, l.v_dim), dtype=h.dtype),
                l.kind,
                l.window,
            )
            for l in h.layers
        ]
        done = self._decode_sections([_Part(data, h)], prof, layers)
        try:
            for li, layer in enumerate(layers):
                next(done)
                next(done)
                yield li, layer
        finally:
            done.close()  # a caller that stops early: the sections still running end first

    def _decode_sections(
        self, parts: list[_Part], prof: Profile | None, dst: list[KVLayer]
    ) -> Generator[None, None, None]:
        """Decode every section of ``parts`` (consecutive chunks; lossless: one) into ``dst``'s
        tensors, which cover their tokens (the pool's threads split the sections); yields once per
        section, in order, when it is written. When one fails, or the caller stops early, the rest
        are cancelled or waited for before this returns: no thread writes into ``dst`` after that
        (the loader recomputes a failed chunk's range in place)."""
        # the caller's inference mode goes with each section: it is per thread, and a pool thread
        # outside it may not write into a tensor made inside it (a serving engine's cache)
        inference = torch.is_inference_mode_enabled()
        sections = [(i, dst[i // 2].k if i % 2 == 0 else dst[i // 2].v) for i in range(2 * len(dst))]
        jobs = [_Job(parts, part, prof, inference) for part in self._split(sections, prof is not None)]
        if self._pool is None:
            for job in jobs:
                _decode_job(job)
                for _ in job.sections:
                    yield
            return
        futures = [self._pool.submit(_decode_job, job) for job in jobs]
        try:
            for f, job in zip(futures, jobs, strict=True):
                f.result()
                for _ in job.sections:
                    yield
        finally:
            for f in futures:
                f.cancel()
            wait(futures)

    def _split(self, sections: list, lossy: bool) -> list[list]:
        """Sections into jobs: :func:`decode_jobs` for lossy ones, one section per job otherwise."""
        return decode_jobs(sections, self.threads, self.jobs_per_thread) if lossy else [[s] for s in sections]

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        """The chunk's KV; with ``key``, only if the chunk was written for that chunk key."""
        h = parse_header(data)
        layers = [l for _, l in self.decode_layers(data, key=key)]
        return KVCache(layers, start=h.start, meta={"model_fingerprint": h.model_fingerprint})

    def decode_into(self, data: bytes, out: KVCache, *, key: str | None = None) -> KVCache:
        """Decode the chunk into ``out`` (a view of its range in a preallocated cache: a
        :class:`~cachegen.codec.protocol.DecodesInto`), each section written straight into it,
        so no chunk-sized cache is built or copied. The values are :meth:`decode`'s, cast to
        ``out``'s dtype. The header is checked against ``out`` (range, layer kinds and sizes)
        before anything is decoded."""
        h = parse_header(data)
        self._decode_all([_Part(data, h)], self._checked_into(h, data, out, key), out)
        return out

    def decode_many_into(
        self, datas: Sequence[bytes], out: KVCache, sizes: Sequence[int], *, keys: Sequence[str | None] | None = None
    ) -> KVCache:
        """Decode consecutive chunks of ``sizes`` tokens into ``out``, which they tile in order (a
        :class:`~cachegen.codec.protocol.DecodesManyInto`): the values of :meth:`decode_into` on
        each chunk's range. ``keys``: per chunk, as :meth:`decode_into`'s ``key``.

        Why: a chunk's decode costs a fixed part per section (parsing, the product's and the
        rotation's calls, the NaN check) besides its per-token work; chunks of one profile share
        their sections' product, rotation and check here, and their streams' rANS calls, so
        sixteen 256-token chunks decode in about 1.35x the time of one 4,096-token chunk, against
        3x one call per chunk (docs/codec.md). Every chunk's header is checked (against its
        range of ``out``) before anything is decoded; when one fails mid-way, ``out`` may be
        partly written (the loader then decodes the chunks one by one)."""
        check_tiling(datas, out, sizes, keys)
        parts, profs, pos, layout = [], [], out.start, _layout(out)
        for j, (data, n) in enumerate(zip(datas, sizes, strict=True)):
            h = parse_header(data)
            profs.append(self._checked(h, data, pos, n, layout, keys[j] if keys else None))
            parts.append(_Part(data, h))
            pos += n
        if not parts:
            return out
        one = profs[0]
        if one is None or any(p is not one for p in profs) or any(p.h.dtype != parts[0].h.dtype for p in parts):
            for p, prof in zip(parts, profs, strict=True):  # lossless, inline profiles, mixed dtypes
                self._decode_all([p], prof, out.slice(p.h.start, p.h.start + p.h.num_tokens))
            return out
        self._decode_all(parts, one, out)
        return out

    def _decode_all(self, parts: list[_Part], prof: Profile | None, out: KVCache) -> None:
        """Every section of ``parts`` into ``out``, which covers their tokens (headers checked)."""
        for _ in self._decode_sections(parts, prof, list(out.layers)):
            pass

    def _checked_into(self, h: ChunkHeader, data: bytes, out: KVCache, key: str | None) -> Profile | None:
        """The chunk's profile, once its header is checked against ``out`` (its range, layer kinds
        and sizes), ``key`` and this codec's bounds; CorruptChunk (KeyMismatch) when it does not fit."""
        return self._checked(h, data, out.start, out.num_tokens, _layout(out), key)

    def _checked(
        self, h: ChunkHeader, data: bytes, start: int, n: int, layout: list[tuple], key: str | None
    ) -> Profile | None:
        """:meth:`_checked_into` against a range ``[start, start + n)`` of a cache of ``layout``
        (:func:`_layout`), which a batch computes once for all its chunks."""
        if h.start != start or h.num_tokens != n:
            raise CorruptChunk(
                f"chunk holds tokens [{h.start}, {h.start + h.num_tokens}), expected [{start}, {start + n})"
            )
        if [(l.kind, l.window, l.heads, l.k_dim, l.v_dim) for l in h.layers] != layout:
            raise CorruptChunk("chunk layout differs from the cache it is decoded into")
        check_key(h, key)
        self._check_bounds(h)
        return self._profile_for(data, h)

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown()

    def __del__(self) -> None:  # pragma: no cover
        # Never join here: a collection can run inside another thread's start-up, and joining
        # the pool's threads from there deadlocked (seen in the codec tests); unjoined, they exit
        # once they see the shutdown.
        pool = getattr(self, "_pool", None)
        if pool is not None:
            try:  # noqa: SIM105  (not contextlib.suppress: at interpreter exit the module's globals may be gone)
                pool.shutdown(wait=False)
            except Exception:
                pass


def _layout(out: KVCache) -> list[tuple]:
    """Per layer of ``out``: (kind, window, heads, key dim, value dim), as a chunk header lists them."""
    return [(l.kind, l.window, int(l.k.shape[0]), int(l.k.shape[2]), int(l.v.shape[2])) for l in out.layers]


def decode_jobs(sections: list, threads: int, per_thread: int = 2) -> list[list]:
    """Lossy sections into decode jobs of consecutive sections: ``per_thread`` jobs per thread (one
    job with a single thread), sizes differing by at most one, never more jobs than sections.

    Why: a job costs a fixed part besides its sections' work (its future, parsing calls, one call
    each of the multiplier and symbol decoders, which take all its sections' streams side by side),
    and that part holds the GIL, so it does not shrink with threads. 16 jobs of 3-4 sections, as
    before, made a 256-token chunk's decode 19-23 ms on two threads, 4 jobs 14-17 ms, and 60 jobs of
    one section (where no SIMD decoder runs) 26 ms against 16 ms. Two per thread rather
    than one, so that a thread slowed by other work (the loader's fetches) leaves its second job
    to the other; ``tools/profile_decode.py --jobs-per-thread`` measures it."""
    if not sections:
        return []
    n_jobs = min(len(sections), 1 if threads <= 1 else max(1, per_thread) * threads)
    # n_jobs <= len(sections): every bound is past the one before, so no job is empty
    bounds = [len(sections) * j // n_jobs for j in range(n_jobs + 1)]
    return [sections[a:b] for a, b in pairwise(bounds)]


def quant_levels() -> tuple[int, ...]:
    return LEVELS


# -- section bodies ---------------------------------------------------------------


def layer_inputs(
    layer: KVLayer, sps, sink: int, start: int, context_end: int | None = None
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One layer's K and V as the lossy format codes them: the transformed sections (T, H*D) past
    the sink tokens, and each section's per-token multipliers ``u`` (the token-importance
    predictor reads the layer's keys and values together; with ``context_end``, the sections'
    predictors for a known end, which read each token's distance to it too)."""
    ys = [forward_section(sp, x[:, sink:], start + sink) for sp, x in zip(sps, (layer.k, layer.v))]
    models = [sp.imp if context_end is None else sp.imp_end for sp in sps]
    us = importance.layer_multipliers(
        models, ys[0], ys[1], sps[0].heads, start + sink + np.arange(ys[0].shape[0]), context_end
    )
    return ys, us


def section_symbols(
    y: np.ndarray, u: np.ndarray, step: np.ndarray, cls: np.ndarray, tables: rans.Tables
) -> tuple[np.ndarray, np.ndarray, int]:
    """rANS symbols (T, C) of a transformed section, its escaped integers and their count: the
    step of ``(t, c)`` is ``step[c] * 2^(u[t]/2)``, its table ``cls[c] + TABLE_PAD - u[t]`` of
    ``tables`` (:meth:`~cachegen.codec.profile.LevelParams.padded_tables`)."""
    sym = np.empty(y.shape, dtype=np.uint8)
    esc = np.empty(y.size + 1, dtype=np.int32)
    inv_step = (np.float32(1.0) / step).astype(np.float32)
    n_esc = quant.quantize(y, inv_step, 1.0 / importance.row_scale(u), cls + TABLE_PAD, -u, tables.freq, sym, esc)
    return sym, esc, n_esc


def _encode_layer(job) -> tuple[bytes, bytes]:
    """Both sections of one layer."""
    layer, sps, steps, clss, tables, u_tables, sink, start, context_end = job
    ys, us = layer_inputs(layer, sps, sink, start, context_end)
    out = []
    for x, y, u, sp, step, cls in zip((layer.k, layer.v), ys, us, sps, steps, clss):
        out.append(_encode_section(x, y, u, sp.imp is not None and y.shape[0] > 0, step, cls, tables, u_tables, sink))
    return out[0], out[1]


def _encode_section(
    x: torch.Tensor,
    y: np.ndarray,
    u: np.ndarray,
    send_u: bool,
    step: np.ndarray,
    cls: np.ndarray,
    tables: rans.Tables,
    u_tables: rans.Tables | None,
    sink: int,
) -> bytes:
    sink_raw = _bytes_view(x[:, :sink]).tobytes() if sink else b""
    sym, esc, n_esc = section_symbols(y, u, step, cls, tables)
    words = rans.encode_interleaved(sym, cls + TABLE_PAD, tables, row_shift=-u)
    parts = [struct.pack("<I", len(sink_raw)), sink_raw, struct.pack("<I", n_esc), esc[:n_esc].astype("<i4").tobytes()]
    if send_u:
        uw = rans.encode_interleaved(
            (u - importance.U_MIN).astype(np.uint8)[:, None], np.zeros(1, dtype=np.int64), cast(rans.Tables, u_tables)
        )
        parts += [struct.pack("<I", uw.size), uw.astype("<u2").tobytes()]
    parts.append(words.astype("<u2").tobytes())
    return b"".join(parts)


def _lossless_tables(plane: np.ndarray) -> np.ndarray:
    counts = np.bincount(plane.ravel(), minlength=256).astype(np.float64)
    if (counts > 0).sum() < 2:  # keep every probability < 1 (bounds hostile symbol counts)
        counts[0 if counts[0] == 0 else 1] = 1e-9 * max(1.0, counts.sum())
    freqs = rans.quantize_counts(counts, PRECISION)
    top = int(np.argmax(freqs))
    if freqs[top] > LOSSLESS_MAX_FREQ:  # a near-constant plane: cap its top symbol (see LOSSLESS_MAX_FREQ)
        rest = freqs.copy()
        rest[top] = -1
        freqs[int(np.argmax(rest))] += int(freqs[top]) - LOSSLESS_MAX_FREQ
        freqs[top] = LOSSLESS_MAX_FREQ
    return freqs


def _encode_lossless(x: torch.Tensor) -> bytes:
    h, t, d = x.shape
    raw = _bytes_view(x.permute(1, 0, 2)).reshape(t, h * d, x.element_size())
    out = [struct.pack("<B", x.element_size())]
    for b in range(x.element_size()):
        plane = np.ascontiguousarray(raw[:, :, b])
        freqs = _lossless_tables(plane)
        tables = rans.Tables.build([rans.Categorical(freqs, PRECISION)])
        words, lengths = rans.encode_columns(plane, np.zeros(h * d, dtype=np.int64), tables, check=False)
        out += [
            freqs.astype("<u2").tobytes(),
            struct.pack("<I", words.size),
            lengths.astype("<u4").tobytes(),
            words.astype("<u2").tobytes(),
        ]
    return b"".join(out)


@dataclass(frozen=True)
class _Part:
    """One chunk of a decode: its payload and parsed header."""

    data: bytes | memoryview
    h: ChunkHeader

    @property
    def first(self) -> int:
        """The payload section of the chunk's section 0 (1 after an inline profile)."""
        return 1 if self.h.inline_profile else 0


@dataclass(frozen=True)
class _Job:
    """Sections ``(i, out)`` of consecutive chunks ``parts``, decoded on one thread; ``out`` covers
    every part's tokens. ``inference``: the caller's inference mode (per thread in torch)."""

    parts: list[_Part]
    sections: list[tuple[int, torch.Tensor]]
    prof: Profile | None
    inference: bool


def _decode_job(job: _Job) -> None:
    """A job of :meth:`Codec._decode_sections`, in the caller's inference mode. A lossy section
    whose ``out`` has another dtype than the chunks' decodes through a buffer of their dtype, so
    the values are the chunks' own, then cast."""
    with torch.inference_mode(job.inference):
        if job.prof is None:
            (p,) = job.parts  # lossless chunks are decoded one at a time
            for i, out in job.sections:
                raw = section_bytes(p.data, p.h, p.first + i)
                out.copy_(_decode_lossless(raw, p.h, int(out.shape[0]), int(out.shape[2]), i))
            return
        dtype = job.parts[0].h.dtype
        bufs = [out if out.dtype == dtype else torch.empty(out.shape, dtype=dtype) for _, out in job.sections]
        _decode_lossy(job.parts, [(i, buf) for (i, _), buf in zip(job.sections, bufs)], job.prof)
        for (_, out), buf in zip(job.sections, bufs, strict=True):
            if buf is not out:
                out.copy_(buf)


def _decode_lossless(mv: memoryview, h: ChunkHeader, heads: int, d: int, i: int) -> torch.Tensor:
    r = Reader(mv, f"section {i}")
    t, c = h.num_tokens, heads * d
    size = struct.unpack("<B", r.take(1))[0]
    if size != torch.empty((), dtype=h.dtype).element_size():
        raise CorruptChunk(f"section {i}: element size mismatch")
    planes = []
    for _ in range(size):  # parse and bound every plane before allocating the output
        freqs = np.frombuffer(r.take(512), dtype="<u2").astype(np.int64)
        if int(freqs.sum()) != 1 << PRECISION or int(freqs.max()) > LOSSLESS_MAX_FREQ:
            raise CorruptChunk(f"section {i}: bad lossless table")
        nw = r.u32()
        lengths = np.frombuffer(r.take(4 * c), dtype="<u4").astype(np.int64)
        words = np.frombuffer(r.take(2 * nw), dtype="<u2")
        if t * c * LOSSLESS_MIN_BITS > 16 * nw + 64 * c + 64:
            raise CorruptChunk(f"section {i}: symbol count inconsistent with payload size")
        planes.append((freqs, lengths, words))
    r.done()
    raw = np.empty((t, c, size), dtype=np.uint8)
    for b, (freqs, lengths, words) in enumerate(planes):
        tables = rans.Tables.build([rans.Categorical(freqs, PRECISION)])
        raw[:, :, b] = rans.decode_columns(words.astype(np.uint16), lengths, t, np.zeros(c, dtype=np.int64), tables)
    x = _from_bytes(raw.reshape(-1), (t, heads, d), h.dtype)
    return _finite(x.permute(1, 0, 2).contiguous(), i)


def all_finite(x: torch.Tensor) -> bool:
    """Whether ``x`` holds no NaN or Inf, from a sum: a NaN or an Inf makes any sum of it NaN or
    infinite. First a float32 sum (6x faster than float64 on float32 values: 0.10 ms for a 4K-token
    section against 0.65 ms, about 15% of a whole-context decode); when it is not finite, because of
    a NaN, an Inf or finite values whose float32 sum overflows, a float64 sum decides, which finite
    float32/bf16/fp16 values cannot overflow (fewer than 2**53 values, each below 2**128). Either is
    ~10x faster than ``torch.isfinite(x).all()``, which builds a bool tensor."""
    if math.isfinite(float(x.sum(dtype=torch.float32))):
        return True
    return math.isfinite(float(x.sum(dtype=torch.float64)))


def _finite(x: torch.Tensor, i: int) -> torch.Tensor:
    """``x``, or CorruptChunk when it holds NaN or Inf (no encoder writes them: a damaged or hostile chunk)."""
    if not all_finite(x):
        raise CorruptChunk(f"section {i}: non-finite values")
    return x


@dataclass
class _LossySection:
    """A lossy section of one chunk parsed up to its rANS streams: what :func:`_finish_lossy` needs
    once its multipliers ``u`` and symbols are decoded (together with the other sections of its job).
    ``uw``: the multiplier stream (None when the profile has no token importance or the section no
    tokens), decoded into ``u`` by :func:`_decode_multipliers`."""

    i: int
    h: ChunkHeader
    sink_raw: memoryview
    esc: np.ndarray
    n_esc: int
    words: np.ndarray
    n: int
    cls: np.ndarray
    uw: np.ndarray | None
    u: np.ndarray

    @property
    def block(self) -> rans.Block:
        """The section's symbol stream, its rows' tables shifted by the multipliers."""
        return rans.Block(self.words, self.n, self.cls + TABLE_PAD, -self.u)


def _parse_lossy(mv: memoryview, h: ChunkHeader, i: int, prof: Profile, heads: int, d: int) -> _LossySection:
    """Section ``i`` of a chunk up to its streams; CorruptChunk when what it declares is inconsistent."""
    r = Reader(mv, f"section {i}")
    sp = prof.sections[i]
    lp = prof.levels[h.level]
    tables, cls = lp.padded_tables(), lp.classes(prof.sections)[i]
    sink = h.sink_tokens
    t, c = h.num_tokens - sink, heads * d
    itemsize = h.dtype.itemsize
    n_sink_bytes = r.u32()
    if n_sink_bytes != heads * sink * d * itemsize:
        raise CorruptChunk(f"section {i}: sink size mismatch")
    sink_raw = r.take(n_sink_bytes)
    n_esc = r.u32()
    if n_esc > t * c:
        raise CorruptChunk(f"section {i}: escape count out of range")
    esc_raw = r.take(4 * n_esc)  # present before anything is allocated for it
    esc = np.zeros(n_esc + 1, dtype=np.int32)
    esc[:n_esc] = np.frombuffer(esc_raw, dtype="<i4")
    uw = None
    if sp.imp is not None and t:
        nu = r.u32()
        if 2 * nu > len(mv) - r.p:
            raise CorruptChunk(f"section {i}: multiplier stream longer than the section")
        uw = np.frombuffer(r.take(2 * nu), dtype="<u2")
        rans.check_budget(t, 1, uw.size, prof.u_tables(), f"section {i} multipliers")
    wb = r.rest()
    if len(wb) % 2:
        raise CorruptChunk(f"section {i}: odd word payload")
    words = np.frombuffer(wb, dtype="<u2")
    rans.check_budget(t, c, words.size, tables, f"section {i}")
    return _LossySection(i, h, sink_raw, esc, n_esc, words, t, cls, uw, np.zeros(t, dtype=np.int64))


def _decode_multipliers(parsed: list[_LossySection], prof: Profile) -> None:
    """Every multiplier stream of ``parsed`` in one call (:func:`cachegen.codec.rans.decode_column_many`),
    into each section's ``u``; CorruptChunk when a stream is inconsistent or a multiplier out of range."""
    todo = [(s, s.uw) for s in parsed if s.uw is not None]
    if not todo:
        return
    decoded = rans.decode_column_many([uw for _, uw in todo], [s.n for s, _ in todo], prof.u_tables())
    for (s, _), sym in zip(todo, decoded, strict=True):
        s.u = sym.astype(np.int64) + importance.U_MIN
        if s.u.max() > importance.U_MAX:
            raise CorruptChunk(f"section {s.i}: multiplier out of range")


def _finish_lossy(
    i: int, prof: Profile, out: torch.Tensor, parsed: list[_LossySection], syms: list[np.ndarray]
) -> None:
    """Dequantize section ``i`` of consecutive chunks (``parsed``, their decoded ``syms``) and
    inverse-transform them into ``out`` (H, T, D), which covers their tokens: one product, one
    rotation pass and one NaN check for them all. Their sink tokens (positions below the
    profile's ``n_sink``) are the first of ``out``: the rest is one run of positions."""
    heads, d = int(out.shape[0]), int(out.shape[2])
    sink = sum(s.h.sink_tokens for s in parsed)
    y = np.empty((sum(sym.shape[0] for sym in syms), heads * d), dtype=np.float32)
    row = 0
    for s, sym in zip(parsed, syms, strict=True):
        n = sym.shape[0]
        steps = prof.levels[s.h.level].steps[i]
        used = quant.dequantize(sym, steps, importance.row_scale(s.u), s.esc, s.n_esc, y[row : row + n])
        if used != s.n_esc:
            raise CorruptChunk(f"section {i}: {used} escapes in the stream, {s.n_esc} stored")
        row += n
        if s.h.sink_tokens:
            a = s.h.start - parsed[0].h.start
            out[:, a : a + s.h.sink_tokens].copy_(_from_bytes(s.sink_raw, (heads, s.h.sink_tokens, d), s.h.dtype))
    inverse_section_into(prof.sections[i], y, out[:, sink:], parsed[0].h.start + sink)
    _finite(out, i)


def _decode_lossy(parts: list[_Part], sections: list[tuple[int, torch.Tensor]], prof: Profile) -> None:
    """Sections ``(i, out)`` of consecutive chunks ``parts``: every rANS stream of one level in
    one call, which decodes them side by side (:func:`cachegen.codec.rans.decode_interleaved_many`),
    then each section's values for all the chunks at once (:func:`_finish_lossy`)."""
    parsed = [
        [
            _parse_lossy(section_bytes(p.data, p.h, p.first + i), p.h, i, prof, int(out.shape[0]), int(out.shape[2]))
            for p in parts
        ]
        for i, out in sections
    ]
    _decode_multipliers([s for row in parsed for s in row], prof)
    syms: list[list[np.ndarray]] = [[np.empty(0)] * len(parts) for _ in sections]
    by_level: dict[int, list[int]] = {}
    for j, p in enumerate(parts):
        by_level.setdefault(p.h.level, []).append(j)
    for level, js in by_level.items():
        blocks = [(k, j) for k in range(len(sections)) for j in js]
        decoded = rans.decode_interleaved_many(
            [parsed[k][j].block for k, j in blocks], prof.levels[level].padded_tables()
        )
        for (k, j), sym in zip(blocks, decoded, strict=True):
            syms[k][j] = sym
    for k, (i, out) in enumerate(sections):
        _finish_lossy(i, prof, out, parsed[k], syms[k])
