"""``cachegen models``: list the shipped models (reading metadata only), or prepare (convert) one."""

from __future__ import annotations

import argparse
import logging
import time

from cachegen.cli import checks, options
from cachegen.cli.output import write_json

log = logging.getLogger(__name__)

COLS = ("name", "package", "installed", "converted", "positions")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the models shipped as packages, or prepare one")
    p.add_argument("--prepare", metavar="NAME", help="convert NAME once, so later loads are fast")
    options.add_json(p, "the list")
    p.set_defaults(func=run)


def rows() -> list[dict]:
    """One row per shipped model: its package, whether it is installed and converted, its positions.

    Reads package metadata, the converted copy's manifest and the GGUF header;
    never converts, assembles or copies a model.
    """
    import importlib.metadata as md

    from cachegen.engine.models import MODELS, converted, model_positions
    from cachegen.errors import ModelNotFound

    out = []
    for name, spec in MODELS.items():
        try:
            version = md.version(spec.package)
        except md.PackageNotFoundError:
            version = None
        try:
            installed = version is not None and all(p.is_file() for p in spec.parts())
        except ModelNotFound:
            installed = False
        out.append(
            {
                "name": name,
                "package": spec.package + (f"=={version}" if version else ""),
                "installed": installed,
                "converted": converted(name),
                "positions": model_positions(name) if installed else None,
                "install": None if installed else spec.install,
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    checks.output_path(args.json)
    if args.prepare:
        from cachegen.engine.models import load_model

        t = time.perf_counter()
        lm = load_model(args.prepare)
        res = {
            "name": lm.name,
            "path": str(lm.path),
            "fingerprint": lm.fingerprint,
            "seconds": round(time.perf_counter() - t, 2),
        }
        print(f"{lm.name}: ready at {lm.path} (fingerprint {lm.fingerprint}) in {res['seconds']:.1f}s")
        write_json(res, args.json)
        return 0
    from cachegen.bench.plots import table

    rs = rows()
    shown = [
        {
            **r,
            "installed": "yes" if r["installed"] else f"no: {r['install']}",
            "converted": "yes" if r["converted"] else "no",
            "positions": r["positions"] or "?",
        }
        for r in rs
    ]
    print(table(shown, COLS))
    write_json(rs, args.json)
    return 0
