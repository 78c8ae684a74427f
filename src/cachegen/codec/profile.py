"""Model profile ("codebook"): per-layer transforms, steps and rANS tables, calibrated once.

Why: tables sent inside every chunk cost ~2 bits/value (CacheGen as
released); tables profiled once per model generalize to other text. A chunk
names its profile by content hash (:attr:`Profile.id`) instead of carrying it.

One profile holds every lossy level. Per section (layer x K/V, index
``2*layer + (0 for K, 1 for V)``) it stores the mean and an optional
orthonormal per-head basis (PCA on calibration text), the std of each basis
component, and per level a step per component; the rANS table of a component
is chosen by its std/step ratio (:func:`cachegen.codec.quant.classes_for`),
so a level needs only :data:`~cachegen.codec.quant.N_CLASSES` tables.

Serialization is a small JSON header plus raw little-endian arrays (no
pickle), checked on load. This module is the profile's data and format; the
fitting maths (PCA, Fisher-weighted steps, tables) is :mod:`cachegen.codec.fit`.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np

from cachegen.codec import importance, quant
from cachegen.codec.importance import ImportanceModel
from cachegen.codec.rans import Categorical, Tables
from cachegen.codec.rope import RopeSpec
from cachegen.errors import CodecError, ConfigError, CorruptChunk, FormatVersionError
from cachegen.kv import KVCache

PROFILE_MAGIC = b"CGPF"
PROFILE_VERSION = 4  # 2: optional per-section inverse (Fisher-weighted basis); 3: optional RoPE undo per key section;
# 4: optional token-importance predictor per section and the table of its multipliers, and (optional, read
# by encoders only: an older reader ignores it and decodes the same) a second predictor for a known context end
TABLE_PAD = max(-importance.U_MIN, importance.U_MAX)  # extra tables each side: a row shift never leaves the range
PRECISION = 12
DEFAULT_SINK = 4
LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
# Nominal KL (nats/token) per level, as the calibration Fisher predicts it: each of levels 1-6
# allows 2.2x the KL of the level before (~0.5 b/v less), level 7 is the aggressive end for slow
# links. Measured on held-out text with the mixed calibration text the realized KL is 0.4-1.5x
# nominal (GPL-3, pydoc-eval, GPL-2) to 1-2x (Apache-2.0): docs/codec.md.
KL_TARGETS = {**{lv: 1e-4 * 2.2 ** (lv - 1) for lv in range(1, 7)}, 7: 2.5e-2}


def kl_targets(kl_scale: float, levels: Sequence[int] = LEVELS) -> dict[str, float]:
    """Each level's KL target at ``kl_scale`` as a profile's ``meta["kl_targets"]`` records it:
    one expression for the fit that writes it and the cache check that compares against it."""
    return {str(lv): KL_TARGETS[lv] * kl_scale for lv in levels}


# step relative to the section RMS when calibrated without a model
REL_STEPS = {1: 0.01, 2: 0.02, 3: 0.035, 4: 0.06, 5: 0.1, 6: 0.18, 7: 0.3}
_MAX_JSON = 1 << 20
_DTYPES = {"f4": np.float32, "u1": np.uint8, "u2": np.uint16, "i8": np.int64}


@dataclass
class SectionParams:
    """Transform of one (layer, K/V) section: ``y = (unrope(x) - mean) @ basis`` per head.

    ``inv`` is the inverse (``x = y @ inv + mean``) when the basis is not orthonormal
    (Fisher-weighted KLT); ``None`` means ``basis.T``."""

    heads: int
    dim: int
    mean: np.ndarray  # (heads*dim,) float32
    std: np.ndarray  # (heads*dim,) float32, std of each basis component
    basis: np.ndarray | None = None  # (heads, dim, dim) float32, or None (identity)
    inv: np.ndarray | None = None  # (heads, dim, dim) float32 inverse of basis, or None (basis orthonormal)
    rope: RopeSpec | None = None  # keys: undo this rotary embedding first (positions from the chunk)
    imp: ImportanceModel | None = None  # per-token step multipliers (predicted by the encoder, sent in the chunk)
    imp_end: ImportanceModel | None = None  # the same when the encoder knows where the context ends


def _importance_model(
    arrays: dict[str, np.ndarray], name: str, i: int, shape: tuple[int, int]
) -> ImportanceModel | None:
    """Section ``i``'s ``name`` model (weights ``shape``, one offset) from a profile's arrays, if it has one."""
    if f"{name}/{i}" not in arrays:
        return None
    w, off = arrays[f"{name}/{i}"], arrays.get(f"{name}off/{i}")
    if w.shape != shape or off is None or off.shape != (1,) or not (np.isfinite(w).all() and np.isfinite(off).all()):
        raise CorruptChunk(f"profile section {i} has an invalid importance model")
    return ImportanceModel(w, float(off[0]))


@dataclass
class LevelParams:
    steps: list[np.ndarray]  # per section, (C,) float32
    freqs: np.ndarray  # (N_CLASSES, ALPHABET) int64, sum 2**PRECISION each
    _tables: Tables | None = field(default=None, repr=False, compare=False)
    _cls: list[np.ndarray] | None = field(default=None, repr=False, compare=False)
    _padded: Tables | None = field(default=None, repr=False, compare=False)

    def tables(self) -> Tables:
        if self._tables is None:
            self._tables = Tables.build([Categorical(f, PRECISION) for f in self.freqs])
        return self._tables

    def classes(self, sections: Sequence[SectionParams]) -> list[np.ndarray]:
        if self._cls is None:
            self._cls = [quant.classes_for(s.std, st) for s, st in zip(sections, self.steps)]
        return self._cls

    def padded_tables(self) -> Tables:
        """The tables with :data:`TABLE_PAD` copies of the first and last one on either side:
        component class ``k`` is table ``k + TABLE_PAD``, and a row whose step is scaled by
        ``2^(u/2)`` shifts it by ``-u`` (half an octave per class) without leaving the range."""
        if self._padded is None:
            n = len(self.freqs)
            rows = [self.freqs[min(max(k - TABLE_PAD, 0), n - 1)] for k in range(n + 2 * TABLE_PAD)]
            self._padded = Tables.build([Categorical(f, PRECISION) for f in rows])
        return self._padded


@dataclass
class Profile:
    model_fingerprint: str
    layer_dims: list[tuple[int, int, int]]  # (kv_heads, k_dim, v_dim) per layer
    sections: list[SectionParams]
    levels: dict[int, LevelParams]
    n_sink: int = DEFAULT_SINK
    meta: dict = field(default_factory=dict)
    u_freqs: np.ndarray | None = None  # (N_U,) int64: table of the per-token multipliers (with importance)
    _bytes: bytes | None = field(default=None, repr=False, compare=False)
    _id: str | None = field(default=None, repr=False, compare=False)
    _u_tables: Tables | None = field(default=None, repr=False, compare=False)

    def u_tables(self) -> Tables:
        """The rANS table of per-token multiplier symbols ``u - U_MIN``."""
        if self._u_tables is None:
            if self.u_freqs is None:
                raise CodecError("profile has no token-importance table")
            self._u_tables = Tables.build([Categorical(self.u_freqs, PRECISION)])
        return self._u_tables

    # -- identity --------------------------------------------------------------
    @property
    def id(self) -> str:
        """Hex content hash (32 hex digits) of the serialized profile (computed once: every decode checks it)."""
        if self._id is None:
            self._id = hashlib.sha256(self.to_bytes()).hexdigest()[:32]
        return self._id

    @property
    def id_bytes(self) -> bytes:
        return bytes.fromhex(self.id)

    # -- serialization -----------------------------------------------------------
    def to_bytes(self) -> bytes:
        if self._bytes is not None:
            return self._bytes
        arrays: list[tuple[str, np.ndarray]] = []
        for i, s in enumerate(self.sections):
            arrays.append((f"mean/{i}", s.mean.astype("<f4")))
            arrays.append((f"std/{i}", s.std.astype("<f4")))
            if s.basis is not None:
                arrays.append((f"basis/{i}", s.basis.astype("<f4")))
                if s.inv is not None:
                    arrays.append((f"inv/{i}", s.inv.astype("<f4")))
            if s.rope is not None:
                arrays.append((f"rope/{i}", s.rope.to_array().astype("<f4")))
            for name, m in (("imp", s.imp), ("impend", s.imp_end)):
                if m is not None:
                    arrays.append((f"{name}/{i}", m.weights.astype("<f4")))
                    arrays.append((f"{name}off/{i}", np.array([m.offset], dtype="<f4")))
        if self.u_freqs is not None:
            arrays.append(("ufreqs", self.u_freqs.astype("<u2")))
        for lv in sorted(self.levels):
            p = self.levels[lv]
            arrays.append((f"freqs/{lv}", p.freqs.astype("<u2")))
            for i, st in enumerate(p.steps):
                arrays.append((f"step/{lv}/{i}", st.astype("<f4")))
        index, blobs, off = [], [], 0
        for name, a in arrays:
            b = np.ascontiguousarray(a).tobytes()
            index.append([name, a.dtype.str[1:], list(a.shape), off, len(b)])
            blobs.append(b)
            off += len(b)
        hdr = {
            "model_fingerprint": self.model_fingerprint,
            "layer_dims": [list(d) for d in self.layer_dims],
            "n_sink": self.n_sink,
            "precision": PRECISION,
            "levels": sorted(self.levels),
            "meta": self.meta,
            "arrays": index,
        }
        js = json.dumps(hdr, sort_keys=True, separators=(",", ":")).encode()
        self._bytes = PROFILE_MAGIC + struct.pack("<HI", PROFILE_VERSION, len(js)) + js + b"".join(blobs)
        return self._bytes

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> Profile:
        """Parse and validate; raises CorruptChunk (or FormatVersionError) on bad input."""
        mv = memoryview(bytes(data))
        if len(mv) < 10 or bytes(mv[:4]) != PROFILE_MAGIC:
            raise CorruptChunk("not a cachegen profile (bad magic)")
        version, jlen = struct.unpack_from("<HI", mv, 4)
        if version != PROFILE_VERSION:
            raise FormatVersionError(f"profile format version {version}, this cachegen reads {PROFILE_VERSION}")
        if jlen > _MAX_JSON or 10 + jlen > len(mv):
            raise CorruptChunk("profile header length out of range")
        try:
            hdr = json.loads(bytes(mv[10 : 10 + jlen]))
            blob = mv[10 + jlen :]
            arrays: dict[str, np.ndarray] = {}
            for name, dt, shape, off, nb in hdr["arrays"]:
                if (
                    dt not in _DTYPES
                    or not isinstance(off, int)
                    or not isinstance(nb, int)
                    or off < 0
                    or off + nb > len(blob)
                ):
                    raise CorruptChunk(f"profile array {name!r} out of bounds")
                dtype = np.dtype(_DTYPES[dt]).newbyteorder("<")
                if (
                    any((not isinstance(d, int)) or d < 0 for d in shape)
                    or int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != nb
                ):
                    raise CorruptChunk(f"profile array {name!r} has a bad shape")
                arrays[name] = (
                    np.frombuffer(blob, dtype=dtype, count=nb // dtype.itemsize, offset=off)
                    .reshape(shape)
                    .astype(dtype.newbyteorder("="))
                )
            if hdr["precision"] != PRECISION:
                raise CorruptChunk("profile precision unsupported")
            dims = [tuple(int(x) for x in d) for d in hdr["layer_dims"]]
            if not dims or any(len(d) != 3 or min(d) <= 0 or max(d) > 1 << 14 for d in dims):
                raise CorruptChunk("profile layer dims invalid")
            sections = []
            for i in range(2 * len(dims)):
                h, dk, dv = dims[i // 2]
                d = dk if i % 2 == 0 else dv
                mean, std = arrays[f"mean/{i}"], arrays[f"std/{i}"]
                basis = arrays.get(f"basis/{i}")
                inv = arrays.get(f"inv/{i}")
                if inv is not None and basis is None:
                    raise CorruptChunk(f"profile section {i} has an inverse without a basis")
                if (
                    mean.shape != (h * d,)
                    or std.shape != (h * d,)
                    or any(b is not None and b.shape != (h, d, d) for b in (basis, inv))
                ):
                    raise CorruptChunk(f"profile section {i} has wrong shapes")
                if not (
                    np.isfinite(mean).all()
                    and np.isfinite(std).all()
                    and all(b is None or np.isfinite(b).all() for b in (basis, inv))
                ):
                    raise CorruptChunk(f"profile section {i} holds non-finite values")
                rope_a = arrays.get(f"rope/{i}")
                spec = None
                if rope_a is not None:
                    if (
                        rope_a.ndim != 1
                        or not 2 <= rope_a.shape[0] <= d // 2 + 1
                        or not np.isfinite(rope_a).all()
                        or not 1e-3 <= rope_a[-1] <= 1e3
                    ):
                        raise CorruptChunk(f"profile section {i} has an invalid rotary spec")
                    spec = RopeSpec.from_array(rope_a)
                f = dims[i // 2][1] + dims[i // 2][2] + importance.N_EXTRA + 1
                imp = _importance_model(arrays, "imp", i, (h, f))
                imp_end = _importance_model(arrays, "impend", i, (h, f + importance.N_DIST))
                if imp_end is not None and imp is None:
                    raise CorruptChunk(f"profile section {i} has an importance model for a known end only")
                sections.append(SectionParams(h, d, mean, std, basis, inv, spec, imp, imp_end))
            u_freqs = arrays.get("ufreqs")
            if u_freqs is not None:
                u_freqs = u_freqs.astype(np.int64)
                if u_freqs.shape != (importance.N_U,) or int(u_freqs.sum()) != 1 << PRECISION or (u_freqs < 1).any():
                    raise CorruptChunk("profile multiplier table invalid")
            if any(sp.imp is not None for sp in sections) and u_freqs is None:
                raise CorruptChunk("profile has importance models without a multiplier table")
            levels = {}
            for lv in hdr["levels"]:
                lv = int(lv)
                freqs = arrays[f"freqs/{lv}"].astype(np.int64)
                if (
                    freqs.shape != (quant.N_CLASSES, quant.ALPHABET)
                    or (freqs.sum(axis=1) != 1 << PRECISION).any()
                    or (freqs[:, quant.ESCAPE] < 1).any()
                ):
                    raise CorruptChunk(f"profile level {lv} tables invalid")
                steps = [arrays[f"step/{lv}/{i}"] for i in range(len(sections))]
                for s, st in zip(sections, steps):
                    if st.shape != s.mean.shape or not (np.isfinite(st).all() and (st > 0).all()):
                        raise CorruptChunk(f"profile level {lv} steps invalid")
                levels[lv] = LevelParams(steps, freqs)
            prof = cls(
                str(hdr["model_fingerprint"]),
                cast("list[tuple[int, int, int]]", dims),  # each checked to have 3 entries above
                sections,
                levels,
                int(hdr["n_sink"]),
                dict(hdr.get("meta") or {}),
                u_freqs,
            )
            if not (0 <= prof.n_sink <= 1 << 16):
                raise CorruptChunk("profile sink count invalid")
        except CorruptChunk:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise CorruptChunk(f"profile structure invalid: {e}") from None
        prof._bytes = bytes(mv)
        return prof

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_bytes(self.to_bytes())
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_bytes(Path(path).read_bytes())

    # -- helpers ------------------------------------------------------------------
    def check_layout(self, kv: KVCache) -> None:
        dims = [(l.k.shape[0], l.k.shape[2], l.v.shape[2]) for l in kv.layers]
        if dims != [tuple(d) for d in self.layer_dims]:
            raise ConfigError(
                f"KV layout ({len(dims)} layers, {dims[:2]}...) does not match the profile ({len(self.layer_dims)} layers, {self.layer_dims[:2]}...)"
            )
