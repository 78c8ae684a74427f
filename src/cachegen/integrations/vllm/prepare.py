"""Make a model ready for the vLLM connector, in cachegen's own environment.

    python -m cachegen.integrations.vllm.prepare smollm2-135m      # or a local model directory

Converts a shipped model to safetensors (vLLM loads that directory) and calibrates
its codec profile once (cachegen's calibration needs the transformers version of
cachegen's environment, newer than the one vLLM pins). Prints the directory to pass
to vLLM as ``model``.
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger(__name__)


def prepare(model: str) -> tuple[str, str, str]:
    """(model directory, fingerprint, profile id) of ``model``, converting and calibrating it if needed."""
    from cachegen.calibrate import load_or_calibrate
    from cachegen.engine.models import load_model

    lm = load_model(model, progress=False)
    prof = load_or_calibrate(lm)
    return str(lm.path), lm.fingerprint, prof.id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cachegen.integrations.vllm.prepare", description=__doc__.split("\n")[0]
    )
    ap.add_argument("model", nargs="?", default="smollm2-135m", help="a shipped model name or a local model directory")
    args = ap.parse_args(argv)
    from cachegen.errors import CachegenError

    try:
        d, fp, pid = prepare(args.model)
    except CachegenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{d}\tfingerprint {fp}\tprofile {pid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
