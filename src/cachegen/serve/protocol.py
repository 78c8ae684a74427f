"""OpenAI request fields in, OpenAI response objects out.

Unknown fields are ignored, as OpenAI's API does; a known field of the
wrong type or out of range is a 400 that names it. ``n`` other than 1 is
refused (one answer per request). cachegen's own options ride in the
``cachegen`` field: ``slo_s``, ``use_cache``, ``store``, ``ignore_eos``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from cachegen.engine.completion import Completion, RequestOptions
from cachegen.engine.sampling import SamplingParams
from cachegen.errors import ConfigError
from cachegen.serve.errors import APIError


def _bad(param: str, what: str) -> APIError:
    return APIError(400, f"'{param}' must be {what}", "invalid_type", param)


def _int(body: dict, name: str, lo: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, "an integer")
    if lo is not None and v < lo:
        raise APIError(400, f"'{name}' must be at least {lo}", "invalid_value", name)
    return v


def _num(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, "a number")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "a boolean")
    return v


@dataclass
class ParsedRequest:
    kind: str  # "chat" or "completion"
    params: SamplingParams
    opts: RequestOptions
    stream: bool
    include_usage: bool
    model: str
    messages: Any = None  # chat: the raw messages
    prompt_text: str | None = None  # completion: text prompt
    prompt_ids: list[int] | None = None  # completion: token-id prompt


def parse(body: dict, kind: str, default_max_tokens: int, default_slo: float | None) -> ParsedRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "a string")
    n = _int(body, "n", 0)
    if n is not None and n != 1:
        raise APIError(400, "only n=1 is supported (one answer per request)", "unsupported_value", "n")
    max_tokens = _int(body, "max_completion_tokens", 1) if kind == "chat" else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    temperature = _num(body, "temperature")
    top_p = _num(body, "top_p")
    seed = _int(body, "seed")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad("stop", "a string or a list of strings")
    stream = _bool(body, "stream", False)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise _bad("stream_options", "an object")
    include_usage = _bool(so or {}, "include_usage", False)
    cg = body.get("cachegen")
    if cg is not None and not isinstance(cg, dict):
        raise _bad("cachegen", "an object")
    cg = cg or {}
    slo = _num(cg, "slo_s") if "slo_s" in cg else default_slo
    if slo is not None and slo <= 0:
        raise APIError(400, "'cachegen.slo_s' must be a positive number or null", "invalid_value", "cachegen.slo_s")
    opts = RequestOptions(slo_s=slo, use_cache=_bool(cg, "use_cache", True), store=_bool(cg, "store", True))
    try:
        params = SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else (default_max_tokens if kind == "chat" else 16),
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            seed=seed,
            stop=stops,
            ignore_eos=_bool(cg, "ignore_eos", False),
        )
    except ConfigError as e:
        raise APIError(400, str(e), "invalid_value") from None
    req = ParsedRequest(kind, params, opts, stream, include_usage, model or "")
    if kind == "chat":
        if "messages" not in body:
            raise APIError(400, "'messages' is required", "missing_field", "messages")
        req.messages = body["messages"]
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            req.prompt_text = p
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            req.prompt_ids = list(p)
        elif isinstance(p, list) and p and all(isinstance(t, (str, list)) for t in p):
            raise APIError(400, "only one prompt per request is supported", "unsupported_value", "prompt")
        else:
            raise _bad("prompt", "a string or a non-empty list of token ids")
    return req


def usage(run: Completion) -> dict:
    return {
        "prompt_tokens": len(run.prompt),
        "completion_tokens": len(run.token_ids),
        "total_tokens": len(run.prompt) + len(run.token_ids),
        "prompt_tokens_details": {"cached_tokens": run.cached_tokens},
    }


def finish_reason(run: Completion) -> str:
    return "length" if run.finish_reason == "length" else "stop"


class ResponseBuilder:
    """The response objects of one request (ids and timestamps shared by all chunks)."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, run: Completion) -> dict:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": run.text},
                "logprobs": None,
                "finish_reason": finish_reason(run),
            }
            out = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": run.text, "logprobs": None, "finish_reason": finish_reason(run)}
            out = self._head("text_completion")
        out.update(choices=[choice], usage=usage(run), cachegen=run.info())
        return out

    def chunk(self, text: str | None, *, first: bool = False, run: Completion | None = None) -> dict:
        """A streamed delta; with ``run``, the final chunk (finish_reason and cachegen's info)."""
        fin = finish_reason(run) if run is not None else None
        if self.kind == "chat":
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": fin}
            out = self._head("text_completion")
        out["choices"] = [choice]
        if run is not None:
            out["cachegen"] = run.info()
        return out

    def usage_chunk(self, run: Completion) -> dict:
        out = self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out.update(choices=[], usage=usage(run))
        return out
