"""cachegen: encode, store and stream LLM KV caches.

Layers, lowest first: ``codec`` (KV chunk <-> bytes), ``store`` (chunk keys
and backends), ``stream`` (deadline-aware loader), ``engine`` (transformers
integration), with ``bench`` and ``cli`` on top.
"""

__version__ = "0.1.0"
