"""The paged-layout probe and gather/scatter, against vLLM's own CPU KV write kernel (no engine)."""

from __future__ import annotations

import pytest
import torch

from cachegen.errors import ConfigError
from cachegen.integrations.vllm.layout import PagedLayout


@pytest.fixture(scope="module")
def kernel(vllm_env):
    from cachegen.integrations.vllm.connector import _cpu_write_kernel

    return _cpu_write_kernel(torch.bfloat16, 128, 64, "auto")[0]


@pytest.mark.parametrize("heads", [1, 3])
def test_probe_reads_back_what_the_kernel_wrote(kernel, heads):
    bs, hd, blocks = 128, 64, 5
    layout = PagedLayout.probe(kernel, bs, heads, hd)
    g = torch.Generator().manual_seed(heads)
    n = 3 * bs
    k = torch.randn(n, heads, hd, generator=g).to(torch.bfloat16)
    v = torch.randn(n, heads, hd, generator=g).to(torch.bfloat16)
    cache = torch.zeros(blocks, heads, bs, 2 * hd, dtype=torch.bfloat16)
    block_ids = [4, 1, 2]  # not in order: a request's blocks are anywhere in the pool
    slots = torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in block_ids])
    kernel(k, v, cache, slots)
    gk, gv = layout.gather(cache, block_ids)
    assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))
    # scatter into other blocks and read them back; the blocks around are untouched
    other = cache.clone()
    layout.scatter(other, [0, 3, 1], gk, gv)
    k2, v2 = layout.gather(other, [0, 3, 1])
    assert torch.equal(k2, gk) and torch.equal(v2, gv)
    assert torch.equal(other[4], cache[4]) and torch.equal(other[2], cache[2])


def test_naive_reading_is_not_the_layout(kernel):
    """The kernel does not store K as [token, dim]: reading it so would be wrong (the probe is needed)."""
    layout = PagedLayout.probe(kernel, 128, 1, 64)
    naive = torch.arange(128 * 64)
    assert not torch.equal(layout.k_index, naive)


def test_probe_refuses_a_kernel_that_loses_values():
    def lossy(k, v, cache, slots):  # writes K only
        bs, d2 = cache.shape[2], cache.shape[3]
        for i, s in enumerate(slots.tolist()):
            cache[s // bs, :, s % bs, : d2 // 2] = k[i]

    with pytest.raises(ConfigError):
        PagedLayout.probe(lossy, 16, 1, 8)


def test_probe_of_a_plain_layout():
    def plain(k, v, cache, slots):  # [token, K | V], the layout one might assume
        bs = cache.shape[2]
        for i, s in enumerate(slots.tolist()):
            cache[s // bs, :, s % bs] = torch.cat([k[i], v[i]], dim=-1)

    layout = PagedLayout.probe(plain, 16, 2, 8)
    t, d = 5, 3
    assert int(layout.k_index[t * 8 + d]) == t * 16 + d
    assert int(layout.v_index[t * 8 + d]) == t * 16 + 8 + d


def test_scatter_refuses_a_wrong_shape():
    def plain(k, v, cache, slots):
        bs = cache.shape[2]
        for i, s in enumerate(slots.tolist()):
            cache[s // bs, :, s % bs] = torch.cat([k[i], v[i]], dim=-1)

    layout = PagedLayout.probe(plain, 16, 2, 8)
    cache = torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ConfigError):
        layout.scatter(cache, [0, 1], torch.zeros(2, 16, 8), torch.zeros(2, 16, 8))
