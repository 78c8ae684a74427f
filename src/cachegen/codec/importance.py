"""Token importance: a per-token step multiplier, predicted from the token's own keys and values.

Why: the KL that quantization noise on one token adds is proportional to how much
later queries use that token, and that varies by orders of magnitude from token to
token. It is mostly a property of the token, not of what follows: per-token Fisher
traces from two unrelated continuations of one context correlate at 0.82-0.84 (of
their logs), and a linear model of a head's pre-RoPE key and value predicts the
log-sensitivity with R^2 ~0.5 on text it was not fitted on. Steps scaled by
``2^(u/2)`` with ``u ~ -log2(predicted sensitivity)`` (coarser on tokens predicted to
matter little, finer on the few that matter a lot) cost 0.6-0.8 bits/value less at
equal KL (docs/codec.md).

Where the context ends matters as much as the token itself: the continuation attends most to
the tokens just before it (within the last 128 tokens of a 2K context a token's Fisher trace is
~30x a distant one's, e^3.4 on average over sections). A chunk does not know by itself whether
it is near the end, so each section has two predictors: one for an unknown end (fitted away
from the end, its offset solved over every token, as if any token could be recent), and one
that also reads the token's distance to the end (``context_end`` given to the encoder: the store
knows where the context it writes ends). The second spends the bits where the next tokens will
look: 2.93 -> 2.57 b/v at the strict budget, 1.91 -> 1.59 at the loose one (docs/codec.md).

The encoder predicts; each chunk carries the integer ``u`` of every (token, section)
(entropy-coded, ~0.015 b/v), so the decoder never runs the predictor and a new
predictor never changes the format. Predictions are per head and combined per token
(the log of the mean predicted sensitivity over heads: averaging also cancels some of
each head's prediction noise, measured better than a multiplier per head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

U_MIN, U_MAX = -2, 4  # step multiplier 2^(u/2): 0.5 (finer) .. 4 (coarser)
N_U = U_MAX - U_MIN + 1
POS_CAP = 2048  # positions beyond this count as this (calibration contexts are ~2K tokens)
N_EXTRA = 3  # log |key|, log |value|, log position
# distance to the context's end (tokens after this one, before the continuation): exp(-d / scale)
DIST_SCALES = (4.0, 16.0, 64.0, 256.0, 1024.0)
N_DIST = len(DIST_SCALES)
_EPS = 1e-6
RIDGE = 10.0  # on standardized features
EXCLUDE_TAIL = 256  # calibration tokens this close to the continuation are dominated by recency
OFFSET_MARGIN = 1e-3  # nats past the solved offset (see fit)


@dataclass
class ImportanceModel:
    """Predictor of one section's log-sensitivity per token: ``weights`` (H, F + 1), last column
    the bias, over ``features`` of the layer's key and value of each head (and, for a model of a
    known context end, the token's :func:`distance_features`); ``offset`` shifts the combined
    prediction so that the level's KL target holds on calibration text."""

    weights: np.ndarray  # (H, F + 1) float32
    offset: float

    def log_sensitivity(self, feats: np.ndarray) -> np.ndarray:
        """feats (H, T, F) -> (T,) log of the mean predicted sensitivity over heads, plus the offset."""
        w = self.weights.astype(np.float64)
        return self.combine_heads(np.einsum("htf,hf->ht", feats, w[:, :-1]) + w[:, -1:])

    def combine_heads(self, pred: np.ndarray) -> np.ndarray:
        """Per-head log-sensitivities (H, T) -> (T,): the log of their mean, plus the offset."""
        m = pred.max(axis=0)
        return m + np.log(np.exp(pred - m).mean(axis=0)) + self.offset


def distance_features(positions: np.ndarray, context_end: int) -> np.ndarray:
    """(T, N_DIST) float64: ``exp(-d / scale)`` for each of :data:`DIST_SCALES`, ``d`` the number
    of context tokens after each position (0 for the last one before ``context_end``)."""
    d = (int(context_end) - 1 - positions.astype(np.int64)).astype(np.float64)
    return np.exp(-d[:, None] / np.asarray(DIST_SCALES)[None, :])


def features(
    yk: np.ndarray, yv: np.ndarray, heads: int, positions: np.ndarray, context_end: int | None = None
) -> np.ndarray:
    """(H, T, Dk + Dv + 3) float64 from a layer's transformed key and value sections (T, H*D):
    each head's key and value components, the logs of their norms and of the (capped) position;
    with ``context_end``, N_DIST more: the :func:`distance_features`."""
    t = yk.shape[0]
    k = yk.reshape(t, heads, -1).transpose(1, 0, 2).astype(np.float64)
    v = yv.reshape(t, heads, -1).transpose(1, 0, 2).astype(np.float64)
    lk = np.log(np.sqrt((k * k).sum(-1)) + _EPS)[..., None]
    lv = np.log(np.sqrt((v * v).sum(-1)) + _EPS)[..., None]
    lp = np.log(np.minimum(positions.astype(np.float64), POS_CAP) + 1.0)
    lp = np.broadcast_to(lp[None, :, None], (heads, t, 1))
    parts = [k, v, lk, lv, lp]
    if context_end is not None:
        df = distance_features(positions, context_end)
        parts.append(np.broadcast_to(df[None], (heads, t, N_DIST)))
    return np.concatenate(parts, axis=2)


def to_u(log_sens: np.ndarray) -> np.ndarray:
    """Integer ``u`` (int64, in [U_MIN, U_MAX]) from log-sensitivities: ``2^u ~ 1 / sensitivity``."""
    return np.clip(np.rint(-log_sens / np.log(2.0)), U_MIN, U_MAX).astype(np.int64)


