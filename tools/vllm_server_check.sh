#!/usr/bin/env bash
# Drives the README's vLLM api_server command end to end: a private redis-server, vLLM's OpenAI server
# with cachegen's connector, then the same ~900-token prompt twice through the official openai client
# (the first stores the prompt's KV, the second loads it). Prints both times, whether the answers
# match and the store's key count. After `make setup vllm-setup` and
# `.venv/bin/python -m cachegen.integrations.vllm.prepare`. Usage: tools/vllm_server_check.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cachegen-vllm-server-check}
mkdir -p "$OUT"
redis-server --port 6399 --save '' --appendonly no --daemonize yes --pidfile "$OUT"/redis.pid --logfile "$OUT"/redis.log
sleep 1
VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model ~/.cache/cachegen/models/smollm2-135m \
  --max-model-len 4096 --enforce-eager --dtype bfloat16 --port 8011 \
  --kv-transfer-config '{"kv_connector":"CacheGenConnector","kv_connector_module_path":"cachegen.integrations.vllm.connector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"store":"redis://127.0.0.1:6399/0","slo_s":1.0}}' \
  > "$OUT"/server.log 2>&1 &
SPID=$!
for i in $(seq 1 180); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; kill -0 $SPID 2>/dev/null || { echo "the server exited: see $OUT/server.log"; redis-cli -p 6399 shutdown nosave; exit 1; }; sleep 5; done
echo "health after ~$((i*5)) s"
.venv/bin/python - <<'PY'
import time
from openai import OpenAI
from cachegen.corpus import text
doc = text("pydoc-eval")[:4000]
c = OpenAI(base_url="http://127.0.0.1:8011/v1", api_key="x")
model = c.models.list().data[0].id
outs = []
for i in range(2):
    t = time.perf_counter()
    r = c.completions.create(model=model, prompt=doc + "\n\nIn one sentence, this text is about", max_tokens=16, temperature=0)
    outs.append(r.choices[0].text)
    print(f"request {i}: {time.perf_counter() - t:.1f} s, prompt_tokens {r.usage.prompt_tokens}: {r.choices[0].text!r}")
print("same answer:", outs[0] == outs[1])
PY
redis-cli -p 6399 dbsize
kill $SPID; sleep 3; kill -9 $SPID 2>/dev/null
redis-cli -p 6399 shutdown nosave
grep -i "cachegen\|connector" "$OUT"/server.log | grep -iv "warn.*deprecat" | tail -15
