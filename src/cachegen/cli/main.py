"""The ``cachegen`` command: one argparse tree, each group registered by its own module.

What a person sees:

* a mistake of theirs (a bad option value, a missing or unreadable file, any
  :class:`~cachegen.errors.CachegenError`) is one line on stderr that says what
  to do, exit status 2;
* Ctrl-C is one line and exit status 130 (ingest resumes where it stopped);
* a closed pipe (``cachegen store stats | head -1``) ends the command quietly;
* anything else is a bug: the traceback, then a line that says so, status 1.

Registration is cheap: this module and the ``register`` functions import no
torch, transformers or numba; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from cachegen import __version__
from cachegen.allocator import keep_freed_memory
from cachegen.cli import output
from cachegen.errors import CachegenError

log = logging.getLogger(__name__)

EXIT_USAGE = 2  # a user's mistake
EXIT_BUG = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_PIPE = 141  # 128 + SIGPIPE, as a C tool killed by the closed pipe would report


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: what was wrong and where the help is."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _add_verbosity(p: argparse.ArgumentParser) -> None:
    """``-v``/``-q`` on ``p`` (skipping option strings the command already uses)."""
    taken = p._option_string_actions
    v = [s for s in ("-v", "--verbose") if s not in taken]
    q = [s for s in ("-q", "--quiet") if s not in taken]
    if v:
        p.add_argument(
            *v,
            dest="_verbose",
            action="count",
            default=argparse.SUPPRESS,
            help="show debug messages of cachegen's modules",
        )
    if q:
        p.add_argument(
            *q, dest="_quiet", action="store_true", default=argparse.SUPPRESS, help="show errors only, no progress bars"
        )


def _walk(p: argparse.ArgumentParser):
    yield p
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for child in dict.fromkeys(a.choices.values()):  # aliases map to the same parser
                yield from _walk(child)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command tree; ``argv`` lets lazily registered groups load only the command that runs."""
    from cachegen.cli.bench import register as register_bench
    from cachegen.cli.demo import register as register_demo
    from cachegen.cli.models import register as register_models
    from cachegen.cli.serve import register as register_serve
    from cachegen.cli.store import register as register_store

    p = Parser(prog="cachegen", description="Compress, store and stream LLM KV caches.")
    p.add_argument("--version", action="version", version=f"cachegen {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_demo(sub)
    register_models(sub)
    register_store(sub)
    register_bench(sub, argv=argv)
    register_serve(sub)
    for q in _walk(p):
        _add_verbosity(q)
    return p


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            return f"cachegen: {record.levelname.lower()}: {msg}"
        if record.levelno <= logging.DEBUG:
            return f"debug {record.name}: {msg}"
        return msg


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests and callers may swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(verbose: int = 0, quiet: bool = False) -> None:
    """One stderr handler on the root logger; cachegen's loggers at INFO (DEBUG with -v, ERROR with -q)."""
    from cachegen import progress

    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_cachegen", False):
            root.removeHandler(h)
    h = _StderrHandler(sys.stderr)
    h._cachegen = True  # type: ignore[attr-defined]
    h.setFormatter(_Formatter())
    root.addHandler(h)
    root.setLevel(logging.ERROR if quiet else logging.WARNING)
    logging.getLogger("cachegen").setLevel(logging.ERROR if quiet else logging.DEBUG if verbose else logging.INFO)
    logging.captureWarnings(True)
    progress.set_enabled(not quiet)


def _user_message(e: BaseException) -> str:
    from cachegen.store.url import redact

    if isinstance(e, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({e.reason} at byte {e.start}); give a UTF-8 text file"
    if isinstance(e, OSError) and e.filename is not None:
        return redact(f"{e.strerror or e}: {e.filename}")
    return redact(str(e) or type(e).__name__)


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())  # type: ignore[union-attr]
    except (OSError, AttributeError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # third-party tqdm bars that ignore transformers' switch (its GGUF conversion): off before tqdm is
    # imported; cachegen's own bars pass disable= explicitly and draw only on a terminal
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        keep_freed_memory()  # each load's cache reuses the last one's pages (cachegen/allocator.py)
        configure_logging(getattr(args, "_verbose", 0), getattr(args, "_quiet", False))
        with output.json_mode(getattr(args, "json", None)):
            rc = args.func(args)  # commands return an exit status, or their rows (success)
            sys.stdout.flush()
        sys.stdout.flush()
        return rc if isinstance(rc, int) else 0
    except KeyboardInterrupt:
        print("\ncachegen: interrupted; run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE
    except (CachegenError, OSError, UnicodeDecodeError) as e:
        print(f"cachegen: error: {_user_message(e)}", file=sys.stderr)
        log.debug("details", exc_info=True)
        return EXIT_USAGE
    except SystemExit:
        raise
    except BaseException:
        import traceback

        traceback.print_exc()
        print(
            f"cachegen {__version__}: internal error (a bug, not your mistake): please report it with the "
            "traceback above",
            file=sys.stderr,
        )
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
