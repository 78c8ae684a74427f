"""``cachegen store ingest|ls|rm|stats|evict|clear``.

``ingest`` needs the engine (a model and the codec) and imports it when it
runs; the other commands touch the store alone, and never create one: they
open an existing store (``create=False``) and say so where there is none.
Every URL they print is redacted.
"""

from __future__ import annotations

import argparse

from cachegen.cli import options
from cachegen.cli.output import write_json


def register(subparsers) -> argparse.ArgumentParser:
    store = subparsers.add_parser("store", help="put contexts into a KV store, list, inspect and trim it")
    sub = store.add_subparsers(dest="store_command", required=True, metavar="{ingest,ls,rm,stats,evict,clear}")

    p = sub.add_parser("ingest", help="prefill a text file, encode its KV at every level and store it")
    p.add_argument("file", help="a UTF-8 text file: the context to store")
    options.store(p)
    options.model(p)
    options.chunk_tokens(p)
    options.levels(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("ls", help="list the stored contexts: id, tokens, chunks, levels, bytes")
    options.store(p)
    options.add_json(p, "the list of contexts")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("rm", help="remove one stored context (chunks shared with other contexts stay)")
    p.add_argument("id", help="a context id from `cachegen store ls` (at least its first 8 characters)")
    options.store(p)
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("stats", help="contexts, chunks, bytes and levels held")
    options.store(p)
    options.add_json(p, "the stats")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("evict", help="drop least recently used chunks down to a size (default: the store's cap)")
    options.store(p)
    p.add_argument(
        "--max-bytes",
        default=None,
        metavar="SIZE",
        help="keep at most this many payload bytes, e.g. 500M (default: the store's cap; Redis needs it)",
    )
    p.set_defaults(func=cmd_evict)

    p = sub.add_parser("clear", help="remove every chunk from the store")
    options.store(p)
    p.set_defaults(func=cmd_clear)
    return store


def _open(url):
    from cachegen.store.url import open_backend

    return open_backend(url, create=False)


def cmd_ls(args) -> int:
    from cachegen.store.catalog import list_contexts

    with _open(args.store) as b:
        rows = list_contexts(b)
        url = b.url
    write_json([r.to_json() for r in rows], args.json)
    if not rows:
        print(f"no contexts in {url}")
        return 0
    print(f"{'id':16}  {'tokens':>8}  {'chunks':>6}  {'levels':16}  {'bytes':>12}")
    for r in rows:
        levels = ",".join(map(str, r.levels)) or "-"
        note = "" if r.complete else "  (its first chunks were evicted)"
        print(f"{r.id[:16]}  {r.tokens:8d}  {r.chunks:6d}  {levels:16}  {r.bytes:12d}{note}")
    return 0


def cmd_rm(args) -> int:
    from cachegen.store.catalog import find_context, remove_context

    with _open(args.store) as b:
        context_id = find_context(b, args.id)[-1].key
        n = remove_context(b, args.id)
    print(f"removed context {context_id[:16]} ({n} chunks)")
    return 0


def cmd_stats(args) -> int:
    with _open(args.store) as b:
        s = b.stats().to_json()
    write_json(s, args.json)
    levels = ", ".join(f"L{l}: {v['chunks']} chunks {v['bytes']} B" for l, v in s["levels"].items()) or "none"
    print(f"contexts={s['contexts']} chunks={s['chunks']} bytes={s['bytes']} levels: {levels}")
    return 0


def cmd_evict(args) -> int:
    from cachegen.store.url import parse_size

    with _open(args.store) as b:
        n = b.evict(parse_size(args.max_bytes) if args.max_bytes else None)
        left = b.stats().bytes
    print(f"evicted {n} chunks; {left} bytes left")
    return 0


def cmd_clear(args) -> int:
    with _open(args.store) as b:
        n = b.clear()
    print(f"cleared {n} chunks")
    return 0


def cmd_ingest(args) -> int:
    from cachegen.cli import checks
    from cachegen.store.url import default_store_url, redact

    text = checks.text_file(args.file)
    levels = checks.levels(args.levels)
    checks.store(args.store)
    from cachegen.calibrate import load_or_calibrate
    from cachegen.engine.engine import Engine

    with Engine.open(args.model, args.store, args.chunk_tokens, levels, profile=load_or_calibrate) as eng:
        r = eng.ingest_text(text, progress=True)
    print(
        f"ingested {r.chunks} chunks, {r.tokens} tokens ({r.written} chunks written) into "
        f"{redact(args.store or default_store_url())}"
    )
    return 0
