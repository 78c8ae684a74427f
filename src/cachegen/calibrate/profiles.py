"""Default profiles per model: calibrate once on text, cache under ``$CACHEGEN_HOME/profiles``.

``load_or_calibrate(loaded_model)`` returns the cached profile for the
model's fingerprint or builds it (PCA bases and tables from the KV of
calibration text, step sizes from the model's Fisher sensitivity, token
importance from per-token Fisher traces) in ~30 s on a laptop CPU for SmolLM2-135M. Calibration text defaults to ``corpus.text("calib")`` (half of CPython's pydoc topics
interleaved with the non-FSF licences); keep evaluation on other text (the GPL family,
Apache-2.0, ``pydoc-eval``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cachegen import paths
from cachegen.calibrate.sensitivity import context_kv, fisher_matrices, token_sensitivity
from cachegen.codec.fit import calibrate
from cachegen.codec.profile import Profile, kl_targets
from cachegen.codec.rope import RopeSpec
from cachegen.engine.attention import stock_sdpa

log = logging.getLogger(__name__)

CALIBRATION_VERSION = (
    6  # 2: pydoc-calib, per-component Fisher over several contexts; 3: pre-RoPE keys; 4: the "calib" mix;
)
# 5: token importance; 6: a second importance predictor for a known context end
# Measured correction of the Fisher KL prediction (see docs/codec.md); scales every level's target.
KL_SCALE = 1.0
# Per model (by name): a factor on every level's KL target so that its levels land where SmolLM2's
# do. A level's realized KL sits at a model-specific multiple of the Fisher prediction its steps
# are set by; python -m cachegen.bench.level_placement measures that multiple on held-out
# calibration text (results/level_placement.json) and prints these factors.
KL_SCALES: dict[str, float] = {"gemma3-270m": 0.203}


def kl_scale_for(loaded_model) -> float:
    """The KL-target factor of ``loaded_model``'s default profile (:data:`KL_SCALES`)."""
    return KL_SCALES.get(getattr(loaded_model, "name", ""), KL_SCALE)


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


def rope_specs(model) -> list[RopeSpec | None]:
    """Per layer, the rotary embedding the model applies to its cached keys (None: not found).

    Read from the model's rotary module (``inv_freq`` / ``<layer_type>_inv_freq`` and the
    attention scaling) and checked against the module's own cos/sin at a few positions;
    any mismatch (an unknown RoPE variant) gives None for that layer, which only costs
    compression."""
    import inspect

    import numpy as np

    cfg = model.config
    n_layers = int(cfg.num_hidden_layers)
    rot = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rot is None:
        return [None] * n_layers
    takes_type = "layer_type" in inspect.signature(rot.forward).parameters
    types = list(getattr(cfg, "layer_types", None) or [None] * n_layers)
    found: dict = {}

    def spec_for(lt) -> RopeSpec | None:
        pre = f"{lt}_" if (takes_type and lt) else ""
        inv = getattr(rot, f"{pre}inv_freq", None)
        scale = getattr(rot, f"{pre}attention_scaling", getattr(rot, "attention_scaling", 1.0))
        if inv is None or scale is None:
            return None
        spec = RopeSpec(inv.detach().to(torch.float32).numpy().copy(), float(scale))
        pos = torch.tensor([[0, 1, 777, 4095]])
        x = torch.zeros(1, 4, spec.rotary_dim, dtype=torch.float32)
        try:
            with torch.no_grad():
                cos, sin = rot(x, pos, lt) if takes_type and lt else rot(x, pos)
        except Exception:  # an unfamiliar rotary module: code keys as they are (costs compression only)
            return None
        want = [spec.cos_sin(p, 1) for p in (0, 1, 777, 4095)]
        if cos.shape[-1] != spec.rotary_dim:
            return None
        wc = torch.cat([c for c, _ in want])
        ws = torch.cat([s for _, s in want])
        if not (
            np.allclose(cos[0].numpy(), wc.numpy(), atol=1e-4) and np.allclose(sin[0].numpy(), ws.numpy(), atol=1e-4)
        ):
            return None
        return spec

    out = []
    for li in range(n_layers):
        lt = types[li] if li < len(types) else None
        if lt not in found:
            found[lt] = spec_for(lt)
        out.append(found[lt])
    return out


@dataclass(frozen=True)
class CalibrationWindows:
    """Token spans of the calibration text that each phase reads: ``samples`` (start, end) for the
    PCA and tables, ``fisher`` and ``importance`` (start, context end, continuation end)."""

    samples: list[tuple[int, int]]
    fisher: list[tuple[int, int, int]]
    importance: list[tuple[int, int, int]]

    @property
    def end(self) -> int:
        """The first token no phase reads: held-out text starts there (when the text is long enough)."""
        return max([b for _, b in self.samples] + [c for *_, c in self.fisher + self.importance])


