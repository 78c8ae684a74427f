"""What the vLLM tests share: the model, the context and the levels."""

MODEL = "smollm2-135m"
CONTEXT_TOKENS = 1000  # 3 whole 256-token chunks loadable, a partial 4th computed by vLLM
NEW_TOKENS = 64
LEVELS = [0, 4]  # lossless, and the strict-budget level
STRICT = 4
CHUNK = 256  # cachegen's chunk (the default)
BLOCK = 128  # vLLM's CPU block size
