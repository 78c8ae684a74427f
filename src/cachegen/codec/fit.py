"""Fitting a :class:`~cachegen.codec.profile.Profile` from KV samples and sensitivities (no model needed).

Why apart from the profile's format: fitting is the maths that decides the
steps and tables (PCA or a Fisher-weighted KLT per head, reverse water-filling
of the weighted noise against each level's KL target, table counts); the
format only has to read and check what a fit wrote. Sensitivities come from a
live model through :mod:`cachegen.calibrate`, which calls :func:`calibrate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

from cachegen.codec import importance, quant
from cachegen.codec.profile import (
    DEFAULT_SINK,
    KL_TARGETS,
    LEVELS,
    PRECISION,
    REL_STEPS,
    TABLE_PAD,
    LevelParams,
    Profile,
    SectionParams,
    kl_targets,
)
from cachegen.codec.rans import quantize_counts
from cachegen.codec.rope import RopeSpec, unrope
from cachegen.codec.transform import forward_section
from cachegen.errors import ConfigError
from cachegen.kv import KVCache


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
    return (
        mean.reshape(-1).numpy().astype(np.float32),
        evecs.numpy().astype(np.float32),
        std.reshape(-1).numpy().astype(np.float32),
    )


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
        # inv is the inverse of a basis, so r is an array when sp.inv is set
        rr = cast(np.ndarray, r)
        return out if sp.inv is None else np.maximum(out * np.einsum("hjd,hjd->hj", rr, rr).reshape(-1), 1e-30)
    if a.shape == (sp.heads, sp.dim, sp.dim):
        out = (
            np.diagonal(a, axis1=1, axis2=2).reshape(-1)
            if r is None
            else np.einsum("hjd,hde,hje->hj", r, a, r).reshape(-1)
        )
    elif a.shape == (n,):
        out = a if r is None else np.einsum("hjd,hd->hj", r * r, a.reshape(sp.heads, sp.dim)).reshape(-1)
    else:
        raise ConfigError(f"sensitivity of shape {a.shape} does not fit a section of {sp.heads} heads x {sp.dim}")
    return np.maximum(out, 1e-30)


def _fisher_klt(
    x: torch.Tensor, fisher: np.ndarray, ridge: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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
        _w, U = np.linalg.eigh(cov)
        U = U[:, ::-1]
        idx = np.abs(U).argmax(axis=0)
        sg = np.sign(U[idx, np.arange(d)])
        sg[sg == 0] = 1
        U = U * sg
        bases.append(A @ U)
        invs.append(U.T @ Ai)
        stds.append((u @ U).std(axis=0))
    return (
        mean.reshape(-1).numpy().astype(np.float32),
        np.stack(bases).astype(np.float32),
        np.stack(invs).astype(np.float32),
        np.concatenate(stds).astype(np.float32),
    )


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
    :mod:`cachegen.calibrate.sensitivity`), a uniform quantizer adds KL about
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
        base: np.ndarray | np.float32
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
    Fisher matrices (H, D, D)) comes from :mod:`cachegen.calibrate.sensitivity` when a model is at hand;
    without it steps are proportional to each section's RMS. ``rope`` (per layer, from
    :func:`cachegen.calibrate.rope_specs`): key sections are modelled and coded
    before RoPE (the Fisher matrices must then be for pre-RoPE keys too).
    ``importance_data``: (context KV, per-token Fisher traces (layers, 2, heads, tokens)) pairs
    from :func:`cachegen.calibrate.sensitivity.token_sensitivity`; with them every section gets a
    token-importance predictor (:mod:`cachegen.codec.importance`).
    """
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
            sections.append(
                SectionParams(h, d, np.zeros(h * d, np.float32), np.ones(h * d, np.float32), None, None, spec)
            )
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
        # the multipliers (their table, and the rows' table shifts below) as a store writes them:
        # with each sample's end known (a context's end then follows its last token)
        u_counts = np.ones(importance.N_U)
        for li in range(len(dims)):
            for j, kv in enumerate(samples):
                start = _nonsink(kv, 2 * li, n_sink)[1]
                yk, yv = ys[2 * li][j], ys[2 * li + 1][j]
                pair = importance.layer_multipliers(
                    [sections[2 * li].imp_end, sections[2 * li + 1].imp_end],
                    yk,
                    yv,
                    dims[li][0],
                    start + np.arange(yk.shape[0]),
                    kv.end,
                )
                for i, u in zip((2 * li, 2 * li + 1), pair):
                    us[i][j] = u
                    u_counts += np.bincount(u - importance.U_MIN, minlength=importance.N_U)
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
                quant.quantize(
                    y,
                    (1.0 / steps[i]).astype(np.float32),
                    1.0 / importance.row_scale(u),
                    cls_[i] + TABLE_PAD,
                    -u,
                    allow,
                    sym,
                    esc,
                )
                quant.histogram_classes(sym, cls_[i], counts, -u)
        level_params[lv] = LevelParams(steps, quant.tables_from_counts(counts, PRECISION))
    m = dict(meta or {})
    m.setdefault("use_pca", use_pca)
    m.setdefault("sensitivity", sensitivity is not None)
    if sensitivity is not None:
        m.setdefault("kl_targets", kl_targets(kl_scale, levels))
    m.setdefault("weighted_basis", any(sp.inv is not None for sp in sections))
    m.setdefault("pre_rope_keys", any(sp.rope is not None for sp in sections))
    if m["weighted_basis"]:
        m.setdefault("fisher_ridge", fisher_ridge)
    m.setdefault("token_importance", u_freqs is not None)
    return Profile(model_fingerprint, dims, sections, level_params, n_sink, m, u_freqs)


def _fit_importance(sections: list[SectionParams], data: Sequence[tuple[KVCache, np.ndarray]], n_sink: int) -> None:
    """Give every section its two token-importance predictors fitted on ``data`` (see
    :func:`calibrate` and :func:`cachegen.codec.importance.fit`): ``imp`` for an unknown context
    end, ``imp_end`` for a known one (each context's continuation follows its last token)."""
    n_layers = len(sections) // 2
    for li in range(n_layers):
        feats, feats_end, sk, sv = [], [], [], []
        for kv, sens in data:
            sens = np.asarray(sens, dtype=np.float64)
            if sens.shape[:3] != (n_layers, 2, sections[2 * li].heads) or sens.shape[3] != kv.num_tokens:
                raise ConfigError(f"token sensitivities of shape {sens.shape} do not fit the KV")
            xk, start = _nonsink(kv, 2 * li, n_sink)
            skip = start - kv.start
            yk = forward_section(sections[2 * li], xk, start)
            yv = forward_section(sections[2 * li + 1], *_nonsink(kv, 2 * li + 1, n_sink))
            positions = start + np.arange(yk.shape[0])
            feats.append(importance.features(yk, yv, sections[2 * li].heads, positions))
            feats_end.append(importance.features(yk, yv, sections[2 * li].heads, positions, kv.end))
            sk.append(sens[li, 0, :, skip:])
            sv.append(sens[li, 1, :, skip:])
        try:
            for sp, sens_j in ((sections[2 * li], sk), (sections[2 * li + 1], sv)):
                sp.imp = importance.fit(feats, sens_j)
                sp.imp_end = importance.fit(feats_end, sens_j, exclude_tail=0)
        except ValueError as e:
            raise ConfigError(f"token-importance calibration: {e}") from None
