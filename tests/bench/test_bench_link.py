"""The real shaped link (redis-server behind a tc-shaped veth in a namespace), where the machine allows it."""

from __future__ import annotations

import os
import time

import pytest

from cachegen.bench.link import NetnsRedisLink, netns_available
from cachegen.errors import ConfigError

ok, why = netns_available()
pytestmark = [pytest.mark.redis, pytest.mark.skipif(not ok, reason=why or "netns unavailable")]


def test_netns_link_shapes_and_cleans_up():
    data = os.urandom(1_500_000)
    with NetnsRedisLink() as link:
        ns = link.ns
        link.put("k", data)
        link.set_bandwidth(0.1)
        t = time.perf_counter()
        assert link.get("k") == data
        dt = time.perf_counter() - t
        # 12 Mbit at 100 Mbit/s: ~0.12 s plus framing; the burst is only 64 KB
        assert 0.09 < dt < 2.0
        link.set_bandwidth(10)
        t = time.perf_counter()
        assert link.get("k") == data
        assert time.perf_counter() - t < dt
        with pytest.raises(ConfigError):
            link.set_bandwidth(0)
    assert ns not in os.popen("ip netns list").read()
