import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cachegen.errors import ConfigError
from cachegen.kv import KVCache, KVLayer, LayerKind


def make_kv(tokens: int, layers: int = 3, heads: int = 2, dim: int = 8, start: int = 0, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    ls = []
    for i in range(layers):
        kind = LayerKind.SLIDING if i % 2 else LayerKind.FULL
        ls.append(
            KVLayer(
                torch.randn(heads, tokens, dim, generator=g),
                torch.randn(heads, tokens, dim, generator=g),
                kind,
                16 if kind == LayerKind.SLIDING else None,
            )
        )
    return KVCache(ls, start=start)


@settings(max_examples=50, deadline=None)
@given(tokens=st.integers(1, 80), chunk=st.integers(1, 40), start=st.integers(0, 1000))
def test_chunks_concat_roundtrip(tokens, chunk, start):
    kv = make_kv(tokens, start=start)
    parts = kv.chunks(chunk)
    assert [p.start for p in parts] == list(range(start, start + tokens, chunk))
    assert all(p.num_tokens <= chunk for p in parts)
    back = KVCache.concat(parts)
    assert back.start == start and back.num_tokens == tokens
    for a, b in zip(kv.layers, back.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and a.kind == b.kind and a.window == b.window


def test_slice_uses_absolute_positions():
    kv = make_kv(20, start=100)
    s = kv.slice(105, 110)
    assert (s.start, s.num_tokens, s.end) == (105, 5, 110)
    assert torch.equal(s.layers[0].k, kv.layers[0].k[:, 5:10])
    with pytest.raises(ConfigError):
        kv.slice(0, 5)


def test_concat_rejects_gaps_and_layout_mismatch():
    kv = make_kv(20)
    with pytest.raises(ConfigError, match="contiguous"):
        KVCache.concat([kv.slice(0, 5), kv.slice(6, 10)])
    with pytest.raises(ConfigError, match="layout"):
        KVCache.concat([kv.slice(0, 5), make_kv(5, heads=1, start=5)])


def test_layer_shape_checks():
    with pytest.raises(ConfigError):
        KVLayer(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ConfigError):
        KVLayer(torch.zeros(2, 3, 4), torch.zeros(2, 4, 4))
    with pytest.raises(ConfigError):
        KVLayer(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), LayerKind.SLIDING)
    with pytest.raises(ConfigError):
        KVCache(
            [KVLayer(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4)), KVLayer(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))]
        )


def test_sizes():
    kv = make_kv(10, layers=2, heads=3, dim=4)
    assert kv.num_values == 2 * 2 * 3 * 10 * 4
    assert kv.nbytes == kv.num_values * 4
    assert kv.to(torch.bfloat16).nbytes == kv.num_values * 2


def test_allocate_with_room_gives_full_layers_as_the_first_tokens_of_longer_buffers():
    like = make_kv(5)
    kv = KVCache.allocate(like, 7, start=3, room_tokens=4)
    assert kv.start == 3 and kv.num_tokens == 7 and kv.same_layout(like)
    room = kv.take_room()
    assert room is not None and len(room) == 3
    for l, r in zip(kv.layers, room):
        if l.kind == LayerKind.FULL:
            assert r is not None and r[0].shape == (2, 11, 8) and r[1].shape == (2, 11, 8)
            assert l.k.data_ptr() == r[0].data_ptr() and l.v.data_ptr() == r[1].data_ptr()
            l.k.fill_(1.5)  # the buffer is uninitialised (NaN may compare unequal to itself)
            assert bool((r[0][:, :7] == 1.5).all())
        else:  # a sliding layer keeps no room (the decoding session keeps its window)
            assert r is None and l.k.is_contiguous()


def test_room_is_handed_out_once_and_never_by_a_copy_slice_or_replaced_layer():
    like = make_kv(5)
    kv = KVCache.allocate(like, 6, room_tokens=2)
    assert KVCache.allocate(like, 6).take_room() is None  # no room asked
    for other in (kv.slice(0, 6), kv.slice(0, 3), kv.clone(), kv.to(torch.float64), kv.to(kv.dtype)):
        assert other.take_room() is None
    assert kv.take_room() is not None
    assert kv.take_room() is None  # a second taker would write the same room

    kv2 = KVCache.allocate(like, 6, room_tokens=2)
    kv2.layers[0].k = torch.zeros(2, 6, 8)  # no longer the buffer's first tokens
    assert kv2.take_room() is None
    kv3 = KVCache.allocate(like, 6, room_tokens=2)
    kv3.layers[0] = kv3.layers[0].slice(0, 4)  # a shorter view: tokens 4-5 would be overwritten
    assert kv3.take_room() is None
    with pytest.raises(ConfigError):
        KVCache.allocate(like, 6, room_tokens=-1)
