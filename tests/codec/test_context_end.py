"""Where the context ends: the second token-importance predictor, which reads each token's distance
to the end, and everything that hands the end to it (the codec, the store, the format ladder, the
bench harness). The chunk decodes the same without the end; only the bits move."""

from __future__ import annotations

import re
import uuid

import numpy as np
import pytest
import torch

from cachegen.bench.baselines import Variant, baseline
from cachegen.codec import Codec, Profile, calibrate, importance
from cachegen.codec.container import MAX_POSITION
from cachegen.codec.profile import PROFILE_MAGIC
from cachegen.codec.protocol import EncodesInContext, takes_context_end
from cachegen.codec.transform import forward_section
from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import KVCache, KVLayer, LayerKind
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream.formats import FormatLadder, Rung
from codec.samples import planted_sensitivity

T_IMP = 400
RECENT = 16.0  # the planted recency: a token d tokens from the end is 1 + 40 exp(-d / 16) times as sensitive


def _kv(seed: int, tokens: int, start: int = 0, layers: int = 2) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        k = torch.randn(2, tokens, 8, generator=g) * (1 + i) + 0.5
        v = torch.randn(2, tokens, 8, generator=g) * 0.3
        out.append(KVLayer(k, v, LayerKind.FULL, None))
    return KVCache(out, start=start)


def _recency(tokens: int) -> np.ndarray:
    d = np.arange(tokens)[::-1].astype(np.float64)
    return 1.0 + 40.0 * np.exp(-d / RECENT)


@pytest.fixture(scope="module")
def profile() -> Profile:
    data = []
    for seed in (300, 301):
        kv = _kv(seed, T_IMP)
        data.append((kv, planted_sensitivity(kv) * _recency(T_IMP)))
    return calibrate([_kv(100 + i, 160) for i in range(2)], "fp-end", importance_data=data)


def _exact(msg: str) -> str:
    return "^" + re.escape(msg) + "$"


def _corrupt(msg: str) -> str:
    return "^" + re.escape("corrupt chunk: " + msg) + "$"


def _inputs(prof: Profile, kv: KVCache, li: int = 0) -> list[np.ndarray]:
    return [
        forward_section(prof.sections[2 * li + j], x, kv.start)
        for j, x in enumerate((kv.layers[li].k, kv.layers[li].v))
    ]


def test_every_section_has_both_predictors(profile):
    for sp in profile.sections:
        assert sp.imp is not None and sp.imp_end is not None
        assert sp.imp_end.weights.shape == (2, sp.imp.weights.shape[1] + importance.N_DIST)


def test_distance_features_count_the_tokens_after_each_one():
    f = importance.distance_features(np.array([7, 8, 9]), 10)
    d = np.array([2.0, 1.0, 0.0])
    assert f.shape == (3, importance.N_DIST)
    assert np.allclose(f, np.exp(-d[:, None] / np.array(importance.DIST_SCALES)[None, :]), rtol=0, atol=1e-15)


def test_the_known_end_predictor_learns_recency_and_the_other_does_not(profile):
    test = _kv(302, 300, start=100)
    yk, yv = _inputs(profile, test)
    pos = test.start + np.arange(test.num_tokens)
    u_end = importance.layer_multipliers([profile.sections[0].imp_end], yk, yv, 2, pos, context_end=test.end)[0]
    u_any = importance.layer_multipliers([profile.sections[0].imp], yk, yv, 2, pos)[0]
    # the last 16 tokens get much finer steps than the tokens a hundred or more before the end
    assert u_end[-16:].mean() < u_end[:200].mean() - 2.0
    assert abs(u_any[-16:].mean() - u_any[:200].mean()) < 1.0
    # the same end far away: no token is recent any more, and the steps coarsen
    u_far = importance.layer_multipliers([profile.sections[0].imp_end], yk, yv, 2, pos, context_end=10**6)[0]
    assert u_far[-16:].mean() > u_end[-16:].mean() + 2.0
    # the fast path is the feature path
    f = importance.features(yk, yv, 2, pos, test.end)
    assert f.shape == (2, 300, 8 + 8 + importance.N_EXTRA + importance.N_DIST)
    assert np.array_equal(u_end, importance.to_u(profile.sections[0].imp_end.log_sensitivity(f)))


