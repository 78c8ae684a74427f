"""What the vLLM tests share: the model, the context and the levels."""

MODEL = "smollm2-135m"
# 4 whole 256-token chunks loadable and one token that vLLM computes itself: the strict run's 128
# teacher-forced requests then prefill 1-128 tokens each on top of the loaded context, not ~250
CONTEXT_TOKENS = 1025
NEW_TOKENS = 128  # the baseline's greedy continuation, teacher-forced at the strict level (64 left
# the 0.97 agreement room for one flipped token, within bf16's own noise: docs/vllm.md)
# the connector run's cold, warm, corrupted and deleted requests: each compared with the baseline's
# first tokens (a vLLM decoding step is ~0.14 s on this CPU, so 4 x 48 fewer steps save ~27 s)
CONNECTOR_TOKENS = 16
LEVELS = [0, 4]  # lossless, and the strict-budget level
STRICT = 4
CORRUPTED = 2  # the chunk the connector run damages in Redis: chunks after it are loadable too
CHUNK = 256  # cachegen's chunk (the default)
BLOCK = 128  # vLLM's CPU block size
