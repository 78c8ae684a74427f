"""Integrations of cachegen into other serving engines.

Each integration sits above :mod:`cachegen.engine` and imports its host
engine itself; the core packages never import one. :mod:`.vllm` holds the
vLLM KV connector (install with ``pip install 'cachegen[vllm]'``).
"""
