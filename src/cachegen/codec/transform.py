"""Per-section linear transform: mean removal and an optional per-head orthonormal basis.

Why per head: a PCA basis concentrates each head's energy in few components,
so entropy coding spends almost nothing on the rest (-0.2 bits/value measured),
and a per-head (D x D) basis costs D/(H*D) of a full-channel one to apply.
Output is token-major ``(tokens, heads*dim)``, the layout the rANS kernels use.
Key sections of RoPE models first have their rotary embedding undone
(:mod:`cachegen.codec.rope`), which needs the tokens' absolute positions.
"""

from __future__ import annotations

import numpy as np
import torch

from cachegen.codec.profile import SectionParams
from cachegen.codec.rope import finish, unrope


def forward_section(sp: SectionParams, x: torch.Tensor, start: int = 0) -> np.ndarray:
    """x (H, T, D) at positions ``start..`` -> y (T, H*D) float32, ``y = (unrope(x) - mean) @ basis`` per head."""
    h, t, d = x.shape
    x = unrope(x, sp.rope, start)
    xc = x - torch.from_numpy(sp.mean).view(h, 1, d)
    if sp.basis is not None:
        xc = torch.bmm(xc, torch.from_numpy(sp.basis))  # per head (T, D) @ (D, D): bmm beats einsum here
    return np.ascontiguousarray(xc.permute(1, 0, 2).reshape(t, h * d).numpy())


def inverse_section(
    sp: SectionParams, y: np.ndarray, heads: int, dim: int, dtype: torch.dtype, start: int = 0
) -> torch.Tensor:
    """y (T, H*D) -> x (H, T, D) in ``dtype`` (``x = rope(y @ inv + mean)``, ``inv = basis.T`` unless given)."""
    out = torch.empty((heads, y.shape[0], dim), dtype=dtype)
    inverse_section_into(sp, y, out, start)
    return out


_NO_ROPE = np.empty((0, 0), dtype=np.float32)


def inverse_section_into(sp: SectionParams, y: np.ndarray, out: torch.Tensor, start: int = 0) -> None:
    """:func:`inverse_section` written into ``out`` (H, T, D), a view such as one chunk's range of
    a preallocated cache (the caller checks the values: :func:`cachegen.codec.codec.all_finite`).

    Why: the PCA product is the only pass that needs torch; the mean, the rotation and the
    cast then take one pass per head (:func:`cachegen.codec.rope.finish`) straight into the
    destination (float32) or a float32 buffer cast into it (another dtype). (Measured against
    the product and the mean as one ``baddbmm`` into the cache and the rotation in place: faster
    on one thread, 0.129 s against 0.122 s for a whole 4K-token decode on two, where each pool
    thread's torch call starts its own OpenMP team and the broadcast of the mean is one more.)"""
    heads, t, dim = out.shape
    yt = torch.from_numpy(y).view(t, heads, dim).transpose(0, 1)  # (H, T, D) view
    if sp.inv is not None:
        z = torch.bmm(yt, torch.from_numpy(sp.inv))
    elif sp.basis is not None:
        z = torch.bmm(yt, torch.from_numpy(sp.basis).transpose(1, 2))
    else:
        z = yt
    if sp.rope is not None and sp.rope.rotary_dim and t:
        cos_h, sin_h = sp.rope.half_tables(start, t)
    else:
        cos_h = sin_h = _NO_ROPE
    zn, mean = z.numpy(), sp.mean.reshape(heads, dim)
    dst = out.numpy() if out.dtype == torch.float32 else np.empty((heads, t, dim), dtype=np.float32)
    for h in range(heads):
        finish(zn[h], mean[h], cos_h, sin_h, dst[h])
    if out.dtype != torch.float32:
        out.copy_(torch.from_numpy(dst))  # torch's cast: round to nearest even, as before