def test_the_known_end_offset_keeps_the_calibration_noise(profile):
    """Solved over every calibration token (the recent ones included): the sensitivity-weighted
    noise of the calibration contexts stays what the level's steps were set for."""
    kv = _kv(300, T_IMP)
    sens = planted_sensitivity(kv) * _recency(T_IMP)
    s = profile.n_sink
    ys = [forward_section(profile.sections[j], x[:, s:], s) for j, x in enumerate((kv.layers[0].k, kv.layers[0].v))]
    u = importance.layer_multipliers([profile.sections[0].imp_end], ys[0], ys[1], 2, np.arange(s, T_IMP), T_IMP)[0]
    r = sens[0, 0, :, s:].sum(axis=0)
    assert 0.5 < (r * 2.0**u).sum() / r.sum() <= 1.5


def test_the_end_puts_the_bits_near_it_and_decodes_without_it(profile):
    codec = Codec(profile)
    kv = _kv(303, 96, start=200)
    near = codec.encode(kv, 4, context_end=kv.end)
    far = codec.encode(kv, 4, context_end=kv.end + 5000)
    assert near != far and codec.encode(kv, 4, context_end=kv.end) == near  # deterministic

    def err(data: bytes, lo: int, hi: int) -> float:
        out = codec.decode(data)  # the decoder is not told the end
        return sum(float(((a.k - b.k)[:, lo:hi] ** 2).sum()) for a, b in zip(kv.layers, out.layers))

    assert err(near, 80, 96) < 0.5 * err(far, 80, 96)  # the last 16 tokens: finer
    assert err(near, 0, 40) > err(far, 0, 40)  # the tokens far from the end pay for it


@pytest.mark.parametrize(
    "bad", [95 + 200, -1, 1.5, "300", True, MAX_POSITION + 1], ids=["before-end", "neg", "float", "str", "bool", "big"]
)
def test_a_context_end_that_cannot_be_is_refused(profile, bad):
    kv = _kv(304, 96, start=200)
    with pytest.raises(
        ConfigError,
        match=_exact(f"context_end {bad!r} must be an int from the chunk's end (296) to {MAX_POSITION}"),
    ):
        Codec(profile).encode(kv, 4, context_end=bad)
    Codec(profile).encode(kv, 4, context_end=296)  # the chunk's own end is the nearest there is
    Codec(profile).encode(kv, 4, context_end=MAX_POSITION)


def test_a_profile_without_the_second_predictor_codes_as_before(profile):
    """A profile calibrated before this predictor existed (or an unknown end) gives the chunk it gave."""
    old = Profile.from_bytes(profile.to_bytes())
    for sp in old.sections:
        sp.imp_end = None
    old._bytes = old._id = None
    codec, kv = Codec(old), _kv(305, 64, start=100)
    assert codec.encode(kv, 3, context_end=kv.end) == codec.encode(kv, 3)
    body = len(codec.encode(kv, 3)) - len(Codec(profile).encode(kv, 3))
    assert body == 0 and codec.decode(codec.encode(kv, 3)).num_tokens == 64


def test_the_profile_file_keeps_both_predictors(profile):
    back = Profile.from_bytes(profile.to_bytes())
    assert back.id == profile.id
    for a, b in zip(back.sections, profile.sections):
        assert a.imp_end is not None and b.imp_end is not None
        assert np.array_equal(a.imp_end.weights, b.imp_end.weights) and a.imp_end.offset == b.imp_end.offset
        assert a.imp_end.offset == float(np.float32(a.imp_end.offset))  # the fit stores what the file holds
    kv = _kv(306, 64, start=100)
    assert Codec(back).encode(kv, 3, context_end=kv.end) == Codec(profile).encode(kv, 3, context_end=kv.end)


def _rewrite(profile: Profile, edit) -> bytes:
    """The profile's bytes with ``edit(arrays)`` applied to a copy of its sections' predictors."""
    p = Profile.from_bytes(profile.to_bytes())
    edit(p)
    p._bytes = p._id = None
    return p.to_bytes()


