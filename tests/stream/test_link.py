import itertools
import json
import threading
import time

import pytest

from cachegen.errors import ConfigError
from cachegen.stream.link import ThrottledLink, Trace, constant, load_trace_file, make_trace, random_trace, step


class Ref:
    def __init__(self, index):
        self.index = index


def test_traces():
    assert constant(2.0).gbps_at(7) == 2.0
    s = step(8)
    assert s.gbps_at(3) == 1.0 and s.gbps_at(4) == 0.1
    r1, r2 = random_trace(16, seed=1), random_trace(16, seed=1)
    assert r1.points == r2.points and all(0.1 <= g <= 10 for _, g in r1.points)
    assert make_trace("constant:0.5", 4).gbps_at(0) == 0.5
    with pytest.raises(ConfigError):
        make_trace("nope", 4)


def test_time_trace_transfer_integrates():
    t = Trace([(0, 1.0), (1.0, 0.5)], by="time")
    # 0.5 s at 1 Gbps moves 0.5 Gbit; the remaining 0.5 Gbit at 0.5 Gbps takes 1 s more
    assert t.transfer_s(0.5, 1e9) == pytest.approx(1.5)


def test_trace_files(tmp_path):
    j = tmp_path / "t.json"
    j.write_text(json.dumps({"by": "chunk", "points": [[0, 1], [3, 0.2]]}))
    assert load_trace_file(j).by == "chunk" and load_trace_file(j).gbps_at(5) == 0.2
    c = tmp_path / "t.csv"
    c.write_text("time_s,gbps\n0,1\n0.5,0.1\n")
    t = load_trace_file(c)
    assert t.by == "time" and t.gbps_at(0.7) == 0.1
    c2 = tmp_path / "c.csv"
    c2.write_text("chunk,gbps\n0,5\n2,0.5\n")
    assert load_trace_file(c2).by == "chunk"


def test_throttled_link_serializes_transfers():
    link = ThrottledLink(constant(0.008))  # 1 MB/s
    link.begin()
    get = lambda ref, level: b"x" * 20_000  # 20 ms each
    t = time.perf_counter()
    ths = [threading.Thread(target=link.fetch, args=(get, Ref(i), 0)) for i in range(3)]
    [th.start() for th in ths]
    [th.join() for th in ths]
    assert time.perf_counter() - t >= 0.058
    spans = sorted((s, e) for _, _, s, e in link.log)
    assert all(b[0] >= a[1] - 1e-9 for a, b in itertools.pairwise(spans))
