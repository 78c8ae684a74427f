"""Where a command's results go: ``--json PATH`` writes a file, ``--json -`` writes JSON alone on stdout.

With ``--json -`` the CLI points ``sys.stdout`` at stderr while the command
runs (:func:`json_mode`), so tables, prints and progress all land on stderr
and :func:`write_json` is the only writer of the real stdout: a pipe into
``jq`` or ``json.load`` gets exactly one JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STDOUT = "-"

_real_stdout: Any = None  # the stdout saved by json_mode while it is active


def add_json(p: argparse.ArgumentParser, what: str = "the results") -> None:
    """The one ``--json`` option: a path, or ``-`` for stdout (everything else then goes to stderr)."""
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help=f"write {what} as JSON to PATH; '-' writes only JSON to stdout (other output to stderr)",
    )


@contextlib.contextmanager
def json_mode(dest: object) -> Iterator[None]:
    """While active with ``dest == '-'``, ``print`` goes to stderr and JSON to the real stdout."""
    global _real_stdout
    if str(dest) != STDOUT:
        yield
        return
    saved, _real_stdout = sys.stdout, sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout, _real_stdout = saved, None


def write_json(obj: Any, dest: str | Path | None) -> None:
    """Write ``obj`` to ``dest`` (a path, ``-`` for stdout, None for nowhere)."""
    if dest is None or dest == "":
        return
    text = json.dumps(obj, indent=1, default=str) + "\n"
    if str(dest) == STDOUT:
        out = _real_stdout if _real_stdout is not None else sys.stdout
        out.write(text)
        out.flush()
        return
    p = Path(dest)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
