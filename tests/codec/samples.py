"""Test inputs the codec tests share (imported as ``codec.samples``, see tests/conftest.py)."""

from __future__ import annotations

import numpy as np

from cachegen.kv import KVCache


def planted_sensitivity(kv: KVCache) -> np.ndarray:
    """Per-token sensitivities (layers, 2, heads, tokens) that follow each token's first key
    channel: a token-importance predictor can learn them, so chunks carry a spread of multipliers."""
    out = []
    for l in kv.layers:
        z = l.k[..., 0].double().numpy()
        z = (z - z.mean()) / z.std()
        out.append(np.stack([np.exp(2.0 * z), np.exp(-1.5 * z)]))
    return np.stack(out)
