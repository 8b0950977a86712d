"""Helpers for tests that run the OpenAI-compatible server on loopback: a free port, an in-process uvicorn server
in a thread (fast to start; the test may reach into its engine), and OpenAI error-body checks."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from sarathi_lite import LLMEngine
from sarathi_lite.server import ServerConfig, build_app
from sarathi_lite.server.limits import header_timeout_protocol

MODEL = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become healthy in {timeout} s")


def stop_process(proc: subprocess.Popen) -> None:
    """Stop a server subprocess: SIGTERM, then SIGKILL if it has not exited within 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serve_in_thread(checkpoint: Path, config: ServerConfig | None = None,
                    patch: Callable[[LLMEngine], None] | None = None, **engine_options: Any) -> Iterator[str]:
    """Serve a fresh engine on ``checkpoint`` on a free loopback port from a thread (``patch`` may change the
    engine first); yields the base URL and stops the server afterwards."""
    import uvicorn

    engine = LLMEngine(checkpoint, **engine_options)
    if patch is not None:
        patch(engine)
    config = config or ServerConfig()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, MODEL, config), host="127.0.0.1", port=port,
                                           log_level="error", http=header_timeout_protocol(config.header_timeout)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        auth = {"Authorization": f"Bearer {config.api_key}"} if config.auth_health_and_metrics else None
        wait_healthy(url, headers=auth)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = ..., code: str | None = ...
                        ) -> dict[str, Any]:
    """``response`` has ``status`` and OpenAI's error body (``param``/``code`` checked when given)."""
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err
