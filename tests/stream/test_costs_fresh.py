"""Cached cost measurements are reused only where and while they hold (``costs.load_fresh``)."""

from __future__ import annotations

import json

import pytest

from cachegen.stream import costs as costs_mod
from cachegen.stream.costs import MAX_AGE_S, CostModel, load_fresh, machine_id, stamp


def _saved(tmp_path, **fields) -> tuple:
    cm = CostModel(decode_s_per_mvalue={3: 0.02}, recompute_s_per_token=4e-3, source="calibrated", **fields)
    path = tmp_path / "costs.json"
    cm.save(path)
    return cm, path


def test_a_recent_measurement_of_this_machine_is_reused(tmp_path):
    cm, path = _saved(tmp_path, machine=machine_id(), measured_at=1_000_000.0)
    got = load_fresh(path, now=1_000_000.0 + MAX_AGE_S - 1)
    assert got == cm and got.recompute_s_per_token == 4e-3 and got.decode_s_per_mvalue == {3: 0.02}


@pytest.mark.parametrize(
    "machine, age",
    [
        ("some other CPU x64", 10.0),  # measured on another kind of machine
        (None, MAX_AGE_S),  # exactly a week old: stale
        (None, MAX_AGE_S + 3600),
        (None, -3600.0),  # from the future (a clock set back): not trusted
    ],
)
def test_a_foreign_or_stale_measurement_is_taken_again(tmp_path, machine, age):
    _, path = _saved(tmp_path, machine=machine or machine_id(), measured_at=1_000_000.0)
    assert load_fresh(path, now=1_000_000.0 + age) is None


def test_files_written_before_the_stamp_existed_are_measured_again(tmp_path):
    path = tmp_path / "old.json"
    old = CostModel(source="calibrated").to_json()
    del old["machine"], old["measured_at"]
    path.write_text(json.dumps(old))
    assert CostModel.load(path).machine == ""  # still readable
    assert load_fresh(path) is None


def test_missing_or_unreadable_files_give_none(tmp_path):
    assert load_fresh(tmp_path / "none.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert load_fresh(tmp_path / "bad.json") is None


def test_stamp_then_save_round_trips(tmp_path):
    cm = stamp(CostModel(), now=123.0)
    assert cm.machine == machine_id() and cm.measured_at == 123.0
    cm.save(tmp_path / "c.json")
    assert load_fresh(tmp_path / "c.json", now=124.0) == cm


def test_machine_id_names_the_cpu_and_its_count(monkeypatch):
    monkeypatch.setattr(costs_mod.os, "cpu_count", lambda: 7)
    assert machine_id().endswith(" x7")
    monkeypatch.setattr(costs_mod.os, "cpu_count", lambda: 8)
    assert machine_id().endswith(" x8")


def test_load_or_measure_measures_once_then_reads_back(tmp_path):
    from cachegen.stream.costs import load_or_measure

    path, calls = tmp_path / "c.json", []

    def measure():
        calls.append(1)
        return CostModel(recompute_s_per_token=3e-3, source="calibrated")

    first = load_or_measure(path, measure)
    assert calls == [1] and first.machine == machine_id() and first.measured_at > 0
    assert load_fresh(path) == first
    assert load_or_measure(path, measure) == first and calls == [1]  # fresh: read back
    first.measured_at -= MAX_AGE_S
    first.save(path)
    again = load_or_measure(path, measure)  # stale: measured and stamped again
    assert calls == [1, 1] and load_fresh(path) == again
