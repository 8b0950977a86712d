"""``vllm serve MODEL --scheduler-cls sarathi_lite.integrations.vllm.SarathiScheduler --additional-config ...`` on
loopback answers the official ``openai`` client, streamed and not, with the plugin deciding every step."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from .conftest import PLUGIN

START_TIMEOUT = 420.0  # seconds: vLLM's API server starts an engine process and a worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "steps.jsonl"
    port = _free_port()
    options = {"sarathi_lite": {"chunk_size": 32, "step_log": str(log)}}
    cmd = [str(Path(sys.executable).with_name("vllm")), "serve", str(smollm2_model), "--host", "127.0.0.1",
           "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024",
           "--max-num-batched-tokens", "256", "--served-model-name", "smollm2", "--scheduler-cls", PLUGIN,
           "--additional-config", json.dumps(options)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = tmp_path_factory.mktemp("serve-log") / "server.log"
    with out.open("w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                assert proc.poll() is None, out.read_text()[-4000:]
                assert time.monotonic() < deadline, "vllm serve did not start in time\n" + out.read_text()[-4000:]
                try:
                    if httpx.get(base + "/health", timeout=2.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
            yield base, log
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def test_openai_client_streamed_and_not_with_the_plugin_scheduling(server):
    base, log = server
    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=120.0, max_retries=0)
    prompt = "Chunked prefill splits a long prompt into"
    whole = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0.0)
    assert whole.usage.completion_tokens == 16
    streamed = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0.0,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=8, temperature=0.0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    assert steps and all(sum(s["scheduled"].values()) <= 32 for s in steps)  # the plugin's chunk size
