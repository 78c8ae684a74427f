"""GrowingLayer (``cachegen.engine.hf_cache``): appends in place, and every tensor it hands out holds
what transformers' concatenating DynamicLayer would hold, whatever was done to the layer before."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiny_models import tiny_llama
from transformers.cache_utils import DynamicLayer

from cachegen.engine.hf_cache import GrowingLayer, from_transformers, recording_cache, to_transformers

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 7)),
        st.tuples(st.just("crop"), st.integers(1, 3)),
        st.tuples(st.just("select"), st.just(0)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


def _states(g: torch.Generator, batch: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 2, m, 4, generator=g), torch.randn(batch, 2, m, 3, generator=g)


@settings(max_examples=80, deadline=None)
@given(OPS, st.integers(1, 6), st.integers(0, 2**31))
def test_any_sequence_of_steps_holds_what_concatenation_holds(ops, spare, seed):
    """Appends, crops, batch selections and resets in any order: after each, the layer's keys and
    values equal the concatenating layer's, and every tensor handed out earlier still holds what
    it held when it was handed out (a crop's next append copies, it never overwrites)."""
    g = torch.Generator().manual_seed(seed)
    ours, ref = GrowingLayer(spare_tokens=spare), DynamicLayer()
    handed: list[tuple[torch.Tensor, torch.Tensor]] = []
    batch = 2
    for op, n in ops:
        if op == "append":
            k, v = _states(g, batch, n)
            got, want = ours.update(k, v), ref.update(k.clone(), v.clone())
            handed.append((got[0], got[0].clone()))
            handed.append((got[1], got[1].clone()))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        elif op == "crop" and ref.get_seq_length() > n:
            ours.crop(-n)
            ref.crop(-n)
        elif op == "select" and ref.get_seq_length() > 0 and batch > 1:
            idx = torch.tensor([1])
            ours.batch_select_indices(idx)
            ref.batch_select_indices(idx)
            batch = 1
        elif op == "reset":
            ours.reset()
            ref.reset()
            batch = 2
        assert ours.get_seq_length() == ref.get_seq_length()
        if ref.get_seq_length():
            assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
        for t, was in handed:
            assert torch.equal(t, was)


def test_steps_write_in_place_until_the_room_is_used_up():
    g = torch.Generator().manual_seed(1)
    layer = GrowingLayer(spare_tokens=4)
    layer.update(*_states(g, 1, 10))
    buf = layer.keys.data_ptr()
    for _ in range(4):  # 10 + 4 tokens fit in the first buffer
        layer.update(*_states(g, 1, 1))
        assert layer.keys.data_ptr() == buf and layer.values.shape[-2] == layer.keys.shape[-2]
    layer.update(*_states(g, 1, 1))  # the 15th moves to a new buffer with room again
    assert layer.keys.data_ptr() != buf and layer.get_seq_length() == 15
    buf = layer.keys.data_ptr()
    layer.update(*_states(g, 1, 2))
    assert layer.keys.data_ptr() == buf


def test_new_states_of_another_dtype_or_width_get_a_new_buffer():
    g = torch.Generator().manual_seed(2)
    layer = GrowingLayer(spare_tokens=8)
    k, v = _states(g, 1, 3)
    layer.update(k, v)
    buf = layer.keys.data_ptr()
    k2, v2 = _states(g, 1, 1)
    layer.update(k2.double(), v2.double())  # as torch.cat, the result takes the wider dtype's values
    assert layer.keys.data_ptr() != buf and layer.keys.dtype == torch.float64
    assert torch.equal(layer.keys, torch.cat([k, k2], dim=-2).double())


def test_narrower_new_states_keep_the_wider_dtype_as_concatenation_does():
    """float32 tokens, then a bfloat16 step: torch.cat promotes to float32, and so does the layer
    (its buffer stays, the step's values cast into it)."""
    g = torch.Generator().manual_seed(4)
    ours, ref = GrowingLayer(spare_tokens=8), DynamicLayer()
    k, v = _states(g, 1, 3)
    ours.update(k, v)
    ref.update(k.clone(), v.clone())
    buf = ours.keys.data_ptr()
    k2, v2 = _states(g, 1, 2)
    got, want = ours.update(k2.bfloat16(), v2.bfloat16()), ref.update(k2.bfloat16(), v2.bfloat16())
    assert got[0].dtype == want[0].dtype == torch.float32 and ours.keys.data_ptr() == buf
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _extract(model, ids):
    with torch.inference_mode():
        return from_transformers(
            model(input_ids=ids, cache=recording_cache(model.config), use_cache=True).cache, model.config
        )


def test_to_transformers_gives_full_layers_that_grow_in_place_and_leave_the_kv_unwritten():
    g = torch.Generator().manual_seed(3)
    model = tiny_llama()
    kv = _extract(model, torch.randint(0, 512, (1, 6), generator=g))
    before = [(l.k.clone(), l.v.clone()) for l in kv.layers]

    cache = to_transformers(kv, tiny_llama().config)
    assert all(isinstance(l, GrowingLayer) for l in cache.layers)
    for i, layer in enumerate(cache.layers):
        k, v = before[i]
        layer.update(torch.ones(1, k.shape[0], 1, k.shape[2]), torch.ones(1, v.shape[0], 1, v.shape[2]))
        assert layer.get_seq_length() == 7 and torch.equal(layer.keys[0, :, :6], before[i][0])
    assert all(torch.equal(l.k, k) and torch.equal(l.v, v) for l, (k, v) in zip(kv.layers, before))


def test_reserve_makes_the_next_buffer_hold_the_reserved_tokens():
    g = torch.Generator().manual_seed(5)
    layer = GrowingLayer(spare_tokens=4)
    layer.reserve(40)
    layer.update(*_states(g, 1, 8))
    buf = layer.keys.data_ptr()
    for _ in range(9):  # 8 + 9 * 4 = 44 tokens: the 40 reserved and the spare room
        layer.update(*_states(g, 1, 4))
        assert layer.keys.data_ptr() == buf
    layer.update(*_states(g, 1, 1))
    assert layer.keys.data_ptr() != buf and layer.get_seq_length() == 45


def _concatenating_decoder_run(model, kv, tail, steps):
    """The old Decoder's way: transformers' concatenating layers, filled by update()."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for layer, l in zip(cache.layers, kv.layers):
        layer.update(l.k.unsqueeze(0).clone(), l.v.unsqueeze(0).clone())
    out, rows = None, []
    with torch.inference_mode():
        for a in range(0, tail.shape[1], 3):
            out = model(input_ids=tail[:, a : a + 3], cache=cache, use_cache=True)
            cache = out.cache
        rows.append(out.logits[0, -1])
        for _ in range(steps):
            out = model(input_ids=out.logits[0, -1].argmax().view(1, 1), cache=cache, use_cache=True)
            cache = out.cache
            rows.append(out.logits[0, -1])
    return rows


def _count_copies(monkeypatch) -> list[int]:
    """The capacity of every buffer a GrowingLayer copies its tokens into, from now on."""
    copies: list[int] = []
    real = GrowingLayer._copy_into_new_buffers
    monkeypatch.setattr(
        GrowingLayer, "_copy_into_new_buffers", lambda self, *a: (copies.append(a[1]), real(self, *a))[1]
    )
    return copies


def test_decoder_holds_the_prefix_without_copying_it_writes_it_never_and_matches_concatenation(monkeypatch):
    """Decoder (the Engine's decoding session): full layers hold the prefix's tensors, the first
    feed copies them once into a buffer with room for the whole feed, later steps append in
    place, the prefix stays unwritten, and every logit equals the concatenating cache's."""
    from cachegen.engine.prefill import Decoder

    g = torch.Generator().manual_seed(6)
    model = tiny_llama()
    kv = _extract(model, torch.randint(0, 512, (1, 9), generator=g))
    before = [(l.k.clone(), l.v.clone()) for l in kv.layers]
    tail = torch.randint(0, 512, (1, 10), generator=g)
    want = _concatenating_decoder_run(model, kv, tail, steps=5)

    copies = _count_copies(monkeypatch)
    dec = Decoder(model, kv)
    assert all(isinstance(l, GrowingLayer) for l in dec.cache.layers)
    assert all(l.keys.data_ptr() == p.k.data_ptr() for l, p in zip(dec.cache.layers, kv.layers))
    got = [dec.feed(tail[0].tolist(), step=3)]  # a prompt fed in steps: one copy for all of it
    for _ in range(5):
        got.append(dec.feed([int(got[-1].argmax())]))
    assert copies == [9 + 10 + 256] * 2  # per layer, once
    for g_, w in zip(got, want, strict=True):
        assert torch.equal(g_, w.float())
    assert all(torch.equal(l.k, k) and torch.equal(l.v, v) for l, (k, v) in zip(kv.layers, before))
    assert torch.equal(dec.kv(0, 9).layers[0].k, before[0][0])


def test_a_decoder_appends_into_a_loaded_caches_room_and_only_the_first_one_does(monkeypatch):
    """A cache allocated with room (as the loader's): the first Decoder's steps append there and
    copy nothing; a second Decoder over the same cache finds the room taken and copies; both give
    the concatenating cache's logits and leave the cache's tokens unwritten."""
    from cachegen.engine.prefill import Decoder
    from cachegen.kv import KVCache

    g = torch.Generator().manual_seed(7)
    model = tiny_llama()
    src = _extract(model, torch.randint(0, 512, (1, 9), generator=g))
    kv = KVCache.allocate(src, src.num_tokens, room_tokens=8)
    kv.write(src)
    tail = torch.randint(0, 512, (1, 4), generator=g)
    want = _concatenating_decoder_run(model, src, tail, steps=3)

    copies = _count_copies(monkeypatch)
    for taker in range(2):
        dec = Decoder(model, kv)
        got = [dec.feed(tail[0].tolist(), step=3)]
        for _ in range(3):
            got.append(dec.feed([int(got[-1].argmax())]))
        assert copies == ([] if taker == 0 else [9 + 4 + 256] * 2)  # 9 + 4 + 3 = 16 tokens: 8 of room suffice
        for g_, w in zip(got, want, strict=True):
            assert torch.equal(g_, w.float())
        assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(kv.layers, src.layers))


def test_to_transformers_appends_into_the_room_unless_it_casts_or_the_room_is_taken():
    from cachegen.kv import KVCache

    g = torch.Generator().manual_seed(8)
    model = tiny_llama()
    src = _extract(model, torch.randint(0, 512, (1, 6), generator=g))
    kv = KVCache.allocate(src, 6, room_tokens=4)
    kv.write(src)
    for dtype, in_room in ((torch.float64, False), (None, True), (None, False)):  # a cast leaves the room
        cache = to_transformers(kv, model.config, dtype=dtype)
        for layer, l, s in zip(cache.layers, kv.layers, src.layers):
            one = torch.ones(1, l.k.shape[0], 1, l.k.shape[2], dtype=dtype or l.k.dtype)
            layer.update(one, one)
            assert (layer.keys.data_ptr() == l.k.data_ptr()) == in_room
            assert torch.equal(layer.keys[0, :, :6], s.k.to(layer.keys.dtype))
        assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(kv.layers, src.layers))
