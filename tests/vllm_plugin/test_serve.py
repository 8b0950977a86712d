"""The README's ``vllm serve ... --scheduler-cls sarathi_lite.integrations.vllm.SarathiScheduler ...`` command, run as
written (on a free loopback port), answers the README's OpenAI example by the model name it uses, streamed and not,
and logs the line that says the plugin's options took effect."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 420.0  # seconds: vLLM's API server starts an engine process and a worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def readme_command() -> tuple[dict[str, str], list[str]]:
    """The README's ``vllm serve`` command: its environment assignments and its words (``~`` expanded)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "vllm serve" in b)
    line = next(x for x in block.replace("\\\n", " ").splitlines() if "vllm serve" in x)
    words = shlex.split(line, comments=True)
    env = {}
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, [os.path.expanduser(w) for w in words]


def readme_model_name() -> str:
    """The model name the README's OpenAI client example asks for."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.search(r'client\.chat\.completions\.create\(model="([^"]+)"', readme).group(1)


@pytest.fixture(scope="module")
def server(smollm2_model, tmp_path_factory):
    env_readme, words = readme_command()
    assert words[0] == ".venv-vllm/bin/vllm" and words[1] == "serve", words
    assert Path(words[2]) == smollm2_model, (words[2], smollm2_model)  # the model the README names, converted
    port = _free_port()
    cmd = [str(Path(sys.executable).with_name("vllm"))] + words[1:] + ["--host", "127.0.0.1", "--port", str(port)]
    # the README's own environment only: not the in-process tests' settings (conftest), the KV space included
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                                           "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL")}
    env.update(env_readme)
    out = tmp_path_factory.mktemp("serve-log") / "server.log"
    with out.open("w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
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
            yield base, out
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def test_openai_client_streamed_and_not_with_the_plugin_scheduling(server):
    base, server_log = server
    model = readme_model_name()
    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=120.0, max_retries=0)
    prompt = "Chunked prefill splits a long prompt into"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0.0)
    assert whole.usage.completion_tokens == 16
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0.0,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == whole.choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=8, temperature=0.0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    # the plugin built with the README's options, and said so in vLLM's log
    assert re.search(r"sarathi_lite scheduler on vLLM 0\.32\.0\S*: policy sarathi, chunk_size 256,",
                     server_log.read_text()), server_log.read_text()[-4000:]
