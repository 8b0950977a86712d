"""``sarathi-lite serve --instances 2P1D`` as a subprocess with its instances as child processes: a prefill
instance lost while a stream decodes shows in ``/health`` (200, ``degraded``) and ``/metrics`` within a few
seconds, mid-stream, while requests keep being served; when the
last decode instance dies, ``/health`` answers 503, the surviving prefill instance is stopped (its process
exits, its KV blocks are freed) and the metrics say so. Bounded: every wait has a deadline."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import TINY, make_tiny_checkpoint
from tests.live_server import MODEL, free_port, stop_process, wait_healthy
from tests.tiny_tokenizer import save_tiny_tokenizer

ENGINE = dict(chunk_size=32, block_size=4, num_kv_blocks=256, max_num_seqs=8, device="cpu")


def children(pid: int) -> list[int]:
    """The instance processes of server ``pid`` (multiprocessing spawn children), oldest first: prefill0,
    prefill1, decode0 (the order ``ProcessEngine`` starts them)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
            if "spawn_main" in cmd:
                start = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[19])
                found.append((start, int(child)))
    return [c for _, c in sorted(found)]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s][^\s]*) (\S+)$", text, re.M)}


def until(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"not within {timeout} s")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_tokenizer(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("inst") / "llama"),
                               TINY["vocab_size"])


def test_lost_instances_show_in_health_and_metrics_and_the_last_decode_stops_the_rest(checkpoint):
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    cmd = [sys.executable, "-m", "sarathi_lite", "serve", str(checkpoint), "--host", "127.0.0.1", "--port",
           str(port), "--served-model-name", MODEL, "--instances", "2P1D", *flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "prompt": list(range(10, 40)), "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    try:
        wait_healthy(url, timeout=180)
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "instances": {
            "prefill": {"alive": 2, "lost": 0, "stopped": 0}, "decode": {"alive": 1, "lost": 0, "stopped": 0}}}
        prefill0, prefill1, decode0 = children(proc.pid)
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200

        # killed while a stream decodes (the prefill instances idle): /health says so within a step, mid-stream
        long = {**body, "max_tokens": 900, "stream": True}
        health = None
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(prefill0, signal.SIGKILL)
            deadline = time.monotonic() + 3.0  # the stream's 900 tokens take longer on this CPU
            for line in lines:
                assert line != "data: [DONE]" and time.monotonic() < deadline, "not degraded mid-stream within 3 s"
                if (h := httpx.get(f"{url}/health")).json().get("status") == "degraded":
                    health = h
                    break
        assert health.status_code == 200
        assert health.json()["instances"]["prefill"] == {"alive": 1, "lost": 1, "stopped": 0}
        m = metrics(url)
        assert m['sarathi_lite_instances{role="prefill",state="lost"}'] == 1
        assert m['sarathi_lite_instances{role="prefill",state="alive"}'] == 1
        for _ in range(3):  # still served, by the prefill instance left
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

        os.kill(decode0, signal.SIGKILL)
        until(lambda: httpx.get(f"{url}/health").status_code == 503)
        error = httpx.get(f"{url}/health").json()["error"]
        assert error["code"] == "engine_dead" and "no decode instance is left" in error["message"]
        until(lambda: not alive(prefill1))  # stopped: its memory and KV blocks are freed
        m = metrics(url)
        assert m['sarathi_lite_instances{role="prefill",state="stopped"}'] == 1
        assert m['sarathi_lite_instances{role="decode",state="lost"}'] == 1
        assert m["sarathi_lite_kv_blocks_used"] == 0
    finally:
        stop_process(proc)
