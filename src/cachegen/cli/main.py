"""The ``cachegen`` command: one argparse tree, each group registered by its own module."""

from __future__ import annotations

import argparse
import os
import sys

from cachegen.errors import CachegenError


def build_parser() -> argparse.ArgumentParser:
    from cachegen.bench.cli import register as register_bench
    from cachegen.cli.demo import register as register_demo
    from cachegen.cli.models import register as register_models
    from cachegen.cli.serve import register as register_serve
    from cachegen.cli.store import register as register_store

    p = argparse.ArgumentParser(prog="cachegen", description="Compress, store and stream LLM KV caches.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_demo(sub)
    register_models(sub)
    register_store(sub)
    register_bench(sub)
    register_serve(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)  # commands return an exit status, or their rows (success)
        return rc if isinstance(rc, int) else 0
    except CachegenError as e:
        print(f"cachegen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
