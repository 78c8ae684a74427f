"""vLLM integration: :class:`CacheGenConnector`, a vLLM v1 KV connector over a cachegen store.

    from vllm import LLM
    from cachegen.integrations.vllm import kv_transfer_config
    llm = LLM(model=DIR, kv_transfer_config=kv_transfer_config(store="redis://127.0.0.1:6379/0", slo_s=1.0))

``CacheGenConnector`` itself (:mod:`.connector`) imports vLLM; this package and
:mod:`.setup`, :mod:`.layout` and :mod:`.prepare` do not, so cachegen's own
environment can prepare a model's profile for it.
"""

from __future__ import annotations

from typing import Any

CONNECTOR = "CacheGenConnector"
MODULE = "cachegen.integrations.vllm.connector"


def kv_transfer_config(**extra: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for the connector; ``extra`` is its ``kv_connector_extra_config``.

    A chunk that fails to load is recomputed by vLLM (``kv_load_failure_policy="recompute"``):
    vLLM's default, "fail", would fail the request instead."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


def __getattr__(name: str):
    if name == CONNECTOR:  # importing vLLM takes ~15 s: only when the class is asked for
        from cachegen.integrations.vllm.connector import CacheGenConnector

        return CacheGenConnector
    raise AttributeError(name)


__all__ = ["CONNECTOR", "MODULE", "CacheGenConnector", "kv_transfer_config"]
