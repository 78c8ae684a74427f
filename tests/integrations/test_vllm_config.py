"""The connector's extra config and namespace (no vLLM engine needed)."""

from __future__ import annotations

import pytest
import torch

from cachegen.errors import ConfigError
from cachegen.integrations.vllm import kv_transfer_config
from cachegen.integrations.vllm.setup import ConnectorConfig, namespace


def test_extra_config_is_checked():
    c = ConnectorConfig.from_extra({"store": "redis://h:1/0", "levels": [0, "4"], "policy": "4", "slo_s": "0.5"})
    assert c.levels == (0, 4) and c.policy == 4 and c.slo_s == 0.5 and c.chunk_tokens == 256
    assert ConnectorConfig.from_extra({"policy": "adaptive"}).policy == "adaptive"
    with pytest.raises(ConfigError, match="unknown"):
        ConnectorConfig.from_extra({"slo": 1.0})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra({"slo_s": 0})
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra({"policy": "fastest"})


def test_kv_transfer_config_recomputes_failed_loads():
    cfg = kv_transfer_config(store="file:///tmp/x")
    assert cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_module_path"] == "cachegen.integrations.vllm.connector"
    assert cfg["kv_connector_extra_config"] == {"store": "file:///tmp/x"}


def test_namespace_names_engine_and_dtype():
    a = namespace("abc", torch.bfloat16, "p1")
    assert a.model_fingerprint == "abc-vllm-bfloat16"
    assert a.root() != namespace("abc", torch.float16, "p1").root()
