"""Checks of a command's inputs, run before anything expensive (model load, prefill).

Each raises :class:`~cachegen.errors.ConfigError` (or ``StoreError``) with a
message that says what to do; the CLI prints it as one line with exit status 2.
The ``*_arg`` functions are argparse ``type=`` converters, so a malformed value
is rejected while parsing; the others need more than the text of an option
(a file, the model's config, a store) and run first thing in a command.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from cachegen.errors import ConfigError, StoreError

log = logging.getLogger(__name__)

MAX_TEXT_BYTES = 64 << 20  # more than any context a shipped model can take
# The codec's quality levels (cachegen.codec.LEVELS; a test keeps the two equal), here so that a bad
# --levels is refused without importing the codec, and with it torch and numba (seconds).
LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)


# -- argparse converters ----------------------------------------------------------


def levels_arg(text: str) -> tuple[int, ...]:
    """``"1,3,5"`` -> ``(1, 3, 5)``; the range is checked by :func:`levels`."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated level numbers such as 1,3,5, got {text!r}"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one level, e.g. --levels 1,3,5")
    return out


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a number above 0, got {n}")
    return n


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return x


def positive_floats(text: str) -> list[float]:
    """``"0.1,1,10"`` -> ``[0.1, 1.0, 10.0]``, each above 0."""
    try:
        out = [positive_float(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers above 0, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one number")
    return out


# -- checks that need more than the option's text ----------------------------------


def levels(chosen: Sequence[int] | None) -> tuple[int, ...] | None:
    """The chosen quality levels, each one the codec has (None: all of them)."""
    if chosen is None:
        return None
    bad = sorted(set(chosen) - set(LEVELS))
    if bad:
        raise ConfigError(
            f"unknown quality level(s) {', '.join(map(str, bad))}: choose from "
            f"{', '.join(map(str, LEVELS))} (1 = best quality, {max(LEVELS)} = smallest)"
        )
    return tuple(dict.fromkeys(chosen))


def text_file(path: str | Path) -> str:
    """The UTF-8 text of a file, refusing a missing, unreadable, binary or empty one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{p}: no such file; give the path of a UTF-8 text file")
    if p.is_dir():
        raise ConfigError(f"{p} is a directory; give the path of a UTF-8 text file")
    try:
        size = p.stat().st_size
        if size > MAX_TEXT_BYTES:
            raise ConfigError(f"{p} is {size >> 20} MiB; give a text file under {MAX_TEXT_BYTES >> 20} MiB")
        data = p.read_bytes()
    except PermissionError:
        raise ConfigError(f"{p}: permission denied; make the file readable") from None
    except OSError as e:
        raise ConfigError(f"cannot read {p}: {e.strerror or e}") from None
    if b"\x00" in data[:65536]:
        raise ConfigError(f"{p} looks binary (it contains NUL bytes); give a UTF-8 text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{p} is not UTF-8 text (bad byte at offset {e.start}); convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None
    if not text.strip():
        raise ConfigError(f"{p} is empty; give a file with some text")
    return text


def model_positions(model: str) -> int | None:
    """The model's context length from its config or GGUF header, without loading weights."""
    from cachegen.engine.models import model_positions as positions

    return positions(model)


def context_length(model: str, tokens: int, what: str = "the context") -> None:
    """Refuse ``tokens`` beyond the model's positions (a model name or directory also gets checked here)."""
    n = model_positions(model)
    if n is None:
        log.debug("context length of %s unknown; not checked", model)
        return
    if tokens > n:
        raise ConfigError(
            f"{what} has {tokens} tokens but {model} takes at most {n}; "
            "use a shorter text or a model with more positions"
        )


def count_tokens(model: str, text: str) -> int | None:
    """Tokens of ``text`` with the model's tokenizer alone (no weights), or None when only the weights have it.

    A shipped model not yet converted has its tokenizer inside the GGUF; the
    check then waits for the engine (still before any prefill).
    """
    from cachegen import paths
    from cachegen.engine.models import MODELS

    d = paths.home(create=False) / "models" / model if model in MODELS else Path(model).expanduser()
    if not (d / "tokenizer_config.json").is_file() and not (d / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer

    from cachegen.progress import quiet_transformers

    quiet_transformers()
    return len(AutoTokenizer.from_pretrained(d)(text)["input_ids"])


def store(url: str | None, timeout: float | None = 2.0) -> None:
    """Open the store and touch it once, so a wrong URL or a down server fails before the model loads."""
    from cachegen.errors import StoreUnavailable
    from cachegen.store.url import open_backend, redact

    try:
        with open_backend(url) as b:
            ping = getattr(b, "ping", None)
            if callable(ping):
                try:
                    ping(timeout=timeout)
                except TypeError:
                    ping()
            else:
                b.has("0" * 64)
    except StoreUnavailable as e:
        raise StoreUnavailable(redact(f"{str(e).rstrip('.')}; start the store or fix --store")) from None
    except (StoreError, ConfigError):
        raise
    except OSError as e:
        raise StoreError(redact(f"cannot reach the store {url}: {e}")) from None


def text_source(name: str) -> None:
    """A corpus name (``pydoc-eval``, ...) or a readable, non-empty UTF-8 text file."""
    from cachegen import corpus

    if name not in corpus.source_names():
        text_file(name)


def output_path(path: str | Path | None, what: str = "--json") -> None:
    """A results file that can be written later: checked first, so a long run never ends in a lost result."""
    if path is None or str(path) == "-":
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{what} {p} is a directory; give a file path")
    parent = p.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what} {p}: cannot create {parent} ({e.strerror or e}); choose another path") from None
    import os

    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{what} {p}: {parent} is not writable; choose another path")


def output_dir(path: str | Path, what: str = "--out") -> Path:
    """A directory for results, created now."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{what} {p} is a file; give a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{what} {p}: cannot create it ({e.strerror or e}); choose another directory") from None
    return p
