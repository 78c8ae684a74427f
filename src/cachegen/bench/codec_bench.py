"""``cachegen bench codec``: codec speed and rate on a real model's KV.

Rows: ``codec``, ``level``, ``encode_mvalues_s``, ``decode_mvalues_s``,
``entropy_decode_msymbols_s``, ``entropy_encode_msymbols_s``, ``bits_per_value`` (plus ``encode_s``/``decode_s``).
Encode/decode time the whole ``context_tokens`` KV as one chunk, bytes <-> KVCache.
``chunked_decode_s`` decodes the same context stored as ``chunk_tokens``-token chunks into one
preallocated cache, one ``decode_into`` per chunk; ``batched_decode_s`` the same chunks in one
``decode_many_into`` call, as the loader decodes chunks that wait in its queue (best of 5 each).
The entropy figures time :func:`cachegen.codec.rans.decode_interleaved_many` /
:func:`~cachegen.codec.rans.encode_interleaved` alone over all sections (best
of 5), split over ``threads`` Python threads the way the codec splits them
(:func:`cachegen.codec.codec.decode_jobs`: runs of consecutive sections, two jobs per
thread).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cachegen.codec import LEVELS, LOSSLESS, Codec, rans
from cachegen.errors import ConfigError
from cachegen.stream.costs import best_time


def _text_ids(tok, n: int):
    import torch

    text = "\n\n".join(
        Path(p).read_text() for p in ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")
    )
    ids = tok(text)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return torch.tensor(ids[:n], dtype=torch.long)


def _entropy_speed(prof, kv, level: int, threads: int) -> tuple[float, float]:
    """(decode, encode) M symbols/s of the rANS coder alone (as the codec uses it), sections split over threads."""
    from cachegen.codec.codec import decode_jobs, layer_inputs, section_symbols
    from cachegen.codec.profile import TABLE_PAD

    lp = prof.levels[level]
    tables, cls = lp.padded_tables(), lp.classes(prof.sections)
    jobs = []
    for li, layer in enumerate(kv.layers):
        ys, us = layer_inputs(layer, prof.sections[2 * li : 2 * li + 2], prof.n_sink, 0)
        for j, (y, u) in enumerate(zip(ys, us)):
            i = 2 * li + j
            sym = section_symbols(y, u, lp.steps[i], cls[i], tables)[0]
            jobs.append(
                (rans.encode_interleaved(sym, cls[i] + TABLE_PAD, tables, -u), y.shape[0], cls[i] + TABLE_PAD, sym, -u)
            )
    n = sum(j[1] * j[2].size for j in jobs)
    blocks = [rans.Block(j[0], j[1], j[2], j[4]) for j in jobs]
    groups = decode_jobs(blocks, threads)  # as the codec's decode jobs take its sections
    with ThreadPoolExecutor(threads) as ex:
        td = best_time(lambda: list(ex.map(lambda g: rans.decode_interleaved_many(g, tables), groups)), 5)
        te = best_time(lambda: list(ex.map(lambda j: rans.encode_interleaved(j[3], j[2], tables, j[4]), jobs)), 5)
    return n / td / 1e6, n / te / 1e6


def _chunked_decode(codec: Codec, kv, level: int, chunk_tokens: int) -> tuple[float, float]:
    """Seconds to decode ``kv`` stored as chunks into one cache: one call per chunk, then one call for all."""
    from cachegen.kv import KVCache

    starts = list(range(kv.start, kv.end, chunk_tokens))
    parts = [kv.slice(a, min(a + chunk_tokens, kv.end)) for a in starts]
    datas = [codec.encode(p, level, context_end=kv.end) for p in parts]
    out = KVCache.allocate(kv, kv.num_tokens, start=kv.start)

    def one_by_one() -> None:
        for p, d in zip(parts, datas, strict=True):
            codec.decode_into(d, out.slice(p.start, p.end))

    sizes = [p.num_tokens for p in parts]
    return best_time(one_by_one, 5), best_time(lambda: codec.decode_many_into(datas, out, sizes), 5)


def run_codec_bench(
    model_name: str = "smollm2-135m",
    context_tokens: int = 4096,
    json_path: str | None = None,
    threads: int = 2,
    levels=(LOSSLESS, *LEVELS),
    chunk_tokens: int = 256,
) -> list[dict]:
    from cachegen.calibrate import context_kv, load_or_calibrate
    from cachegen.engine.models import load_model

    if chunk_tokens < 1:
        raise ConfigError(f"--chunk-tokens must be at least 1, not {chunk_tokens}")

    m = load_model(model_name)
    prof = load_or_calibrate(m)
    kv = context_kv(m.model, _text_ids(m.tokenizer, context_tokens))
    codec = Codec(prof, threads=threads)
    rows = []
    for lv in levels:
        src = kv.to(__import__("torch").bfloat16) if lv == LOSSLESS else kv
        data = codec.encode(src, lv)
        te = best_time(lambda src=src, lv=lv: codec.encode(src, lv), 5)  # type: ignore[misc]  # mypy: lambda with defaults
        td = best_time(lambda data=data: codec.decode(data), 5)  # type: ignore[misc]  # mypy: lambda with defaults
        tc, tb = _chunked_decode(codec, src, lv, chunk_tokens)
        ent, ent_e = _entropy_speed(prof, kv, lv, threads) if lv != LOSSLESS else (float("nan"), float("nan"))
        rows.append(
            {
                "codec": "cachegen" + ("-lossless-bf16" if lv == LOSSLESS else ""),
                "level": lv,
                "encode_mvalues_s": kv.num_values / te / 1e6,
                "decode_mvalues_s": kv.num_values / td / 1e6,
                "entropy_decode_msymbols_s": ent,
                "entropy_encode_msymbols_s": ent_e,
                "bits_per_value": len(data) * 8 / kv.num_values,
                "encode_s": te,
                "decode_s": td,
                "chunk_tokens": chunk_tokens,
                "chunked_decode_s": tc,
                "batched_decode_s": tb,
            }
        )
    print(
        f"{'codec':24s} {'lvl':>3s} {'enc Mv/s':>9s} {'dec Mv/s':>9s} {'rANS dec':>9s} {'rANS enc':>9s} {'bits/val':>8s} {'enc s':>6s} {'dec s':>6s} {'chunks s':>8s} {'batch s':>7s}"
    )
    for r in rows:
        print(
            f"{r['codec']:24s} {r['level']:3d} {r['encode_mvalues_s']:9.1f} {r['decode_mvalues_s']:9.1f} "
            f"{r['entropy_decode_msymbols_s']:9.1f} {r['entropy_encode_msymbols_s']:9.1f} {r['bits_per_value']:8.3f} {r['encode_s']:6.3f} {r['decode_s']:6.3f} {r['chunked_decode_s']:8.3f} {r['batched_decode_s']:7.3f}"
        )
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return rows


def register(sub) -> None:
    """Add the ``codec`` subcommand to an argparse subparsers object (the ``bench`` group)."""
    p = sub.add_parser("codec", help="codec speed and bits/value on a real model's KV")
    p.add_argument("--model", default="smollm2-135m", help="model name or directory (default smollm2-135m)")
    p.add_argument("--context-tokens", type=int, default=4096, help="tokens of real text encoded (default 4096)")
    p.add_argument("--threads", type=int, default=2, help="numba threads of the coder (default 2)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON ('-': stdout)")
    p.add_argument(
        "--chunk-tokens", type=int, default=256, help="tokens per chunk of the chunked decode columns (default 256)"
    )
    p.add_argument(
        "--levels",
        default=",".join(map(str, (LOSSLESS, *LEVELS))),
        help="comma-separated levels (default: all, 0 = lossless)",
    )
    p.set_defaults(
        func=lambda a: run_codec_bench(
            a.model, a.context_tokens, a.json, a.threads, tuple(int(x) for x in a.levels.split(",")), a.chunk_tokens
        )
    )


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    s = ap.add_subparsers()
    register(s)
    a = ap.parse_args()
    a.func(a)
