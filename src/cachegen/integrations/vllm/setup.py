"""What a connector needs besides vLLM: its config, the codec profile, the store and its namespace.

No vLLM import here, so cachegen's own environment can prepare a model for the
connector (:mod:`cachegen.integrations.vllm.prepare`) and tests can build the
same store and namespace the connector uses.

The profile is calibrated by cachegen's transformers engine, which needs a newer
transformers than vLLM pins; so the connector reads the cached profile and, when
it is missing, says the one command that makes it instead of calibrating inside
vLLM's start-up.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cachegen import codec as codec_mod
from cachegen.errors import ConfigError
from cachegen.store import DEFAULT_CHUNK_TOKENS, ContextStore, Namespace, default_store_url, open_backend
from cachegen.store.url import redact
from cachegen.stream import ADAPTIVE, RULE, CostModel
from cachegen.stream import costs as costs_mod

log = logging.getLogger(__name__)

ENGINE = "vllm"  # names the producing engine in the namespace: vLLM's KV never mixes with transformers'


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, checked."""

    store: str = field(default_factory=default_store_url)
    levels: tuple[int, ...] | None = None  # None: every level of the profile
    policy: str | int = ADAPTIVE
    slo_s: float = 1.0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    lookup_timeout_s: float = 0.5
    save_queue: int = 64

    KEYS = ("store", "levels", "policy", "slo_s", "chunk_tokens", "lookup_timeout_s", "save_queue")

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}: use {', '.join(cls.KEYS)}")
        kw: dict[str, Any] = {}
        try:
            if extra.get("store"):
                kw["store"] = str(extra["store"])
            if extra.get("levels") is not None:
                kw["levels"] = tuple(int(l) for l in extra["levels"])
            if "policy" in extra:
                p = extra["policy"]
                kw["policy"] = p if p in (ADAPTIVE, RULE, costs_mod.TEXT) else int(p)
            for name, typ in (
                ("slo_s", float),
                ("lookup_timeout_s", float),
                ("chunk_tokens", int),
                ("save_queue", int),
            ):
                if name in extra:
                    kw[name] = typ(extra[name])
        except (TypeError, ValueError) as e:
            raise ConfigError(f"bad kv_connector_extra_config: {e}") from None
        cfg = cls(**kw)
        if cfg.slo_s <= 0 or cfg.lookup_timeout_s <= 0 or cfg.chunk_tokens <= 0 or cfg.save_queue <= 0:
            raise ConfigError("slo_s, lookup_timeout_s, chunk_tokens and save_queue must be positive")
        return cfg


def model_fingerprint(model_dir: str | Path) -> str:
    """The fingerprint cachegen's engine gives the same weights (config and sampled weight hashes)."""
    from cachegen.engine.models import _fingerprint_dir

    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise ConfigError(f"CacheGenConnector needs a local model directory, not {model_dir!r}")
    return _fingerprint_dir(d)


def namespace(fingerprint: str, dtype: torch.dtype, profile_id: str) -> Namespace:
    return Namespace(
        f"{fingerprint}-{ENGINE}-{str(dtype).removeprefix('torch.')}", codec_mod.FORMAT_VERSION, profile_id
    )


def load_profile(model_dir: str | Path, fingerprint: str) -> codec_mod.Profile:
    from cachegen.calibrate.profiles import profile_path

    p = profile_path(fingerprint)
    try:
        prof = codec_mod.Profile.load(p)
    except FileNotFoundError:
        raise ConfigError(
            f"no cachegen codec profile for the model in {model_dir} yet; make it once with "
            f"cachegen's own environment: python -m cachegen.integrations.vllm.prepare {model_dir}"
        ) from None
    except Exception as e:  # a damaged profile, whatever is wrong with it: the same fix
        raise ConfigError(
            f"the cachegen profile {p} is unreadable ({e}); remake it with "
            f"python -m cachegen.integrations.vllm.prepare {model_dir}"
        ) from None
    if prof.model_fingerprint != fingerprint:
        raise ConfigError(
            f"the cachegen profile {p} is for another model; remake it with "
            f"python -m cachegen.integrations.vllm.prepare {model_dir}"
        )
    return prof


@dataclass
class StoreSetup:
    """The codec, the store (one backend per thread that uses it) and the levels of one connector."""

    url: str
    namespace: Namespace
    codec: codec_mod.Codec
    chunk_tokens: int
    levels: tuple[int, ...]
    costs: CostModel
    store: ContextStore
    _save_store: ContextStore | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def open_store(self) -> ContextStore:
        return ContextStore(open_backend(self.url), self.namespace, self.codec, self.chunk_tokens, levels=self.levels)

    def save_store(self) -> ContextStore:
        """The saver thread's own store (a backend is not shared between threads)."""
        with self._lock:
            if self._save_store is None:
                self._save_store = self.open_store()
            return self._save_store

    def close(self) -> None:
        for s in (self.store, self._save_store):
            if s is not None:
                s.backend.close()


def open_setup(model_dir: str | Path, dtype: torch.dtype, config: ConnectorConfig) -> StoreSetup:
    fp = model_fingerprint(model_dir)
    prof = load_profile(model_dir, fp)
    codec = codec_mod.Codec(prof, fp)
    levels = config.levels if config.levels is not None else tuple(sorted(prof.levels))
    bad = [l for l in levels if l not in codec.levels]
    if bad:
        raise ConfigError(f"levels {bad} are not in the profile (it has {list(codec.levels)})")
    if isinstance(config.policy, int) and config.policy not in levels:
        raise ConfigError(f"policy level {config.policy} is not among the stored levels {list(levels)}")
    ns = namespace(fp, dtype, prof.id)
    costs = _costs(fp, str(dtype), prof.id, config.chunk_tokens)
    store = ContextStore(open_backend(config.store), ns, codec, config.chunk_tokens, levels=levels)
    log.info("cachegen store %s for %s", redact(config.store), ns.model_fingerprint)
    return StoreSetup(config.store, ns, codec, config.chunk_tokens, tuple(levels), costs, store)


def _costs(fingerprint: str, dtype: str, profile_id: str, chunk_tokens: int) -> CostModel:
    """The decode/recompute costs cachegen's engine measured on this machine (recently), else the defaults."""
    cm = costs_mod.load_fresh(costs_mod.engine_path(fingerprint, dtype, profile_id, chunk_tokens))
    if cm is None:
        log.info("no recent cost measurement of this model on this machine: the planner uses the defaults")
        return CostModel()
    return cm
