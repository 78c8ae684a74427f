"""Where each model's codec levels land: realized KL against the level's target, on held-out
calibration text (the numbers behind ``cachegen.calibrate.KL_SCALES``).

Run: ``python -m cachegen.bench.level_placement [--models smollm2-135m,gemma3-270m] [--json PATH]``.

A level's steps are set so that the Fisher prediction of its KL meets the level's target; how far
the realized KL lands from that prediction differs between models (Gemma-3's ~5x as far as
SmolLM2's on this text, ~2x on the evaluation texts of bench codec_quality). For each model this
encodes, at every level, contexts of the calibration text that calibration itself does not read
(they start where :func:`calibration_windows` ends), measures KL on their continuation and
reports the geometric mean of realized / target (``rho``).
The first model is the reference: another model's levels land where the reference's do when its
KL targets are scaled by ``rho_ref x kl_scale_ref / rho`` (``suggested_kl_scale``). Evaluation
texts are never read here.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from cachegen.bench.baselines import Variant
from cachegen.bench.quality_metrics import measure_quality
from cachegen.calibrate import calibration_windows, context_kv, load_or_calibrate
from cachegen.codec import KL_TARGETS, LEVELS, Codec
from cachegen.engine.attention import stock_sdpa
from cachegen.kv import KVCache


def held_out_windows(n_tokens: int, n: int, context: int, cont: int) -> list[int]:
    """Starts of ``n`` (context + cont)-token windows after every calibration window."""
    start = calibration_windows(n_tokens).end
    span = context + cont
    if n_tokens < start + n * span:
        raise ValueError(f"calibration text too short for {n} held-out windows: {n_tokens} tokens")
    return [start + j * span for j in range(n)]


def placement(
    model_name: str, windows: int = 4, levels=LEVELS, context: int = 2048, cont: int = 256, chunk: int = 256
) -> dict:
    """Realized KL per (window, level) for ``model_name``'s default profile, and ``rho``."""
    from cachegen import corpus
    from cachegen.engine.models import load_model

    m = load_model(model_name)
    prof = load_or_calibrate(m)
    codec = Codec(prof)
    targets = {int(k): float(v) for k, v in prof.meta["kl_targets"].items()}
    ids = torch.tensor(m.tokenizer(corpus.text("calib"))["input_ids"], dtype=torch.long)
    rows = []
    with stock_sdpa(m.model):  # as calibration runs the model
        for s in held_out_windows(ids.numel(), windows, context, cont):
            kv = context_kv(m.model, ids[s : s + context])
            for lv in levels:

                def rt(x: KVCache, lv: int = lv) -> KVCache:  # each chunk as a store writes it
                    return KVCache.concat([codec.decode(b) for b in Variant(codec, lv).encode_context(x, chunk)])

                q = measure_quality(m.model, kv, ids[s + context : s + context + cont], rt)
                rows.append(
                    {"start": s, "level": lv, "kl": q["kl"], "target": targets[lv], "ratio": q["kl"] / targets[lv]}
                )
                print(f"{model_name} @{s} L{lv}: KL {q['kl']:.5f}, {rows[-1]['ratio']:.2f}x its target", flush=True)
    rho = math.exp(sum(math.log(r["ratio"]) for r in rows) / len(rows))
    scale = targets[levels[0]] / KL_TARGETS[levels[0]]  # the factor this profile was built with
    return {"model": model_name, "kl_scale": scale, "profile": prof.id, "rho": rho, "rows": rows}


def suggest_scales(out: list[dict]) -> list[dict]:
    """Add ``suggested_kl_scale`` to each model's result: the factor at which it lands as ``out[0]`` does.

    Realized / nominal KL is ``rho x kl_scale``; matching the reference's assumes ``rho`` does not
    move with the factor (it grows at the finest levels, where a model's KL floors)."""
    ref = out[0]["rho"] * out[0]["kl_scale"]
    return [{**r, "suggested_kl_scale": ref / r["rho"]} for r in out]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m", help="comma-separated; the first is the reference")
    ap.add_argument("--windows", type=int, default=4, help="held-out contexts per model (default 4)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    out = suggest_scales([placement(name, a.windows) for name in a.models.split(",")])
    for r in out:
        print(
            f"{r['model']}: rho {r['rho']:.3f} at kl_scale {r['kl_scale']:.3f}; to land as {out[0]['model']}: {r['suggested_kl_scale']:.3f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
