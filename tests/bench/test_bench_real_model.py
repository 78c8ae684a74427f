"""The harness on SmolLM2 at a small size: the shapes and orderings the README's numbers rely on."""

from __future__ import annotations

import pytest

from cachegen.bench import baselines as B
from cachegen.bench.quality import run_quality

pytestmark = pytest.mark.model


def test_quality_on_smollm2(smollm2):
    codecs = B.make_codecs(["fp16", "uniform8", "kivi2", "cachegen-released"])
    res = run_quality(smollm2, codecs, context_tokens=256, continuation_tokens=32)
    by = {(r["codec"], r["level"]): r for r in res["rows"]}
    assert by[("fp16", None)]["kl"] < 1e-4 and by[("fp16", None)]["top1_agreement"] == 1.0
    assert by[("uniform8", None)]["kl"] < by[("kivi2", None)]["kl"]
    # one full 256-token chunk: the released format's CDF tables alone are 33 * 16 / 256 = 2.06 bits/value,
    # plus a 32-bit scale per token and layer over 192 channels (0.17 bits/value)
    for lv in (1, 2, 3):
        assert by[("cachegen-released", lv)]["bits_per_value"] > 2.0625 + 32 / 192
    assert (
        by[("cachegen-released", 1)]["size_bytes"]
        < by[("cachegen-released", 2)]["size_bytes"]
        < by[("cachegen-released", 3)]["size_bytes"]
    )
    assert by[("cachegen-released", 3)]["kl"] < by[("cachegen-released", 1)]["kl"]
