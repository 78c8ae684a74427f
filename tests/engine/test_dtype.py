"""The serving dtype: chosen from the CPU's flags, and a cast that keeps RoPE's frequencies in fp32."""

from __future__ import annotations

import copy

import pytest
import torch

from cachegen.engine.dtype import auto_dtype_name, cast_model, cpu_flags, resolve_dtype


def test_auto_picks_bf16_only_where_the_cpu_computes_it_natively():
    assert auto_dtype_name(frozenset({"avx2", "fma"})) == "float32"
    assert auto_dtype_name(frozenset({"avx512f", "avx512_bf16"})) == "bfloat16"
    assert auto_dtype_name(frozenset({"amx_bf16", "amx_tile"})) == "bfloat16"
    assert auto_dtype_name(frozenset()) == "float32"


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(str(info)) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_resolve_dtype():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype(torch.bfloat16) is torch.bfloat16
    assert resolve_dtype(None) is resolve_dtype("auto") is getattr(torch, auto_dtype_name())
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float7")


def test_cast_keeps_rotary_frequencies_in_fp32(tiny_llama):
    m = copy.deepcopy(tiny_llama)
    before = {n: b.clone() for n, b in m.named_buffers() if n.endswith("inv_freq")}
    assert before, "the tiny llama has rotary buffers"
    cast_model(m, torch.bfloat16)
    after = dict(m.named_buffers())
    for name, b in before.items():
        assert after[name].dtype == torch.float32
        assert torch.equal(after[name], b)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    # what a plain .to() does, and why it matters: the frequencies are rounded
    plain = copy.deepcopy(tiny_llama).to(torch.bfloat16)
    rounded = dict(plain.named_buffers())
    assert any(not torch.equal(rounded[n].float(), b) for n, b in before.items())
