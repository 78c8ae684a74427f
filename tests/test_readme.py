"""The README's Python snippet runs as written (only its store directory is moved to a temporary one)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
STORE = "file:///tmp/cachegen-readme"


def engine_snippet() -> str:
    """The README's Python snippet for the Engine (the one naming its example store)."""
    snippets = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    mine = [s for s in snippets if STORE in s]
    assert len(mine) == 1, "the README needs exactly one Python snippet using " + STORE
    return mine[0]


@pytest.mark.model
@pytest.mark.slow
def test_readme_python_snippet_runs(tmp_path):
    code = engine_snippet().replace(STORE, f"file://{tmp_path / 'store'}")
    # one machine-readable line after the snippet, from its own variables (its prints hold free text)
    code += "\nprint('CHOICES', out.cached_tokens, [d.choice for d in out.load.decisions], answer.cached_tokens)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"CHOICES (\d+) \[(.*)\] (\d+)", last)
    assert m, proc.stdout[-2000:]
    # generate() loaded the ingested chunks: some chunk came at a level, not all from text
    assert int(m.group(1)) > 0 and re.search(r"\d", m.group(2)), last
