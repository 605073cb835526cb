"""`hf-specdec serve`: an OpenAI-compatible HTTP server over `SpeculativeEngine` (needs the `serve` extra:
fastapi, uvicorn, prometheus_client). `build_app` makes the FastAPI app; `serve` loads a model and runs it.
"""

from .server import build_app, serve

__all__ = ["build_app", "serve"]
