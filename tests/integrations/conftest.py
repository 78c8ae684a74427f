"""Fixtures of the vLLM tests: the model, real prompts, a real redis-server and one vLLM engine per configuration.

These tests run in the vLLM environment (``.venv-vllm``, ``make test`` sets it up):
vLLM pins an older transformers than cachegen's own environment, so the model's codec
profile and the transformers reference KV come from cachegen's environment
(``CACHEGEN_MAIN_PYTHON``, default ``.venv/bin/python``) in subprocesses. Each vLLM
configuration is one subprocess (``vllm_driver.py``) that runs several requests on one
engine (a start is ~1 minute) and writes JSON that the tests read.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integrations.vllm_params import CONNECTOR_TOKENS, CONTEXT_TOKENS, CORRUPTED, LEVELS, MODEL, NEW_TOKENS, STRICT

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def _main_python() -> str:
    p = os.environ.get("CACHEGEN_MAIN_PYTHON") or str(REPO / ".venv" / "bin" / "python")
    if not Path(p).exists():
        pytest.fail(f"cachegen's own environment ({p}) is missing: run `make setup` (or set CACHEGEN_MAIN_PYTHON)")
    return p


def _run(cmd: list[str], timeout: float, what: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if r.returncode:
        pytest.fail(f"{what} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    return r.stdout


@pytest.fixture(scope="session")
def vllm_env():
    pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm (make test sets it up)")


@pytest.fixture(scope="session")
def model_dir(vllm_env) -> str:
    """The converted safetensors directory, its codec profile made (once) in cachegen's environment."""
    out = _run([_main_python(), "-m", "cachegen.integrations.vllm.prepare", MODEL], 900, "preparing the model")
    return out.strip().splitlines()[-1].split("\t")[0]


@pytest.fixture(scope="session")
def prompts(model_dir) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    from cachegen import corpus

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(corpus.text("GPL-3"), add_special_tokens=False)["input_ids"]
    return {"main": ids[200 : 200 + CONTEXT_TOKENS]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory, vllm_env):
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server not found on PATH: `make redis-server` installs Debian's package")
    d = tmp_path_factory.mktemp("redis")
    port = _free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def drive(tmp: Path, spec: dict) -> dict:
    """Run one vLLM configuration (``vllm_driver.py``) and return its JSON."""
    sp, out = tmp / f"{spec['mode']}-spec.json", tmp / f"{spec['mode']}-out.json"
    sp.write_text(json.dumps(spec))
    _run([sys.executable, str(HERE / "vllm_driver.py"), str(sp), str(out)], 900, f"vLLM run '{spec['mode']}'")
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def baseline(tmp_path_factory, model_dir, prompts) -> dict:
    return drive(
        tmp_path_factory.mktemp("baseline"),
        {"mode": "baseline", "model": model_dir, "prompts": prompts, "new_tokens": NEW_TOKENS},
    )


@pytest.fixture(scope="session")
def connector_run(tmp_path_factory, model_dir, prompts, redis_url) -> dict:
    tmp = tmp_path_factory.mktemp("connector")
    res = drive(
        tmp,
        {
            "mode": "connector",
            "model": model_dir,
            "prompts": prompts,
            "new_tokens": CONNECTOR_TOKENS,
            "store": redis_url,
            "levels": LEVELS,
            "policy": 0,
            "corrupt_chunk": CORRUPTED,
            "kv_out": str(tmp / "lossless.pt"),
        },
    )
    res["kv_out"] = str(tmp / "lossless.pt")
    return res


@pytest.fixture(scope="session")
def strict_run(tmp_path_factory, model_dir, prompts, redis_url, baseline, connector_run) -> dict:
    return drive(
        tmp_path_factory.mktemp("strict"),
        {
            "mode": "strict",
            "model": model_dir,
            "prompts": prompts,
            "new_tokens": NEW_TOKENS,
            "store": redis_url,
            "levels": LEVELS,
            "policy": STRICT,
            "continuation": baseline["runs"]["main"]["tokens"],
        },
    )


@pytest.fixture(scope="session")
def hf_reference(tmp_path_factory, model_dir, prompts) -> dict:
    import torch

    tmp = tmp_path_factory.mktemp("hf")
    (tmp / "ids.json").write_text(json.dumps(prompts["main"]))
    _run(
        [_main_python(), str(HERE / "hf_reference.py"), model_dir, str(tmp / "ids.json"), str(tmp / "kv.pt")],
        600,
        "transformers reference prefill",
    )
    return torch.load(tmp / "kv.pt")
