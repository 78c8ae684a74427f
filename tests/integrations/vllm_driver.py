"""One vLLM engine per run, several requests, results as JSON: what the vLLM tests check.

Run by the tests as ``python vllm_driver.py SPEC.json OUT.json`` in the vLLM
environment (an engine start is ~1 minute, so each configuration starts once).
Modes (``spec["mode"]``):

* ``baseline``: plain vLLM; greedy continuations of each prompt, and the prompt-logprob
  ranks of ``prompt + continuation`` (top-1 agreement of vLLM with itself).
* ``connector``: the connector at ``spec["policy"]`` storing ``spec["levels"]``: a cold
  request (stores), a warm one (loads), then the same prompt with stored chunk
  ``spec["corrupt_chunk"]`` corrupted and with one deleted; the lossless chunks of the cold request, decoded, go to
  ``spec["kv_out"]`` for the layout check.
* ``strict``: a second engine on the same store loading at the strict level: the greedy
  next token after the context + the baseline's first ``j`` tokens, for every ``j`` (teacher
  forcing).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _stats(role):
    from cachegen.integrations.vllm.connector import CacheGenConnector

    out = {}
    for c in CacheGenConnector.instances(role):
        out = c.stats.to_json()
    return out


def _both():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return {"scheduler": _stats(KVConnectorRole.SCHEDULER), "worker": _stats(KVConnectorRole.WORKER)}


def _worker():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from cachegen.integrations.vllm.connector import CacheGenConnector

    (w,) = CacheGenConnector.instances(KVConnectorRole.WORKER)
    return w


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine and worker in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # the strict run batches 64 prompts
    from vllm import LLM, SamplingParams

    from cachegen.integrations.vllm import kv_transfer_config

    mode = spec["mode"]
    kw = dict(
        model=spec["model"],
        max_model_len=4096,
        enforce_eager=True,
        dtype="bfloat16",
        enable_prefix_caching=False,
        seed=0,
    )
    if mode != "baseline":
        kw["kv_transfer_config"] = kv_transfer_config(
            store=spec["store"], levels=spec["levels"], policy=spec["policy"], slo_s=spec.get("slo_s", 30.0)
        )
    t = time.perf_counter()
    llm = LLM(**kw)
    out: dict = {"mode": mode, "startup_s": time.perf_counter() - t, "runs": {}}
    n_new = spec["new_tokens"]
    greedy = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    ranks_sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)  # plain vLLM only

    def gen(ids):
        t = time.perf_counter()
        r = llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0]
        return {"tokens": list(r.outputs[0].token_ids), "s": time.perf_counter() - t}

    def ranks(ids, cont):
        r = llm.generate([{"prompt_token_ids": ids + cont}], ranks_sp, use_tqdm=False)[0]
        lps = r.prompt_logprobs[-len(cont) :]
        return [int(lp[tok].rank) for lp, tok in zip(lps, cont)]

    prompts = spec["prompts"]
    if mode == "baseline":
        for name, ids in prompts.items():
            g = gen(ids)
            g["ranks"] = ranks(ids, g["tokens"])
            out["runs"][name] = g
    elif mode == "connector":
        ids = prompts["main"]
        w = _worker()
        out["runs"]["cold"] = gen(ids)
        w.flush(120)
        out["runs"]["cold"]["stats"] = _both()
        _dump_lossless(w, ids, spec["kv_out"])
        out["runs"]["warm"] = gen(ids)
        w.flush(120)
        out["runs"]["warm"]["stats"] = _both()
        store = w.setup.store
        refs = store.refs(ids)
        # a corrupted payload: chunk spec["corrupt_chunk"] at the loaded level
        _corrupt(store, refs[spec["corrupt_chunk"]], spec["policy"])
        out["runs"]["corrupt"] = gen(ids)
        w.flush(120)
        out["runs"]["corrupt"]["stats"] = _both()
        # a deleted chunk (chunk 1): chunks 1.. are computed and stored again
        store.backend.delete_chunks([refs[1].key])
        out["runs"]["deleted"] = gen(ids)
        w.flush(120)
        out["runs"]["deleted"]["stats"] = _both()
        out["namespace"] = store.namespace.model_fingerprint
        out["chunk_keys"] = [r.key for r in refs]
    elif mode == "strict":
        # teacher forcing by one request per position (vLLM 0.32's prompt logprobs of a request
        # whose prefix a connector loaded are unset rows): the greedy next token after
        # context + the baseline's first j tokens, for every j, in one batch
        ids, cont = prompts["main"], spec["continuation"]
        one = SamplingParams(temperature=0.0, max_tokens=1)
        t = time.perf_counter()
        rs = llm.generate([{"prompt_token_ids": ids + cont[:j]} for j in range(len(cont))], one, use_tqdm=False)
        out["runs"]["strict"] = {
            "top1": [int(r.outputs[0].token_ids[0]) for r in rs],
            "s": time.perf_counter() - t,
            "stats": _both(),
        }
    else:
        raise SystemExit(f"unknown mode {mode}")
    with open(out_path, "w") as f:
        json.dump(out, f)
    _worker_shutdown(mode)


def _corrupt(store, ref, level) -> None:
    """Flip bytes in the middle of one stored payload, in Redis itself (what a damaged write leaves)."""
    from cachegen.store.redis_backend import _payload

    name = _payload(ref.key, level)
    raw = bytearray(store.backend.client.get(name))
    for i in range(len(raw) // 2, len(raw) // 2 + 64):
        raw[i] ^= 0x5A
    store.backend.client.set(name, bytes(raw))


def _dump_lossless(w, ids, path) -> None:
    """The lossless chunks the cold request stored, decoded with cachegen."""
    import torch

    from cachegen.kv import KVCache

    store = w.setup.store
    parts = []
    for info in store.plan(ids):
        if 0 not in info.sizes:
            break
        parts.append(w.setup.codec.decode(store.get(info.ref, 0), key=info.ref.key))
    kv = KVCache.concat(parts)
    torch.save({"k": [l.k for l in kv.layers], "v": [l.v for l in kv.layers], "tokens": kv.num_tokens}, path)


def _worker_shutdown(mode: str) -> None:
    if mode == "baseline":
        return
    _worker().shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
