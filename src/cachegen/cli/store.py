"""``cachegen store ingest|stats|evict|clear``.

``ingest`` needs the engine (a model and the codec) and imports it when it
runs; the other commands touch the store alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachegen.store.keys import DEFAULT_CHUNK_TOKENS
from cachegen.store.url import default_store_url, open_backend, parse_size


def register(subparsers) -> argparse.ArgumentParser:
    store = subparsers.add_parser("store", help="put contexts into a KV store, inspect and trim it")
    sub = store.add_subparsers(dest="store_command", required=True, metavar="{ingest,stats,evict,clear}")

    def common(p):
        p.add_argument("--store", default=None, metavar="URL",
                       help=f"file://PATH, redis://HOST:PORT/DB or redis+cluster://HOST:PORT (default {default_store_url()})")

    p = sub.add_parser("ingest", help="prefill a text file, encode its KV at every level and store it")
    p.add_argument("file", type=Path)
    common(p)
    p.add_argument("--model", default=None, help="model name or local directory (default: smollm2-135m)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--levels", default=None, help="comma-separated quality levels (default: all)")
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("stats", help="contexts, chunks, bytes and levels held")
    common(p)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the stats as JSON")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("evict", help="drop least recently used chunks down to a size (default: the store's cap)")
    common(p)
    p.add_argument("--max-bytes", default=None, help="e.g. 500M; Redis stores need it")
    p.set_defaults(func=cmd_evict)

    p = sub.add_parser("clear", help="remove every chunk from the store")
    common(p)
    p.set_defaults(func=cmd_clear)
    return store


def cmd_stats(args) -> int:
    with open_backend(args.store) as b:
        s = b.stats().to_json()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(s, indent=1) + "\n")
    levels = ", ".join(f"L{l}: {v['chunks']} chunks {v['bytes']} B" for l, v in s["levels"].items()) or "none"
    print(f"contexts={s['contexts']} chunks={s['chunks']} bytes={s['bytes']} levels: {levels}")
    return 0


def cmd_evict(args) -> int:
    with open_backend(args.store) as b:
        n = b.evict(parse_size(args.max_bytes) if args.max_bytes else None)
        left = b.stats().bytes
    print(f"evicted {n} chunks; {left} bytes left")
    return 0


def cmd_clear(args) -> int:
    with open_backend(args.store) as b:
        n = b.clear()
    print(f"cleared {n} chunks")
    return 0


def cmd_ingest(args) -> int:
    levels = [int(x) for x in args.levels.split(",")] if args.levels else None
    text = args.file.read_text()
    from cachegen.engine.engine import Engine
    from cachegen.engine.models import DEFAULT_MODEL

    with Engine.open(args.model or DEFAULT_MODEL, args.store, args.chunk_tokens, levels) as eng:
        r = eng.ingest_text(text, progress=True)
    print(f"ingested {r.chunks} chunks, {r.tokens} tokens ({r.written} chunks written) into "
          f"{args.store or default_store_url()}")
    return 0
