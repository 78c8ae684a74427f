import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachegen.codec import FORMAT_VERSION, LEVELS, LOSSLESS, Codec, Profile, calibrate, importance
from cachegen.codec.transform import forward_section
from cachegen.errors import CorruptChunk, FormatVersionError, ProfileMismatch
from cachegen.kv import KVCache, KVLayer, LayerKind
from codec.samples import planted_sensitivity


def rand_kv(seed=0, L=3, H=2, T=48, D=16, Dv=None, start=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(L):
        k = torch.randn(H, T, D, generator=g) * (1 + i) + 0.5
        v = torch.randn(H, T, Dv or D, generator=g) * 0.3
        kind = LayerKind.SLIDING if i % 2 else LayerKind.FULL
        layers.append(KVLayer(k.to(dtype), v.to(dtype), kind, 16 if i % 2 else None))
    return KVCache(layers, start=start)


@pytest.fixture(scope="module")
def profile():
    """A profile with token importance (every codec test then covers the multiplier streams)."""
    imp_kv = rand_kv(300, T=400)
    return calibrate(
        [rand_kv(100 + i, T=160) for i in range(2)], "fp-test", importance_data=[(imp_kv, planted_sensitivity(imp_kv))]
    )


def bound(prof, level, sec, d):
    # orthonormal per-head basis: per-value error <= ||y err||_2 <= sqrt(d) * max step / 2,
    # a token's step being at most 2^(U_MAX/2) times the component's
    mult = 2.0 ** (importance.U_MAX / 2) if prof.sections[sec].imp is not None else 1.0
    return float(prof.levels[level].steps[sec].max()) * mult * 0.5 * np.sqrt(d) * 1.001 + 1e-5


@pytest.mark.parametrize("level", LEVELS)
def test_error_bound_per_level(profile, level):
    kv = rand_kv(1, start=2)
    codec = Codec(profile)
    out = codec.decode(codec.encode(kv, level))
    assert out.start == 2 and out.dtype == kv.dtype
    for li, (a, b) in enumerate(zip(kv.layers, out.layers)):
        assert (a.kind, a.window) == (b.kind, b.window)
        assert torch.equal(a.k[:, :2], b.k[:, :2])  # sink tokens (positions 2, 3) exact
        assert (a.k - b.k).abs().max() <= bound(profile, level, 2 * li, 16)
        assert (a.v - b.v).abs().max() <= bound(profile, level, 2 * li + 1, 16)


@pytest.mark.parametrize("level", (1, 4, 7))
def test_token_multipliers_exact_bound(profile, level):
    """In the basis domain every value is within half its token's step: ``step_c * 2^(u_t/2) / 2``,
    with ``u_t`` the multiplier the encoder predicted (and the chunk carries)."""
    kv = rand_kv(21, T=96, start=40)
    out = Codec(profile).decode(Codec(profile).encode(kv, level))
    spread = set()
    for li, (a, b) in enumerate(zip(kv.layers, out.layers)):
        sps = profile.sections[2 * li : 2 * li + 2]
        ya = [forward_section(sp, x, kv.start) for sp, x in zip(sps, (a.k, a.v))]
        yb = [forward_section(sp, x, kv.start) for sp, x in zip(sps, (b.k, b.v))]
        us = importance.layer_multipliers(
            [sp.imp for sp in sps], ya[0], ya[1], a.k.shape[0], kv.start + np.arange(kv.num_tokens)
        )
        for j in range(2):
            spread |= set(us[j].tolist())
            step = profile.levels[level].steps[2 * li + j][None, :] * importance.row_scale(us[j])[:, None]
            assert (np.abs(ya[j] - yb[j]) <= step * 0.5 * 1.0001 + 1e-5).all()
    assert len(spread) >= 3  # the planted sensitivities give the tokens different steps


def test_importance_fit_learns_planted_sensitivity():
    kv = rand_kv(301, T=400)
    sens = planted_sensitivity(kv)
    prof = calibrate([rand_kv(100, T=160)], "fp", importance_data=[(kv, sens)])
    test = rand_kv(302, T=300)
    ys = [forward_section(prof.sections[i], x, 0) for i, x in enumerate((test.layers[0].k, test.layers[0].v))]
    u = importance.layer_multipliers([prof.sections[0].imp], ys[0], ys[1], 2, np.arange(300))[0]
    truth = planted_sensitivity(test)[0, 0].mean(axis=0)
    assert np.corrcoef(u, -np.log(truth))[0, 1] > 0.8  # sensitive tokens get fine steps
    # the offset keeps the sensitivity-weighted noise of the calibration tokens unchanged
    sink = prof.n_sink  # sink tokens are stored exactly, so calibration leaves them out
    ys = [forward_section(prof.sections[i], x[:, sink:], sink) for i, x in enumerate((kv.layers[0].k, kv.layers[0].v))]
    f = importance.features(ys[0], ys[1], 2, np.arange(sink, 400))
    r = sens[0, 0, :, sink:].sum(axis=0)
    u = importance.to_u(prof.sections[0].imp.log_sensitivity(f))
    assert np.array_equal(
        u, importance.layer_multipliers([prof.sections[0].imp], ys[0], ys[1], 2, np.arange(sink, 400))[0]
    )
    ratio = (r * 2.0**u).sum() / r.sum()
    assert 0.6 < ratio <= 1.0


def test_levels_order_rate_and_error(profile):
    kv = rand_kv(2, T=128, start=64)
    codec = Codec(profile)
    sizes, errs = [], []
    for lv in LEVELS:
        out = codec.decode(codec.encode(kv, lv))
        sizes.append(len(codec.encode(kv, lv)))
        errs.append(sum(((a.k - b.k) ** 2).sum().item() for a, b in zip(kv.layers, out.layers)))
    assert sizes == sorted(sizes, reverse=True)
    assert errs == sorted(errs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_lossless_bit_exact(dtype):
    kv = rand_kv(3, dtype=dtype, start=7)
    fi = torch.finfo(dtype)
    kv.layers[0].k[0, 0, :4] = torch.tensor(
        [-0.0, fi.smallest_normal / 4, fi.max, -fi.max]
    )  # sign of zero, subnormal, extremes
    out = Codec().decode(Codec().encode(kv, LOSSLESS))
    for a, b in zip(kv.layers, out.layers):
        assert a.k.dtype == b.k.dtype
        assert torch.equal(
            a.k.view(torch.int16 if dtype != torch.float32 else torch.int32),
            b.k.view(torch.int16 if dtype != torch.float32 else torch.int32),
        )
        assert torch.equal(a.v, b.v)


def test_deterministic(profile):
    kv = rand_kv(4)
    assert Codec(profile).encode(kv, 3) == Codec(profile, threads=1).encode(kv.clone(), 3)
    assert Codec().encode(kv, 5) == Codec().encode(kv, 5)


def test_gqa_like_shapes_and_fp16_lossy():
    kv = rand_kv(5, L=2, H=3, D=8, Dv=24, T=30, dtype=torch.float16)
    prof = calibrate([rand_kv(6, L=2, H=3, D=8, Dv=24, T=90)], "x")
    out = Codec(prof).decode(Codec(prof).encode(kv, 2))
    assert out.layers[1].v.shape == (3, 30, 24) and out.dtype == torch.float16


def test_inline_tables_and_peek(profile):
    kv = rand_kv(7)
    data = Codec(None, model_fingerprint="m1").encode(kv, 4)
    h = Codec().peek(data)
    assert (
        h.inline_profile and h.profile_id == "" and h.level == 4 and h.num_tokens == 48 and h.version == FORMAT_VERSION
    )
    out = Codec().decode(data)  # no profile needed for a self-contained chunk
    assert (out.layers[0].k - kv.layers[0].k).abs().max() < 1.0
    d2 = Codec(profile).encode(kv, 4)
    h2 = Codec().peek(d2)
    assert h2.profile_id == profile.id and h2.model_fingerprint == "fp-test" and h2.layers[1].kind == LayerKind.SLIDING


def test_profile_mismatch(profile):
    data = Codec(profile).encode(rand_kv(8), 3)
    with pytest.raises(ProfileMismatch, match=profile.id):
        Codec().decode(data)
    other = calibrate([rand_kv(9, T=100)], "fp-test")
    with pytest.raises(ProfileMismatch):
        Codec(other).decode(data)
    with pytest.raises(ProfileMismatch):
        Codec(model_fingerprint="another-model").decode(data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_is_decodes_layout_read_from_the_header(profile, dtype):
    """``layout`` (a ReadsLayout): the start, layer kinds, windows and widths, dtype and meta that
    ``decode`` gives, with no token; refused as ``decode`` refuses a chunk (another model's, a
    layout the profile does not have, a broken header)."""
    from cachegen.codec.protocol import ReadsLayout

    codec = Codec(profile)
    assert isinstance(codec, ReadsLayout)
    for level in (LOSSLESS, 4):
        data = codec.encode(rand_kv(3, start=96, dtype=dtype), level)
        got, want = codec.layout(data), codec.decode(data)
        assert got.num_tokens == 0 and got.start == 96 and got.same_layout(want)
        assert got.dtype == want.dtype == dtype and got.meta == want.meta == {"model_fingerprint": "fp-test"}
    with pytest.raises(ProfileMismatch, match="chunk is for model fp-test, this codec for another-model"):
        Codec(model_fingerprint="another-model").layout(data)
    wider = Codec(profile).encode(rand_kv(4, D=8), LOSSLESS)  # lossless: encodes any layout
    with pytest.raises(CorruptChunk, match="layout"):
        codec.layout(wider)
    with pytest.raises(CorruptChunk):
        codec.layout(data[:40])


def test_decoder_families_are_lossless_and_lossy(profile):
    """Every lossy level runs one decoder, lossless another (a NamesDecoders): the loader learns
    one decode speed per family, and results name them."""
    from cachegen.codec.protocol import NamesDecoders

    codec = Codec(profile)
    assert isinstance(codec, NamesDecoders)
    assert [codec.decoder_family(level) for level in codec.levels] == ["lossless"] + ["lossy"] * (len(codec.levels) - 1)


def test_profile_serialization(profile, tmp_path):
    p = tmp_path / "p.cgprof"
    profile.save(p)
    q = Profile.load(p)
    assert q.id == profile.id and q.model_fingerprint == "fp-test"
    kv = rand_kv(10)
    assert Codec(q).encode(kv, 3) == Codec(profile).encode(kv, 3)
    b = bytearray(profile.to_bytes())
    b[4] = 9
    with pytest.raises(FormatVersionError):
        Profile.from_bytes(bytes(b))
    for cut in (3, 20, len(b) // 2):
        with pytest.raises(CorruptChunk):
            Profile.from_bytes(profile.to_bytes()[:cut])


def test_format_version_mismatch(profile):
    data = bytearray(Codec(profile).encode(rand_kv(11), 3))
    data[4:6] = struct.pack("<H", FORMAT_VERSION + 1)
    with pytest.raises(FormatVersionError, match="version"):
        Codec(profile).decode(bytes(data))


def test_decode_layers_streaming(profile):
    kv = rand_kv(12)
    data = Codec(profile).encode(kv, 3)
    got = list(Codec(profile).decode_layers(data))
    assert [i for i, _ in got] == [0, 1, 2]


def test_empty_and_sink_only_chunks(profile):
    for kv in (rand_kv(13, T=3), rand_kv(13, T=0, start=10)):
        for c in (Codec(profile), Codec()):
            for lv in (0, 3):
                out = c.decode(c.encode(kv, lv))
                assert out.num_tokens == kv.num_tokens


@pytest.fixture(scope="module")
def chunks(profile):
    kv = rand_kv(14, T=24)
    return [Codec(profile).encode(kv, 3), Codec().encode(kv, 5), Codec().encode(kv.to(torch.bfloat16), 0)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2), st.integers(0, 10**9), st.integers(1, 255), st.sampled_from(["flip", "truncate", "byte"]))
def test_corrupt_inputs_raise_corruptchunk(profile, chunks, which, pos, val, mode):
    data = bytearray(chunks[which])
    p = pos % len(data)
    if mode == "flip":
        data[p] ^= 1 << (val % 8)
    elif mode == "truncate":
        data = data[:p]
    else:
        data[p] = (data[p] + val) % 256
    with pytest.raises(CorruptChunk):
        Codec(profile).decode(bytes(data))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300))
def test_random_bytes_raise_corruptchunk(profile, junk):
    for data in (junk, b"CGKC" + junk):
        with pytest.raises(CorruptChunk):
            Codec(profile).decode(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2), st.integers(0, 10**9), st.binary(min_size=1, max_size=8))
