"""Shared fixtures: the real models (loaded once per session) and a tiny random model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

# `make mutate` runs the tests with --hypothesis-profile=mutate ([tool.mutmut] in pyproject.toml): a
# mutant is killed by the first failing example, so hypothesis does not shrink it (shrinking re-runs
# the test many times per killed mutant), keeps no example database (no replay of failures found
# under other mutants) and has no deadline (forked runs share the cores). Explicit examples and the
# generated ones (same seed, same count) are unchanged, so the same mutants fail.
settings.register_profile("mutate", phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None, deadline=None)

# test helpers shared across folders import as packages under tests/ (e.g. ``from stream.fakes import ToyCodec``)
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    from cachegen.engine.models import load_model

    return load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def gemma3():
    from cachegen.engine.models import load_model

    return load_model("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def tiny_llama():
    """A 2-layer random llama with GQA, for fast unit tests."""
    from tiny_models import tiny_llama

    return tiny_llama()


# Real Redis servers (one, private ones, a 3-node cluster) and the store URLs every backend test and
# the loader's real-store tests run against: defined in tests/store/servers.py, registered here.
from store.servers import (  # noqa: E402
    any_url,
    cluster_url,
    redis_cluster,
    redis_factory,
    redis_server,
    redis_url,
)

__all__ = ["any_url", "cluster_url", "redis_cluster", "redis_factory", "redis_server", "redis_url"]
