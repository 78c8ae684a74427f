"""tools/mutate.py's bookkeeping: which mutants judged equivalent a run may skip, and what a row keeps for that.

A wrong skip would hide a mutant from the score, so the rules are pinned here: only listed names, only with
the hash their function had when they survived, never across mutmut versions, never with --rerun-equivalent.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EQ = "cachegen.store.keys.x_token_bytes__mutmut_34"  # listed in EQUIVALENT
OTHER = "cachegen.store.keys.x_token_bytes__mutmut_1"  # not listed


@pytest.fixture
def mt(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("mutate_tool", ROOT / "tools" / "mutate.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mutate_tool", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "RESULT", tmp_path / "mutation.json")
    assert EQ in mod.EQUIVALENT and OTHER not in mod.EQUIVALENT
    return mod


def _result(mt, hashes: dict[str, str], version: str | None = None) -> None:
    row = {"equivalent_hashes": hashes}
    mt.RESULT.write_text(json.dumps({"mutmut": version or mt._mutmut_version(), "modules": {"keys": row}}))


def _keys(mt):
    return next(m for m in mt.MODULES if m.name == "keys")


def test_known_equivalents_are_the_listed_ones_with_their_hashes(mt):
    _result(mt, {EQ: "h1", OTHER: "h2"})
    assert mt.known_equivalent(_keys(mt), rerun=False) == {EQ: "h1"}  # a name no longer listed runs again
    assert mt.known_equivalent(_keys(mt), rerun=True) == {}
    other = next(m for m in mt.MODULES if m.name == "codec")
    assert mt.known_equivalent(other, rerun=False) == {}  # another module's row


def test_nothing_is_skipped_without_a_result_or_across_mutmut_versions(mt):
    assert mt.known_equivalent(_keys(mt), rerun=False) == {}  # no mutation.json
    _result(mt, {EQ: "h1"}, version="0.0.1")
    assert mt.known_equivalent(_keys(mt), rerun=False) == {}


def test_a_row_keeps_the_hashes_of_its_equivalent_survivors_only(mt, tmp_path):
    work = tmp_path / "work"
    meta = work / "mutants" / "src" / "cachegen" / "store" / "keys.py.meta"
    meta.parent.mkdir(parents=True)
    killed = "cachegen.store.keys.x_chunk_keys__mutmut_3"
    meta.write_text(
        json.dumps(
            {
                "exit_code_by_key": {EQ: 0, OTHER: 0, killed: 1},
                "hash_by_function_name": {"x_token_bytes": "abc", "x_chunk_keys": "def"},
            }
        )
    )
    row = mt.collect(_keys(mt), work)
    assert row["equivalent_hashes"] == {EQ: "abc"}
    assert row["survivors"] == [OTHER] and row["equivalent_mutants"] == [EQ]
    assert (row["total"], row["killed"], row["survived"], row["equivalent"]) == (3, 1, 2, 1)
    assert row["score"] == 0.5  # one killed of the two that are not equivalent
