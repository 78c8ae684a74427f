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
pickle), checked on load.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from cachegen.codec import importance, quant
from cachegen.codec.importance import ImportanceModel
from cachegen.codec.rans import Categorical, Tables
from cachegen.codec.rope import RopeSpec, unrope
from cachegen.errors import CodecError, ConfigError, CorruptChunk, FormatVersionError
from cachegen.kv import KVCache

PROFILE_MAGIC = b"CGPF"
PROFILE_VERSION = 4  # 2: optional per-section inverse (Fisher-weighted basis); 3: optional RoPE undo per key section;
# 4: optional token-importance predictor per section and the table of its multipliers
TABLE_PAD = max(-importance.U_MIN, importance.U_MAX)  # extra tables each side: a row shift never leaves the range
PRECISION = 12
DEFAULT_SINK = 4
LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
# Nominal KL (nats/token) per level, as the calibration Fisher predicts it: each of levels 1-6
# allows 2.2x the KL of the level before (~0.5 b/v less), level 7 is the aggressive end for slow
# links. Measured on held-out text with the mixed calibration text the realized KL is 0.4-1.5x
# nominal (GPL-3, pydoc-eval, GPL-2) to 1-2x (Apache-2.0): docs/codec.md.
KL_TARGETS = {**{lv: 1e-4 * 2.2 ** (lv - 1) for lv in range(1, 7)}, 7: 2.5e-2}
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
            if s.imp is not None:
                arrays.append((f"imp/{i}", s.imp.weights.astype("<f4")))
                arrays.append((f"impoff/{i}", np.array([s.imp.offset], dtype="<f4")))
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
    def from_bytes(cls, data: bytes) -> "Profile":
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
                if dt not in _DTYPES or not isinstance(off, int) or not isinstance(nb, int) or off < 0 or off + nb > len(blob):
                    raise CorruptChunk(f"profile array {name!r} out of bounds")
                dtype = np.dtype(_DTYPES[dt]).newbyteorder("<")
                if any((not isinstance(d, int)) or d < 0 for d in shape) or int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != nb:
                    raise CorruptChunk(f"profile array {name!r} has a bad shape")
                arrays[name] = np.frombuffer(blob, dtype=dtype, count=nb // dtype.itemsize, offset=off).reshape(shape).astype(dtype.newbyteorder("="))
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
                if mean.shape != (h * d,) or std.shape != (h * d,) or any(b is not None and b.shape != (h, d, d) for b in (basis, inv)):
                    raise CorruptChunk(f"profile section {i} has wrong shapes")
                if not (np.isfinite(mean).all() and np.isfinite(std).all() and all(b is None or np.isfinite(b).all() for b in (basis, inv))):
                    raise CorruptChunk(f"profile section {i} holds non-finite values")
                rope_a = arrays.get(f"rope/{i}")
                spec = None
                if rope_a is not None:
                    if rope_a.ndim != 1 or not 2 <= rope_a.shape[0] <= d // 2 + 1 or not np.isfinite(rope_a).all() or not 1e-3 <= rope_a[-1] <= 1e3:
                        raise CorruptChunk(f"profile section {i} has an invalid rotary spec")
                    spec = RopeSpec.from_array(rope_a)
                imp = None
                if f"imp/{i}" in arrays:
                    w, off = arrays[f"imp/{i}"], arrays.get(f"impoff/{i}")
                    f = dims[i // 2][1] + dims[i // 2][2] + importance.N_EXTRA + 1
                    if w.shape != (h, f) or off is None or off.shape != (1,) or not (np.isfinite(w).all() and np.isfinite(off).all()):
                        raise CorruptChunk(f"profile section {i} has an invalid importance model")
                    imp = ImportanceModel(w, float(off[0]))
                sections.append(SectionParams(h, d, mean, std, basis, inv, spec, imp))
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
                if freqs.shape != (quant.N_CLASSES, quant.ALPHABET) or (freqs.sum(axis=1) != 1 << PRECISION).any() or (freqs[:, quant.ESCAPE] < 1).any():
                    raise CorruptChunk(f"profile level {lv} tables invalid")
                steps = [arrays[f"step/{lv}/{i}"] for i in range(len(sections))]
                for s, st in zip(sections, steps):
                    if st.shape != s.mean.shape or not (np.isfinite(st).all() and (st > 0).all()):
                        raise CorruptChunk(f"profile level {lv} steps invalid")
                levels[lv] = LevelParams(steps, freqs)
            prof = cls(str(hdr["model_fingerprint"]), dims, sections, levels, int(hdr["n_sink"]), dict(hdr.get("meta") or {}),
                       u_freqs)
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
    def load(cls, path: str | Path) -> "Profile":
        return cls.from_bytes(Path(path).read_bytes())

    # -- helpers ------------------------------------------------------------------
    def check_layout(self, kv: KVCache) -> None:
        dims = [(l.k.shape[0], l.k.shape[2], l.v.shape[2]) for l in kv.layers]
        if dims != [tuple(d) for d in self.layer_dims]:
            raise ConfigError(f"KV layout ({len(dims)} layers, {dims[:2]}...) does not match the profile ({len(self.layer_dims)} layers, {self.layer_dims[:2]}...)")


# -- calibration ---------------------------------------------------------------------


def _nonsink(kv: KVCache, i: int, n_sink: int) -> tuple[torch.Tensor, int]:
    """Section ``i`` of ``kv`` without the sink tokens, and the position of its first token."""
    l = kv.layers[i // 2]
    x = l.k if i % 2 == 0 else l.v
    skip = min(max(0, n_sink - kv.start), x.shape[1])
    return x[:, skip:], kv.start + skip


def _section_values(samples: Sequence[KVCache], i: int, n_sink: int, spec: RopeSpec | None = None) -> torch.Tensor:
    """All non-sink tokens of section ``i`` over the samples (RoPE undone with ``spec``), (heads, N, dim) float64."""
    parts = []
    for kv in samples:
        x, start = _nonsink(kv, i, n_sink)
        if x.shape[1]:
            parts.append(unrope(x, spec, start).to(torch.float64))
    if not parts:
        return torch.zeros((x.shape[0], 0, x.shape[2]), dtype=torch.float64)
    return torch.cat(parts, dim=1)


def _pca(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per head: mean (H*D,), basis (H, D, D) columns by decreasing variance, component std (H*D,)."""
    mean = x.mean(dim=1, keepdim=True)
    xc = x - mean
    cov = xc.transpose(1, 2) @ xc / max(1, x.shape[1] - 1)
    evals, evecs = torch.linalg.eigh(cov)  # ascending
    evals, evecs = evals.flip(-1), evecs.flip(-1)
    # deterministic signs: largest-magnitude entry of each vector positive
    idx = evecs.abs().argmax(dim=1, keepdim=True)
    sign = torch.sign(torch.gather(evecs, 1, idx))
    sign[sign == 0] = 1
    evecs = evecs * sign
    std = (xc @ evecs).std(dim=1)
    return mean.reshape(-1).numpy().astype(np.float32), evecs.numpy().astype(np.float32), std.reshape(-1).numpy().astype(np.float32)


def _inverse_rows(sp: SectionParams) -> np.ndarray | None:
    """(H, D, D) with ``[h, j]`` = the raw-domain direction of basis component ``j`` (None: identity)."""
    if sp.basis is None:
        return None
    return (sp.inv if sp.inv is not None else np.swapaxes(sp.basis, 1, 2)).astype(np.float64)


def component_sensitivity(sp: SectionParams, sens) -> np.ndarray:
    """Per basis component sensitivity (H*D,) of a section from a float (whole section), a per-channel
    array (H*D,) (diagonal Fisher in the raw domain) or per-head Fisher matrices (H, D, D)."""
    n = sp.heads * sp.dim
    a = np.asarray(sens, dtype=np.float64)
    r = _inverse_rows(sp)
    if a.ndim == 0:
        out = np.full(n, max(float(a), 1e-30))
        return out if sp.inv is None else np.maximum(out * np.einsum("hjd,hjd->hj", r, r).reshape(-1), 1e-30)
    if a.shape == (sp.heads, sp.dim, sp.dim):
        out = np.diagonal(a, axis1=1, axis2=2).reshape(-1) if r is None else np.einsum("hjd,hde,hje->hj", r, a, r).reshape(-1)
    elif a.shape == (n,):
        out = a if r is None else np.einsum("hjd,hd->hj", r * r, a.reshape(sp.heads, sp.dim)).reshape(-1)
    else:
        raise ConfigError(f"sensitivity of shape {a.shape} does not fit a section of {sp.heads} heads x {sp.dim}")
    return np.maximum(out, 1e-30)


def _fisher_klt(x: torch.Tensor, fisher: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fisher-weighted KLT per head: ``A = (F + ridge*tr(F)/D*I)^(1/2)``, PCA of ``A x``.

    Returns mean (H*D,), basis ``A U`` (H, D, D), its inverse ``U^T A^-1`` and component std (H*D,).
    In this basis quantization noise costs the same KL on every component (under the
    regularized Fisher), so one step serves all components and the KLT's coding gain applies
    to the *weighted* error, which is what the model sees."""
    mean = x.mean(dim=1, keepdim=True)
    xc = (x - mean).numpy()
    h, n, d = xc.shape
    bases, invs, stds = [], [], []
    for k in range(h):
        f = fisher[k].astype(np.float64)
        f = 0.5 * (f + f.T)
        f = f + (ridge * max(np.trace(f), 1e-300) / d) * np.eye(d)
        ev, V = np.linalg.eigh(f)
        ev = np.maximum(ev, ev.max() * 1e-12)
        A = (V * np.sqrt(ev)) @ V.T
        Ai = (V / np.sqrt(ev)) @ V.T
        u = xc[k] @ A
        cov = u.T @ u / max(1, n - 1)
        w, U = np.linalg.eigh(cov)
        U = U[:, ::-1]
        idx = np.abs(U).argmax(axis=0)
        sg = np.sign(U[idx, np.arange(d)])
        sg[sg == 0] = 1
        U = U * sg
        bases.append(A @ U)
        invs.append(U.T @ Ai)
        stds.append((u @ U).std(axis=0))
    return (mean.reshape(-1).numpy().astype(np.float32), np.stack(bases).astype(np.float32),
            np.stack(invs).astype(np.float32), np.concatenate(stds).astype(np.float32))


def _water_level(s: np.ndarray, var: np.ndarray, kl: float) -> float:
    """theta with ``0.5 * sum(min(theta, s*var)) == kl`` (reverse water-filling of the weighted noise)."""
    cap = s * var
    if 2.0 * kl >= cap.sum():
        return float(cap.max()) * 4.0
    lo, hi = 1e-40, float(cap.max())
    for _ in range(200):
        mid = float(np.sqrt(lo * hi))
        if np.minimum(mid, cap).sum() > 2.0 * kl:
            hi = mid
        else:
            lo = mid
        if hi <= lo * (1 + 1e-9):
            break
    return lo


def section_steps(
    sections: Sequence[SectionParams], level: int, sensitivity: Sequence | None, kl_scale: float = 1.0
) -> list[np.ndarray]:
    """Step per component for ``level``.

    With sensitivities ``s`` per basis component (KL per unit noise variance, from
    :mod:`cachegen.codec.sensitivity`), a uniform quantizer adds KL about
    ``0.5 * sum(s * min(step**2 / 12, var))``. Equal weighted noise ``theta = s * step**2 / 12``
    on every component whose weighted variance exceeds it (reverse water-filling) is the
    rate-optimal allocation; ``theta`` is solved so the sum meets the level's KL target.
    Without sensitivities the step is a fixed fraction of each section's RMS.
    """
    steps = []
    if sensitivity is not None:
        if len(sensitivity) != len(sections):
            raise ConfigError(f"need one sensitivity per section ({len(sections)}), got {len(sensitivity)}")
        sc = [component_sensitivity(sp, se) for sp, se in zip(sections, sensitivity)]
        s_all = np.concatenate(sc)
        var_all = np.concatenate([sp.std.astype(np.float64) ** 2 for sp in sections])
        theta = _water_level(s_all, var_all, KL_TARGETS[level] * kl_scale)
    for i, s in enumerate(sections):
        if sensitivity is not None:
            base = np.sqrt(12.0 * theta / sc[i]).astype(np.float32)
        else:
            base = np.float32(REL_STEPS[level] * float(np.sqrt(np.mean(s.std.astype(np.float64) ** 2) + 1e-30)))
        st = np.maximum(base, s.std / np.float32(quant.MAX_RATIO))
        st = np.maximum(st, np.float32(1e-12))
        # a step far above the component's spread codes it as all zeros anyway: cap it (keeps classes sane)
        st = np.minimum(st, np.maximum(s.std * np.float32(16.0), np.float32(1e-12)))
        steps.append(st.astype(np.float32))
    return steps


def calibrate(
    samples: list[KVCache],
    model_fingerprint: str,
    *,
    use_pca: bool = True,
    sensitivity: Sequence | None = None,
    kl_scale: float = 1.0,
    n_sink: int = DEFAULT_SINK,
    levels: Sequence[int] = LEVELS,
    meta: dict | None = None,
    weighted_basis: bool = False,
    fisher_ridge: float = 0.05,
    rope: Sequence[RopeSpec | None] | None = None,
    importance_data: Sequence[tuple[KVCache, np.ndarray]] | None = None,
) -> Profile:
    """Build a :class:`Profile` from KV samples alone (no model needed).

    ``sensitivity`` (per section ``2*layer + kv``: a float, a per-channel array or per-head
    Fisher matrices (H, D, D)) comes from :mod:`cachegen.codec.sensitivity` when a model is at hand;
    without it steps are proportional to each section's RMS. ``rope`` (per layer, from
    :func:`cachegen.codec.model_profile.rope_specs`): key sections are modelled and coded
    before RoPE (the Fisher matrices must then be for pre-RoPE keys too).
    ``importance_data``: (context KV, per-token Fisher traces (layers, 2, heads, tokens)) pairs
    from :func:`cachegen.codec.sensitivity.token_sensitivity`; with them every section gets a
    token-importance predictor (:mod:`cachegen.codec.importance`).
    """
    from cachegen.codec.transform import forward_section

    if not samples:
        raise ConfigError("calibration needs at least one KV sample")
    first = samples[0]
    dims = [(int(l.k.shape[0]), int(l.k.shape[2]), int(l.v.shape[2])) for l in first.layers]
    for kv in samples[1:]:
        if [(int(l.k.shape[0]), int(l.k.shape[2]), int(l.v.shape[2])) for l in kv.layers] != dims:
            raise ConfigError("calibration samples have different layouts")
    if rope is not None and len(rope) != len(dims):
        raise ConfigError(f"need one rotary spec (or None) per layer ({len(dims)}), got {len(rope)}")
    sections = []
    for i in range(2 * len(dims)):
        spec = rope[i // 2] if rope is not None and i % 2 == 0 else None
        if spec is not None and spec.rotary_dim > dims[i // 2][1]:
            raise ConfigError(f"rotary spec of layer {i // 2} is wider than its keys")
        x = _section_values(samples, i, n_sink, spec)
        h, d = x.shape[0], x.shape[2]
        if x.shape[1] < 2:  # nothing to learn from: identity transform, unit scale
            sections.append(SectionParams(h, d, np.zeros(h * d, np.float32), np.ones(h * d, np.float32), None, None, spec))
            continue
        inv = None
        sens_i = None if sensitivity is None else np.asarray(sensitivity[i], dtype=np.float64)
        if use_pca and weighted_basis and sens_i is not None and sens_i.shape == (h, d, d):
            mean, basis, inv, std = _fisher_klt(x, sens_i, fisher_ridge)
        elif use_pca:
            mean, basis, std = _pca(x)
        else:
            mean = x.mean(dim=1).reshape(-1).numpy().astype(np.float32)
            std = x.std(dim=1).reshape(-1).numpy().astype(np.float32)
            basis = None
        sections.append(SectionParams(h, d, mean, np.maximum(std, 1e-20).astype(np.float32), basis, inv, spec))
    if importance_data:
        _fit_importance(sections, importance_data, n_sink)
    level_params = {}
    ys = [[forward_section(sections[i], *_nonsink(kv, i, n_sink)) for kv in samples] for i in range(len(sections))]
    us = [[np.zeros(y.shape[0], dtype=np.int64) for y in ys[i]] for i in range(len(sections))]
    u_freqs = None
    if importance_data:
        u_counts = np.ones(importance.N_U)
        for li in range(len(dims)):
            for j, kv in enumerate(samples):
                start = _nonsink(kv, 2 * li, n_sink)[1]
                yk, yv = ys[2 * li][j], ys[2 * li + 1][j]
                pair = importance.layer_multipliers([sections[2 * li].imp, sections[2 * li + 1].imp], yk, yv, dims[li][0],
                                                    start + np.arange(yk.shape[0]))
                for i, u in zip((2 * li, 2 * li + 1), pair):
                    us[i][j] = u
                    u_counts += np.bincount(u - importance.U_MIN, minlength=importance.N_U)
        from cachegen.codec.rans import quantize_counts

        u_freqs = quantize_counts(u_counts, PRECISION)
    for lv in levels:
        if lv not in KL_TARGETS:
            raise ConfigError(f"unknown level {lv}")
        steps = section_steps(sections, lv, sensitivity, kl_scale)
        cls_ = [quant.classes_for(s.std, st) for s, st in zip(sections, steps)]
        counts = np.zeros((quant.N_CLASSES, quant.ALPHABET), dtype=np.float64)
        allow = np.ones((quant.N_CLASSES + 2 * TABLE_PAD, quant.ALPHABET), dtype=np.int64)  # count every symbol
        for i in range(len(sections)):
            for y, u in zip(ys[i], us[i]):
                sym = np.empty(y.shape, dtype=np.uint8)
                esc = np.empty(y.size + 1, dtype=np.int32)
                quant.quantize(y, (1.0 / steps[i]).astype(np.float32), 1.0 / importance.row_scale(u), cls_[i] + TABLE_PAD,
                               -u, allow, sym, esc)
                quant.histogram_classes(sym, cls_[i], counts, -u)
        level_params[lv] = LevelParams(steps, quant.tables_from_counts(counts, PRECISION))
    m = dict(meta or {})
    m.setdefault("use_pca", use_pca)
    m.setdefault("sensitivity", sensitivity is not None)
    if sensitivity is not None:
        m.setdefault("kl_targets", {str(lv): KL_TARGETS[lv] * kl_scale for lv in levels})
    m.setdefault("weighted_basis", any(sp.inv is not None for sp in sections))
    m.setdefault("pre_rope_keys", any(sp.rope is not None for sp in sections))
    if m["weighted_basis"]:
        m.setdefault("fisher_ridge", fisher_ridge)
    m.setdefault("token_importance", u_freqs is not None)
    return Profile(model_fingerprint, dims, sections, level_params, n_sink, m, u_freqs)


def _fit_importance(sections: list[SectionParams], data: Sequence[tuple[KVCache, np.ndarray]], n_sink: int) -> None:
    """Give every section a token-importance predictor fitted on ``data`` (see :func:`calibrate`
    and :func:`cachegen.codec.importance.fit`)."""
    from cachegen.codec.transform import forward_section

    n_layers = len(sections) // 2
    for li in range(n_layers):
        feats, sk, sv = [], [], []
        for kv, sens in data:
            sens = np.asarray(sens, dtype=np.float64)
            if sens.shape[:3] != (n_layers, 2, sections[2 * li].heads) or sens.shape[3] != kv.num_tokens:
                raise ConfigError(f"token sensitivities of shape {sens.shape} do not fit the KV")
            xk, start = _nonsink(kv, 2 * li, n_sink)
            skip = start - kv.start
            yk = forward_section(sections[2 * li], xk, start)
            yv = forward_section(sections[2 * li + 1], *_nonsink(kv, 2 * li + 1, n_sink))
            feats.append(importance.features(yk, yv, sections[2 * li].heads, start + np.arange(yk.shape[0])))
            sk.append(sens[li, 0, :, skip:])
            sv.append(sens[li, 1, :, skip:])
        try:
            sections[2 * li].imp = importance.fit(feats, sk)
            sections[2 * li + 1].imp = importance.fit(feats, sv)
        except ValueError as e:
            raise ConfigError(f"token-importance calibration: {e}") from None