def layer_multipliers(
    models: Sequence[ImportanceModel | None],
    yk: np.ndarray,
    yv: np.ndarray,
    heads: int,
    positions: np.ndarray,
    context_end: int | None = None,
) -> list[np.ndarray]:
    """``u`` per token for each of ``models`` (a layer's K and V sections; None: zeros) from the
    layer's transformed sections (T, H*D) float32: ``to_u(model.log_sensitivity(features(...)))``
    without building the feature matrix (~20x less memory traffic; the encoder's and the
    calibration's path). ``context_end``: the models are those of a known end (their weights
    read the :func:`distance_features` too)."""
    t = yk.shape[0]
    if t == 0 or all(m is None for m in models):
        return [np.zeros(t, dtype=np.int64) for _ in models]
    k = yk.reshape(t, heads, -1)
    v = yv.reshape(t, heads, -1)
    dk, dv = k.shape[2], v.shape[2]
    lk = np.log(np.sqrt(np.einsum("thd,thd->th", k, k, dtype=np.float64)) + _EPS)
    lv = np.log(np.sqrt(np.einsum("thd,thd->th", v, v, dtype=np.float64)) + _EPS)
    lp = np.log(np.minimum(positions.astype(np.float64), POS_CAP) + 1.0)[:, None]
    df = None if context_end is None else distance_features(positions, context_end)
    out = []
    for m in models:
        if m is None:
            out.append(np.zeros(t, dtype=np.int64))
            continue
        w = m.weights
        pred = (
            np.einsum("thd,hd->th", k, w[:, :dk]).astype(np.float64)
            + np.einsum("thd,hd->th", v, w[:, dk : dk + dv])
            + lk * w[:, dk + dv].astype(np.float64)
            + lv * w[:, dk + dv + 1].astype(np.float64)
            + lp * w[:, dk + dv + 2].astype(np.float64)
            + w[:, -1].astype(np.float64)
        )
        if df is not None:
            pred += df @ w[:, dk + dv + N_EXTRA : -1].T.astype(np.float64)
        out.append(to_u(m.combine_heads(pred.T)))
    return out


def row_scale(u: np.ndarray) -> np.ndarray:
    """Step multiplier ``2^(u/2)`` per row (float32)."""
    return np.exp2(u.astype(np.float64) / 2.0).astype(np.float32)


def fit(feats: Sequence[np.ndarray], sens: Sequence[np.ndarray], exclude_tail: int = EXCLUDE_TAIL) -> ImportanceModel:
    """Fit one section's predictor from calibration contexts: ``feats[j]`` (H, T_j, F) and
    ``sens[j]`` (H, T_j) per-token Fisher traces (sum of squared gradients over the head's
    dimensions) of context ``j``, its continuation right after token ``T_j - 1``.

    Per head, a ridge regression of log sensitivity on standardized features, on all but the
    last ``exclude_tail`` tokens of each context (their sensitivity comes mostly from being
    next to the continuation, which a chunk cannot know about itself). The offset is then
    solved over *all* tokens so that the token-weighted noise is unchanged,
    ``sum_t r_t 2^u_t == sum_t r_t`` with ``r_t`` the section's true per-token sensitivity:
    the level's steps (set for the average token by the Fisher water-filling) then still meet
    its KL target in contexts like the calibration ones, the recent tokens included. A model of
    a known end (features with :func:`distance_features`) is fitted with ``exclude_tail=0``:
    it can see which tokens are recent."""
    X = np.concatenate([f[:, : max(f.shape[1] - exclude_tail, 0)] for f in feats], axis=1)  # (H, N, F)
    S = np.concatenate([s[:, : max(s.shape[1] - exclude_tail, 0)] for s in sens], axis=1)  # (H, N)
    h, n, f = X.shape
    if n < 16:
        raise ValueError(f"token-importance fit needs contexts longer than {exclude_tail + 16} tokens")
    weights = np.zeros((h, f + 1))
    for k in range(h):
        # tokens the continuation cannot see (outside a sliding window) have no gradient: no evidence
        ok = S[k] > 1e-30 * max(float(S[k].max()), 1e-300)
        if ok.sum() < 16:
            continue
        xk, y = X[k][ok], np.log(S[k][ok])
        mu, sd = xk.mean(0), xk.std(0) + 1e-9
        Z = np.concatenate([(xk - mu) / sd, np.ones((len(y), 1))], axis=1)
        reg = RIDGE * np.eye(f + 1)
        reg[-1, -1] = 0.0
        w = np.linalg.solve(Z.T @ Z + reg, Z.T @ y)
        weights[k, :-1] = w[:-1] / sd
        weights[k, -1] = w[-1] - float((mu / sd) @ w[:-1])
    model = ImportanceModel(weights.astype(np.float32), 0.0)
    d0 = np.concatenate([model.log_sensitivity(fj) for fj in feats])
    r = np.concatenate([sj.sum(axis=0) for sj in sens])
    target = r.sum()

    def noise(off: float) -> float:
        return float((r * np.exp2(to_u(d0 + off))).sum())

    lo, hi = -60.0, 60.0  # noise(lo) >= target >= noise(hi): u is non-increasing in the offset
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if noise(mid) > target:
            lo = mid
        else:
            hi = mid
    # The solution sits where some calibration token's u changes: a little past it (the noise only
    # falls), so that no token is left on a rounding edge where the encoder's float32 products and a
    # float64 path could disagree; and as the profile file stores it (float32), rounded up, so a
    # loaded profile predicts the same u as the one just fitted.
    off = np.float32(hi + OFFSET_MARGIN)
    model.offset = float(off if off >= hi + OFFSET_MARGIN else np.nextafter(off, np.float32(np.inf)))
    return model
