"""``cachegen bench scale``: the rows' fields on SmolLM2 at its quick size, and the peak-memory probe."""

from __future__ import annotations

import json

import pytest
import torch

from cachegen.bench.scale import SCALE_FIELDS, PeakRss, default_plan


def test_the_peak_rss_probe_sees_an_allocation_after_a_reset():
    mem = PeakRss()
    mem.reset()
    before = mem.peak_mb()
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    assert mem.peak_mb() - before >= 60, (before, mem.peak_mb())
    del x


def test_the_default_plan_stays_within_each_models_positions():
    plan = {p.model: p.contexts for p in default_plan({"smollm2-135m": 8192, "gemma3-270m": 32768})}
    assert plan["smollm2-135m"][:3] == (1024, 2048, 4096) and max(plan["smollm2-135m"]) < 8192
    assert max(plan["gemma3-270m"]) < 32768 and max(plan["gemma3-270m"]) > 32000


@pytest.mark.model
def test_bench_scale_quick_writes_every_field(tmp_path):
    from cachegen.cli.main import main

    out = tmp_path / "scale.json"
    assert main(["bench", "scale", "--quick", "--model", "smollm2-135m", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = res["rows"]
    itemsize = getattr(torch, res["dtype"]).itemsize  # the serving dtype: auto, chosen by the CPU
    assert {r["method"] for r in rows} == {"recompute", "uniform8", "cachegen", "adaptive"}
    vpt = 30 * 2 * 3 * 64  # SmolLM2: 30 layers, K and V, 3 KV heads of 64
    for r in rows:
        assert set(SCALE_FIELDS) <= set(r), r
        assert r["model"] == "smollm2-135m" and r["context_tokens"] == 512 and r["bandwidth_gbps"] == 1.0
        assert r["ttft_s"] > 0 and r["base_rss_mb"] > 100  # the model is in the process
        assert r["kv_mb"] == pytest.approx(512 * vpt * itemsize / 2**20, rel=1e-6)
        assert r["peak_rss_mb"] >= r["base_rss_mb"]
    by = {r["method"]: r for r in rows}
    assert by["cachegen"]["level"] in range(1, 8)
    assert sum(by["adaptive"]["formats"].values()) == 2  # two chunks of 256 tokens
    assert by["uniform8"]["fetched_bytes"] > by["cachegen"]["fetched_bytes"]
