"""Store fixtures: a tiny deterministic codec and local stores (the real Redis servers are in
``servers.py``, registered for every test folder by ``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import NS, RawEncoder, make_kv


@pytest.fixture
def encoder():
    return RawEncoder()


@pytest.fixture
def kv_factory():
    return make_kv


@pytest.fixture
def namespace():
    return NS


@pytest.fixture
def store_dir(tmp_path) -> Path:
    return tmp_path / "store"
