"""transformers' KV of a prompt, by cachegen's own prefill in bf16 (run in cachegen's environment).

``python hf_reference.py MODEL_DIR IDS.json OUT.pt``: the reference the vLLM layout
test compares the connector's stored chunks with (vLLM pins an older transformers).
"""

from __future__ import annotations

import json
import sys

import torch

from cachegen.engine.models import load_model
from cachegen.engine.prefill import prefill


def main(model: str, ids_path: str, out: str) -> None:
    with open(ids_path) as f:
        ids = json.load(f)
    lm = load_model(model, progress=False)
    # bf16 weights, but RoPE's inverse frequencies stay fp32, as in vLLM: ``.to(bf16)`` casts that
    # buffer too, and the keys' fast-rotating dims then drift with position (relative error 0.6
    # in those dims at position ~700, 0.07-0.11 over a layer's K)
    rotary = [
        (m, m.inv_freq.clone()) for m in lm.model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)
    ]
    lm.model.to(torch.bfloat16)
    for m, inv in rotary:
        m.inv_freq = inv
    kv = prefill(lm.model, ids)
    torch.save({"k": [l.k for l in kv.layers], "v": [l.v for l in kv.layers], "tokens": kv.num_tokens}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
