"""The README's Python snippet runs as written (only its store directory is moved to a temporary one)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
STORE = "file:///tmp/cachegen-readme"


def python_snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_one_python_snippet_with_its_store():
    snippets = python_snippets()
    assert len(snippets) == 1 and STORE in snippets[0]


@pytest.mark.model
@pytest.mark.slow
def test_readme_python_snippet_runs(tmp_path):
    code = python_snippets()[0].replace(STORE, f"file://{tmp_path / 'store'}")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) >= 2, proc.stdout
    # generate() loaded ingested chunks: its per-chunk choices include a level, not only "text"
    assert re.search(r"\[[^\]]*\d[^\]]*\]\s*$", lines[0]), lines[0]
