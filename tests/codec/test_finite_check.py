"""The codec's NaN/Inf check (``codec.all_finite``): exact for every dtype, no false refusal of large values."""

from __future__ import annotations

import pytest
import torch

from cachegen.codec import Codec
from cachegen.codec.codec import all_finite
from cachegen.errors import CodecError
from cachegen.kv import KVCache, KVLayer

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_non_finite_value_anywhere_is_found(dtype, bad):
    x = torch.randn(3, 40, 16).to(dtype)
    assert all_finite(x)
    for idx in [(0, 0, 0), (1, 17, 5), (2, 39, 15)]:
        y = x.clone()
        y[idx] = bad
        assert not all_finite(y), (dtype, bad, idx)


def test_inf_and_minus_inf_together_are_found():
    x = torch.zeros(2, 8, 4)
    x[0, 0, 0], x[1, 7, 3] = float("inf"), -float("inf")
    assert not all_finite(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_largest_finite_values_are_not_refused(dtype):
    big = torch.finfo(dtype).max
    x = torch.full((3, 64, 16), big, dtype=dtype)  # a float32 (or fp16) sum of these would overflow
    assert all_finite(x) and all_finite(-x)
    kv = KVCache([KVLayer(x, -x)], start=0)
    out = Codec().decode(Codec().encode(kv, 0))  # lossless: every value back, none refused
    assert torch.equal(out.layers[0].k, x) and torch.equal(out.layers[0].v, -x)


def test_the_encoder_refuses_a_non_finite_kv():
    x = torch.randn(2, 8, 4)
    x[1, 3, 2] = float("nan")
    with pytest.raises(CodecError, match="NaN or Inf"):
        Codec().encode(KVCache([KVLayer(torch.randn(2, 8, 4), x)], start=0), 0)
