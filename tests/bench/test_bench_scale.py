"""``cachegen bench scale``: the rows' fields at its quick size (on the tiny model), and the peak-memory probe."""

from __future__ import annotations

import json
import mmap

import pytest
import torch

from cachegen.bench.scale import SCALE_FIELDS, PeakRss, default_plan


def test_the_peak_rss_probe_sees_an_allocation_after_a_reset():
    mem = PeakRss()
    mem.reset()
    before = mem.peak_mb()
    # 64 MiB of fresh pages, touched: an anonymous mapping (malloc may hand back memory that
    # earlier tests freed and that is still resident, which would not raise the peak)
    with mmap.mmap(-1, 64 << 20) as m:
        m.write(b"\1" * (64 << 20))
        assert mem.peak_mb() - before >= 60, (before, mem.peak_mb())


def test_the_default_plan_stays_within_each_models_positions():
    plan = {p.model: p.contexts for p in default_plan({"smollm2-135m": 8192, "gemma3-270m": 32768})}
    assert plan["smollm2-135m"][:3] == (1024, 2048, 4096) and max(plan["smollm2-135m"]) < 8192
    assert max(plan["gemma3-270m"]) < 32768 and max(plan["gemma3-270m"]) > 32000


def test_bench_scale_quick_writes_every_field(tmp_path, tiny_lm, monkeypatch):
    """``bench scale --quick`` end to end on the tiny model (one fresh process per row, as on a real one;
    ``make bench`` runs it on SmolLM2 and Gemma-3)."""
    from cachegen.cli.main import main

    monkeypatch.setenv("CACHEGEN_HOME", str(tmp_path / "home"))  # the tiny model's calibrated profile
    d = tmp_path / "tiny"
    tiny_lm.model.save_pretrained(d)
    tiny_lm.tokenizer.save_pretrained(d)
    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--quick", "--model", str(d), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    itemsize = getattr(torch, res["dtype"]).itemsize  # the serving dtype: auto, chosen by the CPU
    assert {r["method"] for r in rows} == {"recompute", "uniform8", "cachegen", "adaptive"}
    cfg = tiny_lm.config
    vpt = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    for r in rows:
        assert set(SCALE_FIELDS) <= set(r), r
        assert r["model"] == str(d) and r["context_tokens"] == 512 and r["bandwidth_gbps"] == 1.0
        assert r["ttft_s"] > 0 and r["base_rss_mb"] > 100  # torch and the model are in the process
        assert r["kv_mb"] == pytest.approx(512 * vpt * itemsize / 2**20, rel=1e-6)
        assert r["peak_rss_mb"] >= r["base_rss_mb"]
    by = {r["method"]: r for r in rows}
    assert by["cachegen"]["level"] in range(1, 8)
    assert sum(by["adaptive"]["formats"].values()) == 2  # two chunks of 256 tokens
    assert by["uniform8"]["fetched_bytes"] > by["cachegen"]["fetched_bytes"]