def test_hostile_payload_with_valid_checksums(profile, chunks, which, pos, junk):
    """Mutate a section and fix its CRCs: decoding must still fail cleanly or succeed, never crash."""
    import dataclasses

    from cachegen.codec.container import pack_header, parse_header

    data = chunks[which]
    h = parse_header(data)
    s = pos % len(h.section_lengths)
    off = h.section_offsets()[s]
    sec = bytearray(data[off : off + h.section_lengths[s]])
    if not sec:
        return
    p = pos % len(sec)
    sec[p : p + len(junk)] = junk
    secs = [bytes(data[o : o + n]) for o, n in zip(h.section_offsets(), h.section_lengths)]
    secs[s] = bytes(sec)
    h2 = dataclasses.replace(h, section_lengths=tuple(map(len, secs)), section_crcs=tuple(zlib.crc32(x) for x in secs))
    blob = pack_header(h2) + b"".join(secs)
    try:
        out = Codec(profile).decode(blob)
    except CorruptChunk:
        return
    # With its CRC recomputed nothing checks a section's bytes any more, so a change inside its rANS
    # words or escapes can legitimately decode to other values. Sections are independent, though:
    # every other section decodes exactly as in the original chunk, the changed one keeps the
    # header's shape, finite, and an unchanged section (junk equal to the bytes it replaced) is exact.
    ref = Codec(profile).decode(data)
    assert out.num_tokens == h.num_tokens and out.start == h.start and out.dtype == h.dtype
    first = 1 if h.inline_profile else 0
    profile_changed = h.inline_profile and s == 0 and secs[0] != data[off : off + h.section_lengths[0]]
    for li, (lo, lr, shape) in enumerate(zip(out.layers, ref.layers, h.layers)):
        for j, (xo, xr, dim) in enumerate(((lo.k, lr.k, shape.k_dim), (lo.v, lr.v, shape.v_dim))):
            assert tuple(xo.shape) == (shape.heads, h.num_tokens, dim)
            assert bool(torch.isfinite(xo).all())
            unchanged = first + 2 * li + j != s or bytes(sec) == data[off : off + h.section_lengths[s]]
            if unchanged and not profile_changed:
                assert torch.equal(xo, xr), (li, j, s)


