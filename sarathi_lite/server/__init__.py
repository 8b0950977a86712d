"""An OpenAI-compatible HTTP server over ``AsyncLLMEngine`` (needs the ``[serve]`` extra: FastAPI, uvicorn,
prometheus_client). ``sarathi-lite serve`` runs it; ``build_app(engine, config=ServerConfig(...))`` gives the
ASGI app. ``build_app`` is loaded on first use, so ``ServerConfig`` (and the CLI's flags) need no extra."""

from __future__ import annotations

from typing import Any

from sarathi_lite.server.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from sarathi_lite.server.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
