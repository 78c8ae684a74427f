"""Undo rotary position embedding (RoPE) on keys before coding them, redo it after.

Why: a cache holds keys *after* RoPE, which rotates each channel pair by an angle
that grows with the token's position. A key direction that is constant across
tokens before RoPE (the large, steady "outlier" channels of real models) turns
into a rotating vector after it, whose energy no fixed basis can compact, and a
profile calibrated at positions 0..2K does not match the statistics at 40K.
Before RoPE the statistics do not depend on position: the per-head PCA basis
then compacts far more (measured on SmolLM2 K: -0.85 bits per key value at equal
error, docs/codec.md). Quantizing pre-RoPE keys is KVQuant's observation.

The transform is an exact rotation (times the model's attention scaling), so it
is always invertible: a model whose RoPE convention differs from the one assumed
here loses compression, never correctness. Convention: Hugging Face's
``rotate_half`` (pairs ``(j, j + r/2)`` over the first ``r`` channels), angles
``position * inv_freq`` computed in float32 as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from numba import njit

from cachegen.codec import _numba_env  # noqa: F401  (sets NUMBA_CACHE_DIR before numba loads)


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """One layer's rotary embedding: ``inv_freq`` (r/2,) and the attention scaling of cos/sin."""

    inv_freq: np.ndarray  # float32 (r/2,); channels >= r pass through unrotated
    scale: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])

    def to_array(self) -> np.ndarray:
        return np.concatenate([self.inv_freq.astype(np.float32), np.float32([self.scale])])  # type: ignore[arg-type]  # numpy stubs: a list gives an array

    @classmethod
    def from_array(cls, a: np.ndarray) -> RopeSpec:
        return cls(np.ascontiguousarray(a[:-1], dtype=np.float32), float(a[-1]))

    def cos_sin(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, r) cos and sin (already times ``scale``) for positions ``start .. start + n - 1``."""
        c, s = _half_tables(self.inv_freq.tobytes(), float(self.scale), int(start), int(n))
        return torch.from_numpy(np.concatenate((c, c), axis=1)), torch.from_numpy(np.concatenate((s, s), axis=1))

    def half_tables(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(n, r/2) cos and sin (times ``scale``) for positions ``start ..`` (cached per chunk)."""
        return _half_tables(self.inv_freq.tobytes(), float(self.scale), int(start), int(n))


@lru_cache(maxsize=16)
def _half_tables(inv_freq: bytes, scale: float, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, r/2) cos and sin times ``scale``; one chunk's layers share them (cached)."""
    inv = np.frombuffer(inv_freq, dtype=np.float32)
    pos = np.arange(start, start + n, dtype=np.int64).astype(np.float32)
    freqs = pos[:, None] * inv[None, :]  # float32, as transformers computes the angles
    return (np.cos(freqs) * np.float32(scale)).astype(np.float32), (np.sin(freqs) * np.float32(scale)).astype(
        np.float32
    )


@njit(nogil=True, cache=True, boundscheck=False)
def _rotate(x, cos_h, sin_h, sign, factor, out):
    """Pairs ``(j, j + r/2)`` of each token: ``(a, b) -> factor * (a c - b s', b c + a s')``, ``s' = sign * s``."""
    H, T, D = x.shape
    r2 = cos_h.shape[1]
    for h in range(H):
        for t in range(T):
            for j in range(r2):
                a = x[h, t, j]
                b = x[h, t, j + r2]
                c = cos_h[t, j]
                s = sin_h[t, j] * sign
                out[h, t, j] = factor * (a * c - b * s)
                out[h, t, j + r2] = factor * (b * c + a * s)
            for j in range(2 * r2, D):
                out[h, t, j] = x[h, t, j]


def _apply(x: torch.Tensor, spec: RopeSpec, start: int, inverse: bool, grad: bool = False) -> torch.Tensor:
    """x (H, T, D) float32; rotates the first ``rotary_dim`` channels."""
    if x.shape[1] == 0 or spec.rotary_dim == 0:
        return x
    cos_h, sin_h = _half_tables(spec.inv_freq.tobytes(), float(spec.scale), int(start), int(x.shape[1]))
    xn = np.ascontiguousarray(x.detach().numpy())
    out = np.empty_like(xn)
    # R^-1 y = R^T y / scale^2; the gradient w.r.t. the pre-RoPE key is R^T g
    factor = 1.0 / (spec.scale * spec.scale) if inverse and not grad else 1.0
    _rotate(xn, cos_h, sin_h, np.float32(-1.0 if inverse else 1.0), np.float32(factor), out)
    return torch.from_numpy(out)


def unrope(x: torch.Tensor, spec: RopeSpec | None, start: int) -> torch.Tensor:
    """Post-RoPE keys (H, T, D) at positions ``start..`` -> pre-RoPE keys (float32)."""
    x = x.to(torch.float32)
    return x if spec is None else _apply(x, spec, start, inverse=True)


def rope(x: torch.Tensor, spec: RopeSpec | None, start: int) -> torch.Tensor:
    """Inverse of :func:`unrope`."""
    x = x.to(torch.float32)
    return x if spec is None else _apply(x, spec, start, inverse=False)


def unrope_grad(g: torch.Tensor, spec: RopeSpec | None, start: int) -> torch.Tensor:
    """Gradient w.r.t. post-RoPE keys -> gradient w.r.t. pre-RoPE keys (``R^T g``)."""
    if spec is None:
        return g
    return _apply(g.to(torch.float32), spec, start, inverse=True, grad=True).to(g.dtype)


@njit(nogil=True, cache=True, boundscheck=False)
def finish(z, mean, cos_h, sin_h, out):
    """One head, float32: ``out[t] = rope(z[t] + mean)`` (pairs ``(j, j + r/2)``,
    ``r = 2 * cos_h.shape[1]``, no rotation when it is 0: the forward rotation of :func:`rope`,
    value for value), written into ``out``, a view of the cache itself.

    Why one pass: the mean and the rotation each took a pass over the section, and a
    concatenation with the sink tokens and a copy into the cache two more."""
    T, D = z.shape
    r2 = cos_h.shape[1]
    for t in range(T):
        zr = z[t]
        o = out[t]
        if r2:  # no rows of cos_h without rotary dims (a stand-in row per token allocated: 4x slower)
            cr = cos_h[t]
            sr = sin_h[t]
            for j in range(r2):
                a = zr[j] + mean[j]
                b = zr[j + r2] + mean[j + r2]
                o[j] = a * cr[j] - b * sr[j]
                o[j + r2] = b * cr[j] + a * sr[j]
        for j in range(2 * r2, D):
            o[j] = zr[j] + mean[j]
