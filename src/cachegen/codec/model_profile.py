"""Default profiles per model: calibrate once on text, cache under ``$CACHEGEN_HOME/profiles``.

``load_or_calibrate(loaded_model)`` returns the cached profile for the
model's fingerprint or builds it (PCA bases and tables from the KV of
calibration text, step sizes from the model's Fisher sensitivity) in about a
minute. Calibration text defaults to ``corpus.text("pydoc-calib")`` (half of CPython's pydoc topics); keep
evaluation on other text (e.g. the licences in /usr/share/common-licenses).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from cachegen import paths
from cachegen.codec.profile import KL_TARGETS, LEVELS, Profile, calibrate
from cachegen.codec.sensitivity import fisher_matrices
from cachegen.engine.hf_cache import from_transformers, recording_cache

CALIBRATION_VERSION = 2  # 2: pydoc-calib text, per-component Fisher over several contexts
# Measured correction of the Fisher KL prediction (see docs/codec.md); scales every level's target.
KL_SCALE = 1.0


def pydoc_text(max_chars: int = 400_000) -> str:
    """Deduplicated prose of CPython's pydoc topics (the default calibration text)."""
    from pydoc_data.topics import topics

    seen, parts = set(), []
    for k in sorted(topics):
        v = topics[k]
        if v not in seen:
            seen.add(v)
            parts.append(v)
    return "\n\n".join(parts)[:max_chars]


def profile_path(model_fingerprint: str) -> Path:
    return paths.subdir("profiles") / f"{model_fingerprint}-v{CALIBRATION_VERSION}.cgprof"


def _kv_of(model, ids: torch.Tensor):
    with torch.no_grad():
        c = recording_cache(model.config)
        out = model(input_ids=ids[None], cache=c, use_cache=True)
        return from_transformers(out.cache, model.config)


def calibrate_for_model(
    loaded_model,
    texts: Sequence[str] | None = None,
    *,
    sample_tokens: int = 1024,
    n_samples: int = 2,
    fisher_context: int = 512,
    fisher_cont: int = 64,
    n_fisher: int = 4,
    fisher_samples: int = 2,
    use_pca: bool = True,
    kl_scale: float = KL_SCALE,
) -> Profile:
    """Profile for ``loaded_model`` (an engine ``LoadedModel``) from calibration ``texts``."""
    model, tok = loaded_model.model, loaded_model.tokenizer
    if texts:
        text = "\n\n".join(texts)
    else:
        from cachegen import corpus

        text = corpus.text("pydoc-calib")
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    need = n_samples * sample_tokens
    if ids.numel() < max(need, fisher_context + fisher_cont):
        raise ValueError(f"calibration text too short: {ids.numel()} tokens")
    samples = [_kv_of(model, ids[i * sample_tokens : (i + 1) * sample_tokens]) for i in range(n_samples)]
    span = fisher_context + fisher_cont
    # Fisher contexts: after the PCA samples when the text is long enough, else from the start
    f0 = need if ids.numel() >= need + n_fisher * span else 0
    n_f = max(1, min(n_fisher, (ids.numel() - f0) // span))
    pairs = [(ids[f0 + j * span : f0 + j * span + fisher_context], ids[f0 + j * span + fisher_context : f0 + (j + 1) * span]) for j in range(n_f)]
    sens = fisher_matrices(model, pairs, samples=fisher_samples)
    meta = {"calibration": "pydoc-calib" if not texts else "custom", "sample_tokens": sample_tokens, "n_samples": n_samples, "n_fisher": n_f}
    return calibrate(samples, loaded_model.fingerprint, use_pca=use_pca, sensitivity=sens, kl_scale=kl_scale, meta=meta)


def load_or_calibrate(loaded_model, refresh: bool = False) -> Profile:
    """The cached default profile of ``loaded_model``, calibrating (and saving) it on first use."""
    p = profile_path(loaded_model.fingerprint)
    if p.exists() and not refresh:
        try:
            prof = Profile.load(p)
            want = {str(lv): KL_TARGETS[lv] * KL_SCALE for lv in LEVELS}
            if prof.model_fingerprint == loaded_model.fingerprint and prof.meta.get("kl_targets") == want:
                return prof  # else: stale (the level ladder changed), recalibrate
        except Exception:  # damaged cache file: rebuild
            pass
    prof = calibrate_for_model(loaded_model)
    prof.save(p)
    return prof
