"""Where calibration reads its text, held-out windows after it, and the per-model KL-target factor."""

from __future__ import annotations

import itertools
import types

import pytest

from cachegen.bench.level_placement import held_out_windows, suggest_scales
from cachegen.calibrate import KL_SCALE, KL_SCALES, calibration_windows, kl_scale_for
from cachegen.calibrate import profiles as P
from cachegen.codec import KL_TARGETS, LEVELS


def _spans(w) -> list[tuple[int, int]]:
    return list(w.samples) + [(a, c) for a, _, c in w.fisher + w.importance]


def test_a_long_text_gives_every_phase_its_own_tokens_in_order():
    w = calibration_windows(55_000)
    assert w.samples == [(0, 1024), (1024, 2048)]
    assert w.fisher == [(2048 + 576 * j, 2048 + 576 * j + 512, 2048 + 576 * (j + 1)) for j in range(4)]
    assert w.importance == [(4352, 6400, 6656), (6656, 8704, 8960)]
    spans = _spans(w)
    assert all(b <= c for (_, b), (c, _) in itertools.pairwise(spans))  # disjoint, in reading order
    assert w.end == 8960


def test_a_short_text_starts_a_phase_again_from_the_beginning():
    w = calibration_windows(5000)  # room for the samples and the Fisher text, not for importance after them
    assert w.fisher[0][0] == 2048 and w.importance == [(0, 2048, 2304), (2304, 4352, 4608)]
    assert w.end == 4608
    with pytest.raises(ValueError, match="too short: 1000 tokens"):
        calibration_windows(1000)


def test_held_out_windows_start_after_every_calibration_window():
    starts = held_out_windows(20_000, 3, 2048, 256)
    assert starts == [8960, 8960 + 2304, 8960 + 2 * 2304]
    with pytest.raises(ValueError, match="too short for 5 held-out windows"):
        held_out_windows(20_000, 5, 2048, 256)


def test_the_suggested_factor_lands_a_model_where_the_reference_lands_whatever_factor_it_was_measured_at():
    # the reference lands at 0.6x nominal; the other, measured at a factor 0.2, at 3.0 x 0.2 = 0.6x too
    out = suggest_scales([{"rho": 0.6, "kl_scale": 1.0}, {"rho": 3.0, "kl_scale": 0.2}, {"rho": 0.3, "kl_scale": 1.0}])
    assert [round(r["suggested_kl_scale"], 6) for r in out] == [1.0, 0.2, 2.0]


def test_the_kl_factor_is_the_models_own_and_a_cached_profile_of_another_factor_is_stale(tmp_path, monkeypatch):
    smol, gemma, other = (
        types.SimpleNamespace(name=n, fingerprint="f" + n) for n in ("smollm2-135m", "gemma3-270m", "x")
    )
    assert kl_scale_for(smol) == KL_SCALE and kl_scale_for(other) == KL_SCALE
    assert kl_scale_for(gemma) == KL_SCALES["gemma3-270m"] != KL_SCALE

    built = []

    saved = {}

    class _Profile(types.SimpleNamespace):
        def save(self, path):
            saved[path.name] = self

    def fake_calibrate(loaded):
        built.append(loaded.name)
        targets = {str(lv): KL_TARGETS[lv] * kl_scale_for(loaded) for lv in LEVELS}
        return _Profile(model_fingerprint=loaded.fingerprint, meta={"kl_targets": targets}, id="p")

    monkeypatch.setattr(P, "calibrate_for_model", fake_calibrate)
    monkeypatch.setattr(P, "profile_path", lambda fp: tmp_path / fp)
    monkeypatch.setattr(P.Profile, "load", staticmethod(lambda p: saved[p.name]))
    for p in (gemma, gemma):
        P.load_or_calibrate(p)
        (tmp_path / p.fingerprint).touch()
    assert built == ["gemma3-270m"]  # the second call found its own profile
    monkeypatch.setitem(KL_SCALES, "gemma3-270m", 0.5)
    P.load_or_calibrate(gemma)
    assert built == ["gemma3-270m", "gemma3-270m"]  # built for another factor: rebuilt
