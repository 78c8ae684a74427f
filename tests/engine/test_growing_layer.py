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