def test_a_broken_second_predictor_is_refused_by_name(profile):
    def wide(p):
        m = p.sections[3].imp_end
        m.weights = np.concatenate([m.weights, m.weights[:, :1]], axis=1)

    def nan(p):
        p.sections[3].imp_end.offset = float("nan")

    def alone(p):
        p.sections[3].imp = None

    for edit in (wide, nan):
        with pytest.raises(CorruptChunk, match=_corrupt("profile section 3 has an invalid importance model")):
            Profile.from_bytes(_rewrite(profile, edit))
    with pytest.raises(CorruptChunk, match=_corrupt("profile section 3 has an importance model for a known end only")):
        Profile.from_bytes(_rewrite(profile, alone))
    assert _rewrite(profile, lambda p: None).startswith(PROFILE_MAGIC)


class _Spy:
    """A codec that records the ``context_end`` it was given (and says it takes one)."""

    levels = (1,)
    encodes_in_context = True

    def __init__(self):
        self.ends: list[int | None] = []

    def encode(self, kv: KVCache, level: int, *, key: str | None = None, context_end: int | None = None) -> bytes:
        self.ends.append(context_end)
        return b"x" * 8

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        raise NotImplementedError


class _Plain:
    levels = (1,)

    def encode(self, kv: KVCache, level: int, *, key: str | None = None) -> bytes:
        return b"y" * 8

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        raise NotImplementedError


def test_the_protocol_names_who_takes_the_end(profile):
    assert takes_context_end(Codec(profile)) and takes_context_end(_Spy())
    assert isinstance(Codec(profile), EncodesInContext)
    assert not takes_context_end(_Plain()) and not takes_context_end(baseline("uniform8"))
    lying = _Plain()
    lying.encodes_in_context = "yes"  # type: ignore[attr-defined]  # only True counts
    assert not takes_context_end(lying)


def test_the_store_tells_the_codec_where_the_context_ends():
    # mock stores live as long as the process: fresh names, so a second run in one process (the
    # mutation tool's stats, then its clean run) finds them empty
    run = uuid.uuid4().hex
    spy = _Spy()
    cs = ContextStore(open_backend(f"mock://end-{run}"), Namespace("m", 4, "p"), encoder=spy, chunk_tokens=32)
    toks = list(range(100))
    cs.put_context(toks, _kv(1, 100))
    assert spy.ends == [100] * 4  # the default: the tokens given end the context
    spy.ends.clear()
    toks2 = list(range(500, 660))
    cs.put_context(toks2[:64], _kv(2, 64), context_end=160)  # a part of a longer context
    assert spy.ends == [160, 160]
    with pytest.raises(ConfigError, match=_exact("context_end 50 must be an int, at least the 64 tokens given")):
        cs.put_context(toks2[:64], _kv(2, 64), context_end=50)
    plain = ContextStore(open_backend(f"mock://plain-{run}"), Namespace("m", 4, "p"), encoder=_Plain(), chunk_tokens=32)
    plain.put_context(toks, _kv(1, 100))  # a codec without the argument is not given it


def test_the_ladder_passes_the_end_to_the_rungs_that_take_it():
    spy = _Spy()
    ladder = FormatLadder([Rung("spy", spy, 1), Rung("plain", _Plain(), 1)])
    assert takes_context_end(ladder)
    kv = _kv(3, 32)
    assert ladder.encode(kv, 0, context_end=90)[1:] == b"x" * 8 and spy.ends == [90]
    assert ladder.encode(kv, 1, context_end=90) == bytes([1]) + b"y" * 8
    ladder.encode(kv, 0)
    assert spy.ends == [90, None]


def test_the_harness_encodes_a_context_as_a_store_does():
    spy = _Spy()
    assert len(Variant(spy, 1).encode_context(_kv(4, 100, start=28), 32)) == 4
    assert spy.ends == [128] * 4
    assert len(Variant(_Plain(), 1).encode_context(_kv(4, 100), 32)) == 4
