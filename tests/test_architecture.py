"""The layers' imports point one way only (docs/architecture.md).

Every ``import`` in ``src/cachegen`` counts, the lazy ones inside functions and
the ``TYPE_CHECKING`` ones too: a dependency hidden in a function body is still
a dependency, and hiding a cycle that way is what this test exists to stop.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "cachegen"

# rank of each top-level module or package of cachegen: a module may import only
# from a lower rank or from inside its own package
LAYERS: dict[str, int] = {
    "errors": 0,
    "paths": 0,
    "allocator": 0,
    "kv": 1,
    "corpus": 1,
    "progress": 1,
    "codec": 2,
    "store": 3,
    "stream": 4,
    "engine": 5,
    "calibrate": 6,
    "serve": 7,
    "integrations": 7,
    "bench": 8,
    "cli": 9,
    "__main__": 10,
    "__init__": 10,
}

# third-party frameworks that belong to the layers on top, never to the core
TOP_ONLY = {"fastapi": 7, "uvicorn": 7, "prometheus_client": 7, "openai": 8, "vllm": 7, "matplotlib": 8}


def _unit(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path, rel: Path | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path`` (at ``rel`` under cachegen/)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    rel = rel or path.relative_to(SRC)
    pkg = ["cachegen", *rel.parent.parts]  # the package a relative import starts from
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            if mod == "cachegen":  # from cachegen import codec
                out += [(node.lineno, f"cachegen.{a.name}") for a in node.names]
    return out


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_top_level_unit_has_a_layer():
    units = {_unit(p) for p in _modules()}
    missing = units - set(LAYERS)
    assert not missing, f"give these a rank in LAYERS and docs/architecture.md: {sorted(missing)}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path):
    unit = _unit(path)
    rank = LAYERS[unit]
    wrong = []
    for line, mod in _imports(path):
        parts = mod.split(".")
        if parts[0] == "cachegen" and len(parts) > 1:
            target = parts[1]
            if target == unit:
                continue
            if target in LAYERS and LAYERS[target] >= rank:
                wrong.append(f"line {line}: {unit} (rank {rank}) imports {mod} (rank {LAYERS[target]})")
        elif parts[0] in TOP_ONLY and rank < TOP_ONLY[parts[0]]:
            wrong.append(f"line {line}: {unit} is below {parts[0]}'s layer")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path):
    """The oracle itself: a lazy import inside a function and a relative one are both found."""
    fake = tmp_path / "probe.py"
    src = "def f():\n    from cachegen.engine import engine\n\nfrom ..stream import loader\nfrom . import quant\n"
    fake.write_text(src, encoding="utf-8")
    mods = {m for _, m in _imports(fake, Path("codec") / "probe.py")}
    assert {"cachegen.engine", "cachegen.stream", "cachegen.codec"} <= mods
