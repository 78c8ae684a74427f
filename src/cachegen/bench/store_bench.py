"""Per-chunk store overhead against chunk size: ``python -m cachegen.bench.store_bench``.

Stores one context of ``--tokens`` tokens split into chunks of each size, with
payloads sized like CacheGen's levels for SmolLM2-135M (11,520 K/V values per
token; see ``--bits``), then times put (all levels), plan (sizes only) and a
get of one level per chunk, as the streaming loader does. Reported per chunk
and as MB/s, for every store URL given. Numbers go into docs/store.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from cachegen.store.backend import ChunkWrite
from cachegen.store.context_store import ContextStore
from cachegen.store.keys import Namespace
from cachegen.store.url import open_backend

VALUES_PER_TOKEN = 11_520  # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K, V)


def bench(url: str, chunk_tokens: int, tokens: int, bits: list[float], repeat: int = 3) -> dict:
    ns = Namespace("bench", 0, f"bench{chunk_tokens}")
    backend = open_backend(url)
    backend.clear()
    cs = ContextStore(backend, ns, chunk_tokens=chunk_tokens)
    ids = list(range(tokens))
    refs = cs.refs(ids)
    blobs = {
        r.key: {l: os.urandom(int(r.num_tokens * VALUES_PER_TOKEN * b / 8)) for l, b in enumerate(bits)} for r in refs
    }
    raw = [ChunkWrite(r.key, b"", blobs[r.key], start=r.start, ends_context=r is refs[-1]) for r in refs]
    best = {"put": 1e9, "plan": 1e9, "get": 1e9}
    mid = len(bits) // 2
    for _ in range(repeat):
        backend.clear()
        t = time.perf_counter()
        for w in raw:
            backend.put_chunks([w])
        best["put"] = min(best["put"], time.perf_counter() - t)
        t = time.perf_counter()
        plan = cs.plan(ids)
        best["plan"] = min(best["plan"], time.perf_counter() - t)
        t = time.perf_counter()
        for info in plan:
            cs.get(info.ref, mid)
        best["get"] = min(best["get"], time.perf_counter() - t)
    n = len(refs)
    get_bytes = sum(len(blobs[r.key][mid]) for r in refs)
    put_bytes = sum(sum(len(b) for b in blobs[r.key].values()) for r in refs)
    backend.clear()
    backend.close()
    return {
        "store": url.split(":", 1)[0],
        "chunk_tokens": chunk_tokens,
        "chunks": n,
        "put_ms_per_chunk": 1e3 * best["put"] / n,
        "put_MBps": put_bytes / best["put"] / 1e6,
        "get_ms_per_chunk": 1e3 * best["get"] / n,
        "get_MBps": get_bytes / best["get"] / 1e6,
        "plan_ms": 1e3 * best["plan"],
    }


def codec_overhead(model: str, text_file: str, tokens: int = 1024, levels=(0, 4)) -> list[dict]:
    """Encoded bytes per token against chunk size, with the real codec (needs the model; imported lazily)."""
    from cachegen import codec
    from cachegen.calibrate import load_or_calibrate
    from cachegen.engine.models import load_model
    from cachegen.engine.prefill import prefill

    m = load_model(model, progress=False)
    ids = m.tokenizer(Path(text_file).read_text())["input_ids"][:tokens]
    kv = prefill(m.model, ids)
    c = codec.Codec(load_or_calibrate(m), m.fingerprint)
    rows = []
    for n in (64, 128, 256, 512, 1024):
        for level in levels:
            total = sum(len(c.encode(part, level)) for part in kv.chunks(n))
            rows.append({"chunk_tokens": n, "level": level, "bytes_per_token": total / len(ids)})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--store", action="append", default=None, help="store URL (repeatable); default a temporary file store"
    )
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--sizes", default="64,128,256,512,1024")
    # measured on SmolLM2-135M fp32 KV with the codec (`cachegen store ingest`): levels 0..7
    ap.add_argument(
        "--bits", default="29.1,5.46,4.68,4.19,3.68,3.09,2.33,1.71", help="bits per value of each stored level"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--codec-model", default=None, help="instead: measure the codec's bytes per token (e.g. smollm2-135m)"
    )
    ap.add_argument("--text", default=None, help="text file for --codec-model")
    a = ap.parse_args()
    if a.codec_model:
        rows = codec_overhead(a.codec_model, a.text, a.tokens if a.tokens != 8192 else 1024)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    urls = a.store or [f"file://{tempfile.mkdtemp(prefix='cachegen-bench-')}"]
    bits = [float(b) for b in a.bits.split(",")]
    rows = [bench(u, int(s), a.tokens, bits, a.repeat) for u in urls for s in a.sizes.split(",")]
    print(
        f"{'store':8} {'chunk':>6} {'chunks':>6} {'put ms/chunk':>13} {'put MB/s':>9} {'get ms/chunk':>13} {'get MB/s':>9} {'plan ms':>8}"
    )
    for r in rows:
        print(
            f"{r['store']:8} {r['chunk_tokens']:6d} {r['chunks']:6d} {r['put_ms_per_chunk']:13.2f} {r['put_MBps']:9.0f} "
            f"{r['get_ms_per_chunk']:13.2f} {r['get_MBps']:9.0f} {r['plan_ms']:8.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
