"""An OpenAI-compatible HTTP server over ``AsyncLLMEngine`` (needs the ``[serve]`` extra: FastAPI, uvicorn,
prometheus_client). ``sarathi-lite serve`` runs it; ``build_app(engine)`` gives the ASGI app."""

from sarathi_lite.server.app import build_app

__all__ = ["build_app"]
