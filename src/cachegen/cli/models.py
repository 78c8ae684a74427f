"""``cachegen models``: list the shipped models and prepare (convert) them."""

from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the models shipped as packages, or prepare one")
    p.add_argument("--prepare", metavar="NAME", help="convert NAME once, so later loads are fast")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cachegen.engine.models import MODELS, converted_dir, load_model
    from cachegen.errors import ModelNotFound

    if args.prepare:
        t = time.perf_counter()
        lm = load_model(args.prepare)
        print(f"{lm.name}: ready at {lm.path} (fingerprint {lm.fingerprint}) in {time.perf_counter() - t:.1f}s")
        return 0
    for name, spec in MODELS.items():
        try:
            spec.locate()
            state = "converted" if (converted_dir(name) / "config.json").exists() else "installed"
        except ModelNotFound:
            state = f"missing: {spec.install}"
        print(f"{name:14s} {state}")
    return 0
