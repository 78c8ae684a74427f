"""Calibration: fit a codec profile to a live transformers model.

Why a layer of its own: the codec (:mod:`cachegen.codec`) is pure (bytes,
arrays and a profile); fitting a profile needs the model itself (its KV on
calibration text, backward passes for the Fisher sensitivities, its rotary
embedding), so it sits above both ``codec`` and ``engine``.
:func:`cachegen.codec.fit.calibrate` is the pure fit this layer feeds.

    from cachegen.calibrate import load_or_calibrate
    profile = load_or_calibrate(loaded_model)      # cached per model fingerprint
"""

from cachegen.calibrate.profiles import (
    CALIBRATION_VERSION,
    KL_SCALE,
    KL_SCALES,
    CalibrationWindows,
    calibrate_for_model,
    calibration_windows,
    kl_scale_for,
    load_or_calibrate,
    profile_path,
    pydoc_text,
    rope_specs,
)
from cachegen.calibrate.sensitivity import context_kv, fisher_matrices, fisher_sensitivity, token_sensitivity

__all__ = [
    "CALIBRATION_VERSION",
    "KL_SCALE",
    "KL_SCALES",
    "CalibrationWindows",
    "calibrate_for_model",
    "calibration_windows",
    "context_kv",
    "fisher_matrices",
    "fisher_sensitivity",
    "kl_scale_for",
    "load_or_calibrate",
    "profile_path",
    "pydoc_text",
    "rope_specs",
    "token_sensitivity",
]
