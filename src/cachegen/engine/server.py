"""A small HTTP/JSON server around one :class:`~cachegen.engine.engine.Engine`.

Endpoints (JSON in, JSON out):

* ``GET  /health`` -> ``{"ok": true, "model": ..., "store": ...}``
* ``GET  /stats`` -> the store's stats (contexts, chunks, bytes, levels)
* ``POST /ingest``  ``{"text": str}`` or ``{"tokens": [int]}`` -> chunks, tokens, written
* ``POST /generate`` ``{"context": str | "context_tokens": [int], "question": str | "question_tokens": [int],
  "max_new_tokens": int, "slo_s": float | null, "use_cache": bool}`` -> text, ttft_s, cached_tokens, levels

The model runs one request at a time (a lock): on a CPU, concurrent forward
passes only slow each other down. Bad requests get a 400 with the reason;
store faults never reach the client, since the loader recomputes instead.
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cachegen.errors import CachegenError, ConfigError

MAX_BODY = 16 << 20  # 16 MiB of JSON is far beyond any context this serves


def _tokens(body: dict, text_key: str, tok_key: str, tokenizer, special: bool) -> list[int]:
    if tok_key in body:
        ids = body[tok_key]
        if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < 2**31 for i in ids):
            raise ConfigError(f"{tok_key} must be a list of non-negative integers")
        return ids
    if isinstance(body.get(text_key), str):
        return tokenizer(body[text_key], add_special_tokens=special)["input_ids"]
    raise ConfigError(f"give {text_key!r} (a string) or {tok_key!r} (token ids)")


class _Handler(BaseHTTPRequestHandler):
    server: "CacheGenServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args) -> None:  # quiet by default
        if self.server.verbose:
            super().log_message(fmt, *args)

    def _send(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ConfigError("bad Content-Length") from None
        if n <= 0 or n > MAX_BODY:
            raise ConfigError(f"request body must be 1..{MAX_BODY} bytes of JSON")
        try:
            body = json.loads(self.rfile.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ConfigError(f"invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ConfigError("the JSON body must be an object")
        return body

    def do_GET(self) -> None:
        eng = self.server.engine
        if self.path == "/health":
            self._send(200, {"ok": True, "model": eng.lm.name, "store": getattr(eng.store.backend, "url", "")})
        elif self.path == "/stats":
            self._send(200, eng.store.backend.stats().to_json())
        else:
            self._send(404, {"error": f"no such endpoint {self.path}"})

    def do_POST(self) -> None:
        try:
            body = self._body()
            if self.path == "/ingest":
                out = self._ingest(body)
            elif self.path == "/generate":
                out = self._generate(body)
            else:
                self._send(404, {"error": f"no such endpoint {self.path}"})
                return
            self._send(200, out)
        except ConfigError as e:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(e)})
        except CachegenError as e:
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(e)})

    def _ingest(self, body: dict) -> dict:
        eng = self.server.engine
        ids = _tokens(body, "text", "tokens", eng.tokenizer, special=True)
        with self.server.lock:
            r = eng.ingest(ids)
        return {"chunks": r.chunks, "tokens": r.tokens, "written": r.written}

    def _generate(self, body: dict) -> dict:
        eng = self.server.engine
        ctx = _tokens(body, "context", "context_tokens", eng.tokenizer, special=True)
        q = _tokens(body, "question", "question_tokens", eng.tokenizer, special=False)
        max_new = body.get("max_new_tokens", 32)
        slo = body.get("slo_s", self.server.default_slo_s)
        if not isinstance(max_new, int) or not 1 <= max_new <= 4096:
            raise ConfigError("max_new_tokens must be an integer in 1..4096")
        if slo is not None and (not isinstance(slo, (int, float)) or slo <= 0):
            raise ConfigError("slo_s must be a positive number or null")
        with self.server.lock:
            g = eng.generate(ctx, q, max_new_tokens=max_new, use_cache=bool(body.get("use_cache", True)), slo_s=slo)
        levels = [d.choice for d in g.load.decisions] if g.load is not None else []
        return {"text": g.text, "token_ids": g.token_ids, "ttft_s": g.ttft_s, "cached_tokens": g.cached_tokens,
                "levels": levels, "faults": list(g.load.faults) if g.load is not None else []}


class CacheGenServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 8080, default_slo_s: float | None = None,
                 verbose: bool = False):
        super().__init__((host, port), _Handler)
        self.engine, self.default_slo_s, self.verbose = engine, default_slo_s, verbose
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def serve_in_thread(server: CacheGenServer) -> threading.Thread:
    th = threading.Thread(target=server.serve_forever, name="cachegen-server", daemon=True)
    th.start()
    return th