def _fisher_like(kv, seed=0):
    """Random PSD per-head matrices with a wide spread of sensitivities, one per section."""
    g = np.random.default_rng(seed)
    out = []
    for l in kv.layers:
        for x in (l.k, l.v):
            h, d = x.shape[0], x.shape[2]
            a = g.standard_normal((h, d, d)) * np.logspace(-2, 1, d)[None, None, :]
            out.append(a @ np.swapaxes(a, 1, 2) / d)
    return out


def _basis_coords(sp, x: torch.Tensor) -> np.ndarray:
    """x (H, T, D) -> (T, H*D): ``(x - mean) @ basis`` per head, computed here in float64."""
    assert sp.rope is None  # random KV: no rotary embedding to undo
    h, t, d = x.shape
    xc = x.double().numpy() - sp.mean.astype(np.float64).reshape(h, 1, d)
    y = xc if sp.basis is None else np.einsum("htd,hdc->htc", xc, sp.basis.astype(np.float64))
    return y.transpose(1, 0, 2).reshape(t, h * d)


def _raw_directions(sp) -> np.ndarray:
    """(H, D, D): row ``c`` of head ``h`` is basis component ``c``'s direction in the raw domain
    (``x = y @ R + mean``): the stored inverse, or the transpose of an orthonormal basis."""
    r = sp.inv if sp.inv is not None else np.swapaxes(sp.basis, 1, 2)
    r = r.astype(np.float64)
    eye = np.broadcast_to(np.eye(sp.dim), r.shape)
    assert np.allclose(sp.basis.astype(np.float64) @ r, eye, atol=1e-3)  # it inverts the basis
    return r


