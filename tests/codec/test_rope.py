"""Keys coded before RoPE: the rotation, its gradient, the profile round trip and the real models' specs."""

import numpy as np
import pytest
import torch

from cachegen.codec import Codec, Profile, calibrate
from cachegen.codec.rope import RopeSpec, rope, unrope, unrope_grad
from cachegen.kv import KVCache, KVLayer, LayerKind


def spec(r=16, scale=1.0, base=10000.0):
    return RopeSpec((1.0 / base ** (np.arange(0, r, 2) / r)).astype(np.float32), scale)


@pytest.mark.parametrize("r,scale", [(16, 1.0), (8, 1.0), (16, 1.3)])  # full, partial rotary dim, scaled cos/sin
def test_rope_round_trip_and_norm(r, scale):
    g = torch.Generator().manual_seed(r)
    x = torch.randn(2, 40, 16, generator=g)
    s = spec(r, scale)
    y = rope(x, s, 5000)
    assert torch.allclose(unrope(y, s, 5000), x, atol=1e-5)
    assert torch.allclose(
        y.norm(dim=-1) ** 2, (x[..., :r].norm(dim=-1) * scale) ** 2 + x[..., r:].norm(dim=-1) ** 2, rtol=1e-4
    )
    if r < 16:
        assert torch.equal(y[..., r:], x[..., r:])  # channels past the rotary dim pass through
    assert not torch.allclose(rope(x, s, 7), y)  # the angle depends on the position


def test_unrope_grad_is_the_transpose_of_rope():
    """<rope(x), w> == <x, unrope_grad(w)>: the gradient w.r.t. pre-RoPE keys is R^T g."""
    s = spec(16, 1.2)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 16, generator=g)
    lhs = (rope(x, s, 123) * w).sum()
    rhs = (x * unrope_grad(w, s, 123)).sum()
    assert torch.allclose(lhs, rhs, rtol=1e-5)


def rotated_kv(seed, T, start, s, L=2):
    """Keys with a steady pre-RoPE direction (as real keys have), rotated by position."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(L):
        pre = torch.randn(2, T, 16, generator=g) * 0.2 + torch.linspace(-3, 3, 16)
        layers.append(KVLayer(rope(pre, s, start), torch.randn(2, T, 16, generator=g), LayerKind.FULL, None))
    return KVCache(layers, start=start)


def test_pre_rope_profile_codes_rotated_keys_smaller_and_exactly_as_bounded(tmp_path):
    s = spec()
    samples = [rotated_kv(i, 200, 0, s) for i in range(2)]
    plain = calibrate(samples, "fp", levels=[3])
    pre = calibrate(samples, "fp", levels=[3], rope=[s, s])
    assert pre.meta["pre_rope_keys"] and all(sp.rope is None for sp in pre.sections[1::2])
    # the profile file keeps the spec (and the id changes with it)
    p = tmp_path / "p.cgprof"
    pre.save(p)
    back = Profile.load(p)
    assert back.id == pre.id != plain.id and np.array_equal(back.sections[0].rope.inv_freq, s.inv_freq)
    kv = rotated_kv(7, 256, 3000, s)  # far from the calibration positions
    a, b = Codec(plain).encode(kv, 3), Codec(pre).encode(kv, 3)
    assert len(b) < 0.9 * len(a)
    out = Codec(back).decode(b)
    step = float(pre.levels[3].steps[0].max())
    for x, y in zip(kv.layers, out.layers):
        err = unrope(y.k, s, 3000) - unrope(x.k, s, 3000)  # bounded in the coded (pre-RoPE) domain
        assert err.abs().max() <= step * 0.5 * np.sqrt(16) * 1.001 + 1e-4


@pytest.mark.model
def test_real_models_rope_specs_recover_pre_rope_keys(smollm2):
    """unrope(cached keys) equals the model's own keys before RoPE (k_proj output)."""
    from cachegen.calibrate import context_kv, rope_specs

    m = smollm2.model
    specs = rope_specs(m)
    assert all(sp is not None and sp.rotary_dim == 64 for sp in specs)
    got = {}
    attn = m.model.layers[3].self_attn
    h = attn.k_proj.register_forward_hook(lambda mod, inp, out: got.setdefault("k", out.detach()))
    ids = torch.tensor(smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 8)["input_ids"])
    try:
        kv = context_kv(m, ids)
    finally:
        h.remove()
    pre = got["k"][0].view(ids.numel(), -1, 64).transpose(0, 1)
    assert torch.allclose(unrope(kv.layers[3].k, specs[3], 0), pre, atol=1e-4)


@pytest.mark.model
def test_gemma3_has_two_rope_specs(gemma3):
    from cachegen.calibrate import rope_specs

    specs = rope_specs(gemma3.model)
    kinds = {(sp.rotary_dim, float(sp.inv_freq[-1])) for sp in specs if sp is not None}
    assert len(specs) == 18 and all(sp is not None for sp in specs) and len(kinds) == 2  # local and global theta
