"""``cachegen serve``: the OpenAI-compatible server (see :mod:`cachegen.serve`).

Every flag also reads a ``CACHEGEN_<FLAG>`` environment variable (``--api-key``:
``CACHEGEN_API_KEY``); a flag given on the command line wins. The port, the
levels and the store are checked before the model loads.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from cachegen.cli import checks, options
from cachegen.errors import ConfigError

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (/v1/chat/completions, /v1/completions) "
        "that reuses stored contexts automatically",
        description="Serve the model over OpenAI's API. Every flag can also be set with the "
        "environment variable CACHEGEN_<FLAG> (e.g. CACHEGEN_API_KEY, CACHEGEN_PORT).",
    )
    options.model(p)
    options.store(p)
    options.chunk_tokens(p)
    options.levels(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8080, help="TCP port (default 8080)")
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 and /metrics (default: no key)",
    )
    for flag, conv, default, metavar, help_ in _TUNING:
        p.add_argument(flag, type=conv, default=default, metavar=metavar, help=help_)
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="the model's compute dtype (default auto: bfloat16 on a CPU with AVX512-BF16 or AMX, else float32, "
        "several times faster there; each dtype has its own chunks in the store)",
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    _env_defaults(p)
    p.set_defaults(func=run)


def _non_negative(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {n}")
    return n


# The deadline and the server's limits: (flag, type, default, metavar, help).
_TUNING = (
    (
        "--slo-s",
        checks.positive_float,
        None,
        "SECONDS",
        "default deadline for loading a prompt's stored prefix (default: none, best quality); "
        "a request overrides it with cachegen.slo_s",
    ),
    ("--max-queue", _non_negative, 16, "N", "requests that may wait for the model; more get 429 (default 16)"),
    (
        "--max-tokens",
        checks.positive_int,
        256,
        "N",
        "answer length of a chat request that sets no max_tokens (default 256)",
    ),
    ("--max-body-bytes", checks.positive_int, 2 << 20, "N", "largest request body (default 2 MiB)"),
    ("--max-json-depth", checks.positive_int, 64, "N", "deepest JSON nesting accepted (default 64)"),
    ("--read-timeout-s", checks.positive_float, 30.0, "SECONDS", "a request body must arrive within this (default 30)"),
    (
        "--keep-alive-s",
        checks.positive_float,
        5.0,
        "SECONDS",
        "idle keep-alive connections close after this (default 5)",
    ),
    ("--max-connections", checks.positive_int, 256, "N", "open connections beyond this get 503 (default 256)"),
    (
        "--max-pending-writes",
        checks.positive_int,
        8,
        "N",
        "background store writes that may wait; more are dropped and counted (default 8)",
    ),
)


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {n}")
    return n


def _env_defaults(p: argparse.ArgumentParser) -> None:
    """Defaults from ``CACHEGEN_<DEST>``: argparse runs a string default through the option's type."""
    for a in p._actions:
        if not a.option_strings or a.dest in ("help", "verbose", "quiet"):
            continue
        env = os.environ.get("CACHEGEN_" + a.dest.upper())
        if env is None:
            continue
        if isinstance(a, argparse._StoreTrueAction):
            a.default = env.strip().lower() in _TRUE
        else:
            a.default = env


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (a busy port fails in a second, not after it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno in (98, 48):  # EADDRINUSE on Linux, macOS
            raise ConfigError(f"port {port} on {host} is in use: stop what holds it or pick another --port") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    levels = checks.levels(args.levels)
    sock = bind(args.host, args.port)
    try:
        checks.store(args.store)
        import uvicorn

        from cachegen.calibrate import load_or_calibrate
        from cachegen.engine.engine import Engine
        from cachegen.serve import ServeConfig, create_app

        with Engine.open(
            args.model,
            args.store,
            args.chunk_tokens,
            levels,
            progress=False,
            dtype=args.dtype,
            profile=load_or_calibrate,
        ) as eng:
            eng.writer.max_pending = args.max_pending_writes
            eng.costs()  # measured here (cached for a week): not on the first request's clock
            cfg = ServeConfig(
                model_name=eng.lm.name,
                api_key=args.api_key or None,
                max_queue=args.max_queue,
                max_body_bytes=args.max_body_bytes,
                max_json_depth=args.max_json_depth,
                read_timeout_s=args.read_timeout_s,
                default_max_tokens=args.max_tokens,
                slo_s=args.slo_s,
            )
            app = create_app(eng, cfg)
            host, port = sock.getsockname()[:2]
            print(
                f"cachegen serving {eng.lm.name} on http://{host}:{port}/v1 "
                f"({'API key required' if cfg.api_key else 'no API key'})",
                flush=True,
            )
            server = uvicorn.Server(
                uvicorn.Config(
                    app,
                    log_level="info" if args.access_log else "warning",
                    access_log=args.access_log,
                    timeout_keep_alive=int(max(args.keep_alive_s, 1)),
                    limit_concurrency=args.max_connections,
                    h11_max_incomplete_event_size=64 * 1024,
                    lifespan="on",
                )
            )
            server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
