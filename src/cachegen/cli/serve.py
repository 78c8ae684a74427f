"""``cachegen serve``: the engine behind a small HTTP/JSON API (see ``cachegen.engine.server``)."""

from __future__ import annotations

import argparse

from cachegen.engine.models import DEFAULT_MODEL


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve ingest and generate over HTTP/JSON")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--store", default=None, metavar="URL", help="store URL (default: the local store)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--slo", type=float, default=None, help="default load deadline in seconds")
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cachegen.engine.engine import Engine
    from cachegen.engine.server import CacheGenServer

    with Engine.open(args.model, args.store) as eng:
        eng.costs()
        srv = CacheGenServer(eng, args.host, args.port, default_slo_s=args.slo, verbose=args.verbose)
        print(f"cachegen serving {eng.lm.name} on {srv.url} (POST /ingest, POST /generate, GET /health, GET /stats)",
              flush=True)
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            srv.server_close()
    return 0
