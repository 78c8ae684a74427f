"""Choose and open a backend from a URL.

* ``file:///ABS/PATH[?max_bytes=10G]`` — the embedded store (default under ``$CACHEGEN_HOME/store``);
  ``file:/ABS/PATH`` too, and ``file:REL/PATH`` (``file:./store``, ``file:~/store``), resolved against
  the current directory (or home) when the store opens. ``file://NAME/...`` is refused: ``NAME``
  would be a host, and the path would silently become ``/...``.
* ``redis://[:password@]HOST:PORT/DB[?timeout=0.5&ttl=3600&retries=0]``
* ``redis+cluster://HOST:PORT[?timeout=...&ttl=...]`` — any node of the cluster.
* ``mock://NAME[?latency=S&fail=P&missing=P&corrupt=P&seed=N]`` — in memory, with injected faults (tests).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qs, unquote, urlsplit

from cachegen import paths
from cachegen.errors import ConfigError
from cachegen.store.backend import Backend

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


_USERINFO = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<userinfo>[^/\s]*)@", re.I
)  # to the last @: a raw @ in a password
_SECRET_PARAM = re.compile(r"(?P<name>(?:password|passwd|pass|token|secret|api[_-]?key)=)[^&\s'\"]*", re.I)


def redact(text: str) -> str:
    """``text`` with the secrets of any URL in it masked: ``redis://:pw@h`` -> ``redis://***@h``.

    Applied to every URL, message and fault that leaves the library (errors, logs,
    responses, metrics), since store URLs may carry a password.
    """
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}***@", str(text))
    return _SECRET_PARAM.sub(lambda m: f"{m.group('name')}***", text)


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
        raise ConfigError(f"unknown store option(s) {redact(str(sorted(unknown)))}; allowed: {sorted(allowed)}")
    return opts


def _number(opts: dict, name: str, kind=float, positive: bool = False):
    if name not in opts:
        return None
    try:
        v = kind(opts[name])
    except ValueError:
        raise ConfigError(f"store option {name}={opts[name]!r} is not a number") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise ConfigError(f"store option {name}={opts[name]!r} is not a finite number")
    if positive and v <= 0:
        raise ConfigError(
            f"store option {name} must be more than 0 (got {opts[name]!r}): "
            "with no time to answer, every load would silently recompute"
        )
    if v < 0:
        raise ConfigError(f"store option {name} must not be negative")
    return v


def file_path(url: str) -> str:
    """The directory a ``file:`` URL names (relative paths stay relative: the store resolves them)."""
    u = urlsplit(url)
    if u.netloc not in ("", "localhost"):
        host = u.netloc.rpartition("@")[2]  # never echo a user or password
        raise ConfigError(
            f"{redact(url)!r} names host {host!r}, not a directory: write file:///ABSOLUTE/PATH "
            f"(three slashes) or file:./{host}{u.path} for a path relative to the current directory"
        )
    path = unquote(u.path)
    if not path:
        raise ConfigError(f"{redact(url)!r} names no directory: write file:///ABSOLUTE/PATH or file:./RELATIVE/PATH")
    return path


def open_backend(url: str | None = None, *, create: bool = True) -> Backend:
    """The backend a URL names (``None``: the default local store).

    ``create=False`` is for read-only commands: a local store that does not exist
    yet raises ``StoreError`` instead of being created."""
    url = url or default_store_url()
    u = urlsplit(url)
    scheme = u.scheme.lower()
    if scheme == "file":
        from cachegen.store.local import LocalBackend

        opts = _options(u.query, {"max_bytes"})
        path = file_path(url)
        return LocalBackend(
            path, max_bytes=parse_size(opts["max_bytes"]) if "max_bytes" in opts else None, create=create
        )
    if scheme in ("redis", "redis+cluster"):
        from cachegen.store.redis_backend import DEFAULT_TIMEOUT, RedisBackend

        cluster = scheme == "redis+cluster"
        opts = _options(u.query, {"timeout", "ttl", "retries"})
        try:
            host, port = u.hostname or "127.0.0.1", u.port or 6379
        except ValueError as e:
            raise ConfigError(f"bad address in {redact(url)!r}: {e}") from None
        db_part = u.path.strip("/")
        if cluster and db_part not in ("", "0"):
            raise ConfigError("Redis Cluster has only database 0")
        if db_part and not db_part.isdigit():
            raise ConfigError(f"bad Redis database {db_part!r} in {redact(url)!r}")
        timeout = _number(opts, "timeout", positive=True)
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
    if scheme == "mock":
        from cachegen.store.mock import Faults, MockBackend

        opts = _options(u.query, {"latency", "fail", "missing", "corrupt", "seed"})
        faults = {k: _number(opts, k) for k in ("latency", "fail", "missing", "corrupt") if k in opts}
        return MockBackend(u.netloc + u.path, Faults(**faults, seed=_number(opts, "seed", int) or 0))
    raise ConfigError(
        f"unknown store URL {redact(url)!r}: use file:///PATH, redis://HOST:PORT/DB or redis+cluster://HOST:PORT"
    )
