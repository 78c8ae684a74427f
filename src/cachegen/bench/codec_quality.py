"""Rate vs quality of the codec levels on real text (the numbers in docs/codec.md).

Run: ``python -m cachegen.bench.codec_quality [--model smollm2-135m] [--context 2048] [--cont 256]``.
Calibrates the model's default profile on pydoc topics (cached), then for
each evaluation text (GPL-3 and Apache-2.0 licences, not used for
calibration) encodes the context KV at every level in 256-token chunks and
reports bits/value (all side info: headers, tables, sinks, escapes) with KL,
top-1 agreement and perplexity change on the continuation.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from cachegen.bench.quality_metrics import measure_quality
from cachegen.calibrate import context_kv, load_or_calibrate
from cachegen.codec import LEVELS, Codec
from cachegen.kv import KVCache

log = logging.getLogger(__name__)

EVAL_TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")


def _eval_ids(tok, path: str, n: int) -> torch.Tensor:
    if path.startswith("pydoc"):  # held-out half of the pydoc topics (calibration uses pydoc-calib)
        from cachegen import corpus

        text = corpus.text(path)
    else:
        text = Path(path).read_text()
    ids = tok(text)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return torch.tensor(ids[:n], dtype=torch.long)


def run_rate_quality(
    model_name: str = "smollm2-135m",
    context: int = 2048,
    cont: int = 256,
    chunk: int = 256,
    levels=LEVELS,
    texts=EVAL_TEXTS,
    profile=None,
    loaded=None,
    end_after: int | None = 0,
) -> list[dict]:
    """Rows per (text, level). ``end_after``: the encoder is told the context ends that many
    tokens after its real end (0: where the continuation starts, as a store writes a context;
    more: a chunk first written inside a longer context); None: the end is not given."""
    from cachegen.engine.models import load_model

    m = loaded or load_model(model_name)
    prof = profile or load_or_calibrate(m)
    codec = Codec(prof)
    rows = []
    for path in texts:
        ids = _eval_ids(m.tokenizer, path, context + cont)
        kv = context_kv(m.model, ids[:context])
        for lv in levels:
            nbytes = 0

            def rt(x: KVCache, lv: int = lv) -> KVCache:
                nonlocal nbytes
                parts = []
                for c in x.chunks(chunk):
                    if end_after is None:
                        b = codec.encode(c, lv)
                    else:
                        b = codec.encode(c, lv, context_end=x.end + end_after)
                    nbytes += len(b)
                    parts.append(codec.decode(b))
                return KVCache.concat(parts)

            q = measure_quality(m.model, kv, ids[context:], rt)
            row = {"text": Path(path).name, "level": lv, "bits_per_value": nbytes * 8 / kv.num_values, **q}
            rows.append(row)
            print(
                f"{row['text']:12s} L{lv}  {row['bits_per_value']:.3f} b/v  KL {q['kl']:.5f}  top1 {q['top1_agreement']:.3f}  dppl {q['ppl_delta_pct']:+.2f}%",
                flush=True,
            )
    return rows


BUDGETS = {"strict": (0.002, 0.97), "loose": (0.01, 0.0)}


def budget_summary(rows: list[dict], texts=None) -> dict:
    """Lowest bits/value of a level that meets each budget on every text (None if no level does)."""
    texts = texts or sorted({r["text"] for r in rows})
    out = {}
    for name, (kl_max, top1_min) in BUDGETS.items():
        best = None
        for lv in sorted({r["level"] for r in rows}):
            rs = [r for r in rows if r["level"] == lv and r["text"] in texts]
            if len(rs) == len(texts) and all(r["kl"] <= kl_max and r["top1_agreement"] >= top1_min for r in rs):
                bpv = max(r["bits_per_value"] for r in rs)
                if best is None or bpv < best[1]:
                    best = (lv, bpv)
        out[name] = best
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--texts", default=",".join(EVAL_TEXTS), help="comma list of files or pydoc-eval")
    ap.add_argument("--json")
    end = ap.add_mutually_exclusive_group()
    end.add_argument(
        "--end-after",
        type=int,
        default=0,
        metavar="N",
        help="tell the encoder the context ends N tokens after its real end (default 0: at it)",
    )
    end.add_argument("--end-unknown", action="store_true", help="do not tell the encoder where the context ends")
    ap.add_argument("--recalibrate", action="store_true", help="rebuild the cached profile first (and time it)")
    a = ap.parse_args(argv)
    texts = tuple(a.texts.split(","))
    profile = loaded = None
    if a.recalibrate:
        import time

        from cachegen.engine.models import load_model

        loaded = load_model(a.model)
        t = time.perf_counter()
        profile = load_or_calibrate(loaded, refresh=True)
        # printed, not logged: this module configures no logging, and the time is what --recalibrate is for
        print(f"calibrated profile {profile.id} in {time.perf_counter() - t:.1f} s", flush=True)
    rows = run_rate_quality(
        a.model,
        a.context,
        a.cont,
        levels=[int(x) for x in a.levels.split(",")],
        texts=texts,
        profile=profile,
        loaded=loaded,
        end_after=None if a.end_unknown else a.end_after,
    )
    lic = [Path(t).name for t in texts if not t.startswith("pydoc")]
    for name, best in budget_summary(rows, lic or None).items():
        print(f"{name} budget on {', '.join(lic)}: " + (f"L{best[0]} {best[1]:.3f} b/v" if best else "no level passes"))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