def calibration_windows(
    n_tokens: int,
    *,
    sample_tokens: int = 1024,
    n_samples: int = 2,
    fisher_context: int = 512,
    fisher_cont: int = 64,
    n_fisher: int = 4,
    importance_context: int = 2048,
    importance_cont: int = 256,
    n_importance: int = 2,
) -> CalibrationWindows:
    """Where :func:`calibrate_for_model` reads a calibration text of ``n_tokens``: the PCA samples
    first, then the Fisher contexts, then the token-importance ones (each phase starts again from
    the text's beginning when the rest is too short for it)."""
    need = n_samples * sample_tokens
    if n_tokens < max(need, fisher_context + fisher_cont):
        raise ValueError(f"calibration text too short: {n_tokens} tokens")
    samples = [(i * sample_tokens, (i + 1) * sample_tokens) for i in range(n_samples)]
    span = fisher_context + fisher_cont
    f0 = need if n_tokens >= need + n_fisher * span else 0
    n_f = max(1, min(n_fisher, (n_tokens - f0) // span))
    fisher = [(f0 + j * span, f0 + j * span + fisher_context, f0 + (j + 1) * span) for j in range(n_f)]
    # token importance: long contexts (position and distance effects as in use), after the Fisher text
    ispan = importance_context + importance_cont
    i0 = f0 + n_f * span
    if n_tokens < i0 + ispan:
        i0 = 0
    n_i = min(n_importance, (n_tokens - i0) // ispan) if n_importance > 0 else 0
    imp = [(i0 + j * ispan, i0 + j * ispan + importance_context, i0 + (j + 1) * ispan) for j in range(n_i)]
    return CalibrationWindows(samples, fisher, imp)


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
    kl_scale: float | None = None,
    pre_rope: bool = True,
    importance_context: int = 2048,
    importance_cont: int = 256,
    n_importance: int = 2,
    importance_samples: int = 1,
) -> Profile:
    """Profile for ``loaded_model`` (an engine ``LoadedModel``) from calibration ``texts``
    (on transformers' own attention: :func:`~cachegen.engine.attention.stock_sdpa`).
    ``kl_scale``: the factor on every level's KL target (default: the model's, :func:`kl_scale_for`)."""
    with stock_sdpa(loaded_model.model):
        model, tok = loaded_model.model, loaded_model.tokenizer
        if texts:
            text = "\n\n".join(texts)
        else:
            from cachegen import corpus

            text = corpus.text("calib")
        ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
        w = calibration_windows(
            ids.numel(),
            sample_tokens=sample_tokens,
            n_samples=n_samples,
            fisher_context=fisher_context,
            fisher_cont=fisher_cont,
            n_fisher=n_fisher,
            importance_context=importance_context,
            importance_cont=importance_cont,
            n_importance=n_importance,
        )
        samples = [context_kv(model, ids[a:b]) for a, b in w.samples]
        pairs = [(ids[a:b], ids[b:c]) for a, b, c in w.fisher]
        rope = rope_specs(model) if pre_rope else None
        sens = fisher_matrices(model, pairs, samples=fisher_samples, rope=rope)
        ipairs = [(ids[a:b], ids[b:c]) for a, b, c in w.importance]
        idata = token_sensitivity(model, ipairs, samples=importance_samples) if ipairs else None
        meta = {
            "calibration": "calib" if not texts else "custom",
            "sample_tokens": sample_tokens,
            "n_samples": n_samples,
            "n_fisher": len(pairs),
            "n_importance": len(ipairs),
        }
        return calibrate(
            samples,
            loaded_model.fingerprint,
            use_pca=use_pca,
            sensitivity=sens,
            kl_scale=kl_scale_for(loaded_model) if kl_scale is None else kl_scale,
            meta=meta,
            rope=rope,
            importance_data=idata,
        )


def load_or_calibrate(loaded_model, refresh: bool = False) -> Profile:
    """The cached default profile of ``loaded_model``, calibrating (and saving) it on first use."""
    p = profile_path(loaded_model.fingerprint)
    if p.exists() and not refresh:
        try:
            prof = Profile.load(p)
            want = kl_targets(kl_scale_for(loaded_model))
            if prof.model_fingerprint == loaded_model.fingerprint and prof.meta.get("kl_targets") == want:
                return prof
            log.info("cached profile %s is stale (another level ladder): recalibrating", p)
        except Exception as e:  # a damaged cache file is rebuilt, whatever is wrong with it
            log.warning("cached profile %s is unreadable (%s): recalibrating", p, e)
    log.info("calibrating a codec profile for %s (once per model)", loaded_model.fingerprint)
    prof = calibrate_for_model(loaded_model)
    prof.save(p)
    log.info("saved profile %s to %s", prof.id, p)
    return prof
