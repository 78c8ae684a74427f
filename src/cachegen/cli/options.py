"""The options several commands share: one name, one meaning and one help text each.

``demo``, ``serve``, ``store`` and the ``bench`` commands call these instead of
spelling the flags themselves, so ``--store`` or ``--bandwidth-gbps`` means the
same thing everywhere. Each takes the command's default where they differ.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from cachegen.cli import checks
from cachegen.cli.output import add_json

DEFAULT_MODEL = "smollm2-135m"  # = cachegen.engine.models.DEFAULT_MODEL, without importing the engine
DEFAULT_CHUNK_TOKENS = 256  # = cachegen.store.keys.DEFAULT_CHUNK_TOKENS (checked by tests/cli)

__all__ = ["add_json", "bandwidth_gbps", "chunk_tokens", "context_tokens", "levels", "model", "slo_s", "store"]


def model(p: argparse.ArgumentParser, default: str = DEFAULT_MODEL) -> None:
    p.add_argument(
        "--model",
        default=default,
        metavar="NAME|DIR",
        help=f"smollm2-135m, gemma3-270m or a local Hugging Face model directory (default {default}); "
        "see `cachegen models`",
    )


def store(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="file://PATH, redis://HOST:PORT/DB or redis+cluster://HOST:PORT "
        "(default: the local store under $CACHEGEN_HOME/store)",
    )


def chunk_tokens(p: argparse.ArgumentParser, default: int = DEFAULT_CHUNK_TOKENS) -> None:
    p.add_argument(
        "--chunk-tokens",
        type=checks.positive_int,
        default=default,
        metavar="N",
        help=f"tokens per stored chunk (default {default}); a store keeps one chunk size",
    )


def levels(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--levels",
        type=checks.levels_arg,
        default=None,
        metavar="L,L,...",
        help="comma-separated quality levels, 1 (best) to 7 (smallest) (default: all)",
    )


def bandwidth_gbps(p: argparse.ArgumentParser, default: float = 0.1) -> None:
    p.add_argument(
        "--bandwidth-gbps",
        type=checks.positive_float,
        default=default,
        metavar="GBPS",
        help=f"bandwidth of the emulated link in Gbit/s (default {default} = {default * 1000:g} Mbit/s)",
    )


def bandwidths_gbps(p: argparse.ArgumentParser, default: Sequence[float]) -> None:
    """``--bandwidth-gbps`` for a command that sweeps several bandwidths."""
    p.add_argument(
        "--bandwidth-gbps",
        type=checks.positive_floats,
        default=list(default),
        metavar="GBPS,...",
        help=f"comma-separated link bandwidths in Gbit/s (default {','.join(map(str, default))})",
    )


def slo_s(p: argparse.ArgumentParser, default: float | None = 2.0) -> None:
    p.add_argument(
        "--slo-s",
        type=checks.positive_float,
        default=default,
        metavar="SECONDS",
        help="deadline for loading a context's KV, in seconds"
        + (f" (default {default})" if default is not None else " (default: none)"),
    )


def context_tokens(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument(
        "--context-tokens",
        type=checks.positive_int,
        default=default,
        metavar="N",
        help=f"tokens of context (default {default}); at most the model's positions",
    )
