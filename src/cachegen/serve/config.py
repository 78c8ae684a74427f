"""The server's settings (each has a ``cachegen serve`` flag and a ``CACHEGEN_*`` variable)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeConfig:
    model_name: str = "cachegen"
    api_key: str | None = None  # when set, every /v1 and /metrics request needs "Authorization: Bearer <key>"
    max_queue: int = 16  # requests waiting for the model beyond the one running; more get a 429
    max_body_bytes: int = 2 << 20  # a context of the model's 8k positions is ~50 KB of JSON
    max_json_depth: int = 64
    read_timeout_s: float = 30.0  # the whole request body must arrive within this
    default_max_tokens: int = 256  # chat requests without max_tokens (completions default to 16, as OpenAI)
    slo_s: float | None = None  # default load deadline
    retry_after_s: int = 1
