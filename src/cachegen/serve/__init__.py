"""An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one :class:`~cachegen.engine.engine.Engine`.

``create_app(engine, ServeConfig(...))`` builds the ASGI app; ``cachegen serve``
runs it with uvicorn. Every request reuses the stored prefix of its prompt and
stores what is new (see :mod:`cachegen.engine.completion`).
"""

from cachegen.serve.app import create_app
from cachegen.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]
