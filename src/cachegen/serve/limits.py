"""Limits checked before any model work: body size, read time, JSON depth.

A nested JSON document is measured *before* it is parsed: ``json.loads`` on
200,000 nested brackets raises RecursionError deep in the parser, so the depth
is counted over the raw bytes (strings blanked out first) with numpy.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import numpy as np
from starlette.requests import ClientDisconnect, Request

from cachegen.serve.errors import APIError

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (JSON text), without parsing it."""
    stripped = _STRING.sub(b'""', raw)
    if not stripped:
        return 0
    steps = _OPEN[np.frombuffer(stripped, dtype=np.uint8)].astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, or a 400 (too large) / 408 (too slow) before it is all in memory."""
    n = request.headers.get("content-length")
    if n is not None:
        if not n.isdigit():
            raise APIError(400, "bad Content-Length header", "bad_request")
        if int(n) > max_bytes:
            raise APIError(
                400, f"the request body of {int(n)} bytes exceeds the limit of {max_bytes} bytes", "body_too_large"
            )
    deadline = time.monotonic() + timeout_s
    parts: list[bytes] = []
    size = 0
    it = request.stream().__aiter__()
    while True:
        left = deadline - time.monotonic()
        try:
            chunk = await asyncio.wait_for(it.__anext__(), timeout=max(left, 0.001))
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", "read_timeout") from None
        except ClientDisconnect:
            raise APIError(400, "the client disconnected while sending the body", "client_disconnect") from None
        size += len(chunk)
        if size > max_bytes:
            raise APIError(400, f"the request body exceeds the limit of {max_bytes} bytes", "body_too_large")
        parts.append(chunk)
    return b"".join(parts)


def parse_json(raw: bytes, max_depth: int) -> dict:
    """The JSON object in ``raw``; 400 for an empty, invalid, too deep or non-object body."""
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object", "invalid_json")
    depth = json_depth(raw)
    if depth > max_depth:
        raise APIError(400, f"the JSON body is nested {depth} levels deep; the limit is {max_depth}", "json_too_deep")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"invalid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the JSON body must be an object", "invalid_json")
    return body
