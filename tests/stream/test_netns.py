"""The real shaped link (root, ip netns, tc, redis-server). `make test` installs iproute2 and
redis-server and CI runs as root, so a machine without them fails here, saying what is missing."""

import time

import pytest

from cachegen.bench.netns import available

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _netns_link_available():
    ok, why = available()
    if not ok:
        pytest.fail(
            f"netns link unavailable: {why}. These tests need root, iproute2 (ip, tc) and redis-server: "
            "run `make system-deps` (or `apt-get install -y iproute2 redis-server`) and run the tests as root",
            pytrace=False,
        )


def test_netns_redis_rate_and_loader(tmp_path):
    from cachegen.bench.netns import NetnsLink, NetnsRedis
    from cachegen.store import ContextStore, Namespace, open_backend
    from cachegen.stream import LoaderOptions, StreamingLoader, step
    from stream.fakes import ToyCodec, ToyModel

    with NetnsRedis(gbps=1.0, port=6397) as n:
        model, codec = ToyModel(heads=4, head_dim=64), ToyCodec()
        tokens = list(range(4 * 64))
        kv = model.full(tokens, 64)
        store = ContextStore(open_backend(n.url), Namespace("toy", 1, "netns"), codec, chunk_tokens=64)
        store.put_context(tokens, kv, levels=[0])
        link = NetnsLink(n, step(4, before=1.0, after=0.01))  # 10 Mbit/s from chunk 2
        res = StreamingLoader(store, codec, model.recompute, LoaderOptions(policy=0), link=link).load(tokens)
        assert res.choices == [0] * 4 and not res.faults
        assert n.gbps == 0.01
        # the tc change took effect (chunk 2 partly rides on the tbf burst)
        assert res.decisions[3].measured_gbps < 0.03 < res.decisions[0].measured_gbps
        store.backend.close()


def test_netns_shapes_both_ways_and_cleans_up():
    import os

    import redis

    from cachegen.bench.netns import NetnsRedis
    from cachegen.errors import ConfigError

    data = os.urandom(1_500_000)
    with NetnsRedis(gbps=10.0, port=6398) as n:
        ns = n.ns
        r = redis.Redis.from_url(n.url.split("?")[0], socket_timeout=30)
        r.set("k", data)
        n.set_rate(0.1)
        t = time.perf_counter()
        assert r.get("k") == data
        slow = time.perf_counter() - t
        assert slow > 0.09  # 12 Mbit at 100 Mbit/s, less the tbf burst
        n.set_rate(10.0)
        t = time.perf_counter()
        assert r.get("k") == data
        assert time.perf_counter() - t < slow
        with pytest.raises(ConfigError):
            n.set_rate(0)
        r.close()
    assert ns not in os.popen("ip netns list").read()
