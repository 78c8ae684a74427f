"""``cachegen store ingest|stats|evict|clear``.

:func:`register` adds the command group to the top-level parser. Only
``ingest`` needs a model and the codec, imported when it runs, so the store
layer itself never depends on the engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

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
    chunks, tokens, written = ingest_text(text, args.store, args.model, args.chunk_tokens, levels)
    print(f"ingested {chunks} chunks, {tokens} tokens ({written} chunks written) into {args.store or default_store_url()}")
    return 0


def ingest_text(text: str, store_url: str | None, model_name: str | None = None,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, levels: Sequence[int] | None = None) -> tuple[int, int, int]:
    """Tokenize, prefill what the store lacks, encode and put. Returns (chunks, tokens, chunks written).

    Belongs above the store (it needs the engine and the codec); kept here until the
    CLI layer takes it."""
    from cachegen import codec
    from cachegen.engine.models import DEFAULT_MODEL, load_model
    from cachegen.engine.prefill import prefill
    from cachegen.store.context_store import ContextStore
    from cachegen.store.keys import Namespace

    m = load_model(model_name or DEFAULT_MODEL)
    ids = m.tokenizer(text, add_special_tokens=True)["input_ids"]
    profile = codec.load_or_calibrate(m)
    enc = codec.Codec(profile, m.fingerprint)
    ns = Namespace(m.fingerprint, codec.FORMAT_VERSION, profile.id)
    all_levels = (codec.LOSSLESS, *sorted(profile.levels))
    with open_backend(store_url) as backend:
        cs = ContextStore(backend, ns, enc, chunk_tokens, levels=levels or all_levels)
        plan = cs.plan(ids)
        if all(set(cs.levels) <= i.sizes.keys() for i in plan):
            return len(plan), len(ids), 0
        kv = prefill(m.model, ids)
        written = cs.put_context(ids, kv)
    return len(plan), len(ids), len(written)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the store commands on their own (``python -m cachegen.store.cli``)."""
    parser = argparse.ArgumentParser(prog="cachegen")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    from cachegen.errors import CachegenError

    try:
        return args.func(args)
    except CachegenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