def test_per_component_sensitivity_and_weighted_basis(tmp_path):
    """A level's sensitivity-weighted noise is what its steps predict, in the raw domain.

    Oracle, from the profile's numbers and the Fisher matrices only: a uniform quantizer of step
    ``s_c`` adds noise of variance ``min(s_c^2 / 12, var_c)`` to component ``c``, which costs
    ``f_c = r_c^T F r_c`` per unit variance (``r_c`` the component's raw-domain direction), so the
    level predicts ``0.5 * sum_c f_c min(s_c^2 / 12, var_c)`` per token. The decoded cache's
    measured ``0.5 * mean_t e_t^T F e_t`` (``e`` = decoded - original, raw domain) must match it,
    and every value must be within half its step in the basis. A transposed basis or inverse in
    decode, a wrong mean or a step applied to the wrong component breaks both."""
    samples = [rand_kv(200 + i, T=160) for i in range(2)]
    fis = _fisher_like(samples[0])
    kv = rand_kv(21, T=200)
    sink = 4
    for weighted in (False, True):
        prof = calibrate(samples, "fp-w", sensitivity=fis, weighted_basis=weighted)
        assert any(s.inv is not None for s in prof.sections) == weighted
        p = tmp_path / f"w{weighted}.cgprof"
        prof.save(p)
        q = Profile.load(p)
        assert q.id == prof.id
        codec = Codec(q)
        sizes = []
        for lv in LEVELS:
            data = codec.encode(kv, lv)
            sizes.append(len(data))
            out = codec.decode(data)
            predicted = measured = 0.0
            for li, (a, b) in enumerate(zip(kv.layers, out.layers)):
                for j, (xa, xb) in enumerate(((a.k, b.k), (a.v, b.v))):
                    i = 2 * li + j
                    sp, step, F = q.sections[i], q.levels[lv].steps[i].astype(np.float64), fis[i]
                    assert torch.equal(xb[:, :sink], xa[:, :sink])  # the attention sink is stored exactly
                    ya, yb = _basis_coords(sp, xa[:, sink:]), _basis_coords(sp, xb[:, sink:])
                    tol = 1e-4 * np.abs(ya).max()  # float32 round-off of the decoded values
                    assert (np.abs(ya - yb) <= step[None, :] * 0.5 * 1.001 + tol).all(), (weighted, lv, i)
                    r = _raw_directions(sp)
                    f = np.einsum("hcd,hde,hce->hc", r, F, r).reshape(-1)
                    var = sp.std.astype(np.float64) ** 2
                    predicted += 0.5 * float((f * np.minimum(step**2 / 12, var)).sum())
                    e = (xb[:, sink:] - xa[:, sink:]).double().numpy()  # (H, T, D)
                    measured += 0.5 * float(np.einsum("htd,hde,hte->t", e, F, e).mean())
            assert 0.9 * predicted < measured < 1.15 * predicted, (weighted, lv, measured / predicted)
        assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    # one float per section still works (the old interface)
    prof = calibrate(samples, "fp-f", sensitivity=[1.0 + i for i in range(len(fis))])
    assert Codec(prof).decode(Codec(prof).encode(kv, 3)).num_tokens == kv.num_tokens
