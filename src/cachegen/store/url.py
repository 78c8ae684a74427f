"""Choose and open a backend from a URL.

* ``file://PATH[?max_bytes=10G]`` — the embedded store (default under ``$CACHEGEN_HOME/store``).
* ``redis://[:password@]HOST:PORT/DB[?timeout=0.5&ttl=3600&retries=0]``
* ``redis+cluster://HOST:PORT[?timeout=...&ttl=...]`` — any node of the cluster.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs, unquote, urlsplit

from cachegen import paths
from cachegen.errors import ConfigError
from cachegen.store.backend import Backend

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def default_store_url() -> str:
    return f"file://{paths.home() / 'store'}"


def parse_size(text: str) -> int:
    """``1048576``, ``512M``, ``10G``, ``1.5GiB`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text), re.I)
    if not m:
        raise ConfigError(f"bad size {text!r}: use bytes or a number with K, M, G or T")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"size must be positive, got {text!r}")
    return n


def _options(query: str, allowed: set[str]) -> dict[str, str]:
    opts = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = set(opts) - allowed
    if unknown:
        raise ConfigError(f"unknown store option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return opts


def _number(opts: dict, name: str, kind=float):
    if name not in opts:
        return None
    try:
        v = kind(opts[name])
    except ValueError:
        raise ConfigError(f"store option {name}={opts[name]!r} is not a number") from None
    if v < 0:
        raise ConfigError(f"store option {name} must not be negative")
    return v


def open_backend(url: str | None = None) -> Backend:
    """The backend a URL names (``None``: the default local store)."""
    url = url or default_store_url()
    u = urlsplit(url)
    scheme = u.scheme.lower()
    if scheme == "file":
        from cachegen.store.local import LocalBackend

        opts = _options(u.query, {"max_bytes"})
        path = unquote(u.netloc + u.path)
        if not path:
            raise ConfigError(f"{url!r} names no directory")
        return LocalBackend(path, max_bytes=parse_size(opts["max_bytes"]) if "max_bytes" in opts else None)
    if scheme in ("redis", "redis+cluster"):
        from cachegen.store.redis_backend import DEFAULT_TIMEOUT, RedisBackend

        cluster = scheme == "redis+cluster"
        opts = _options(u.query, {"timeout", "ttl", "retries"})
        try:
            host, port = u.hostname or "127.0.0.1", u.port or 6379
        except ValueError as e:
            raise ConfigError(f"bad address in {url!r}: {e}") from None
        db_part = u.path.strip("/")
        if cluster and db_part not in ("", "0"):
            raise ConfigError("Redis Cluster has only database 0")
        if db_part and not db_part.isdigit():
            raise ConfigError(f"bad Redis database {db_part!r} in {url!r}")
        timeout = _number(opts, "timeout")
        return RedisBackend(
            host,
            port,
            int(db_part or 0),
            cluster=cluster,
            password=unquote(u.password) if u.password else None,
            timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
            ttl=_number(opts, "ttl", int) or None,
            retries=_number(opts, "retries", int) or 0,
            url=url,
        )
    raise ConfigError(f"unknown store URL {url!r}: use file://PATH, redis://HOST:PORT/DB or redis+cluster://HOST:PORT")
