"""``transformers serve --continuous-batching`` with sarathi-lite's scheduler (through the launcher: transformers'
own command has no scheduler option), answering the official ``openai`` client on 127.0.0.1; the step log the
scheduler writes in transformers' model process shows it scheduled the requests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from sarathi_lite.integrations.transformers.serve import split_options

from .conftest import make_tiny_checkpoint
from .tiny_tokenizer import save_tiny_tokenizer

openai = pytest.importorskip("openai")

STARTUP = 180.0  # seconds the server may take to load the model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = make_tiny_checkpoint("llama", root / "llama")
    save_tiny_tokenizer(model, 320)
    steps = root / "steps.jsonl"
    port = _free_port()
    options = json.dumps({"chunk_size": 16, "step_log": str(steps)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "sarathi_lite.integrations.transformers.serve", str(model), "--continuous-batching",
         "--sarathi", options, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
         "--attn-implementation", "sdpa", "--cb-max-batch-tokens", "64", "--cb-num-blocks", "64",
         "--cb-block-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.5)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0), \
            str(model), steps
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_openai_client_answers_with_sarathi_scheduling(server):
    client, model, steps = server
    messages = [{"role": "user", "content": "A long prompt can stall the other users of a server. " * 4}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reply.choices[0].message.content  # greedy, streamed or not
    records = [json.loads(line) for line in steps.read_text().splitlines()]
    prompts = [n for r in records for n, _ in r["new"].values()]
    assert prompts == [reply.usage.prompt_tokens] * 2
    # a prompt longer than the 16-token budget was chunked by the plan: every step within it
    assert reply.usage.prompt_tokens > 16 and all(sum(r["scheduled"].values()) <= 16 for r in records)


def test_launcher_refuses_a_command_it_cannot_honour():
    assert split_options(["m", "--continuous-batching", "--sarathi", '{"chunk_size": 8}']) == (
        {"chunk_size": 8}, ["m", "--continuous-batching"])
    with pytest.raises(ValueError, match="--continuous-batching"):
        split_options(["m", "--sarathi={}"])
    with pytest.raises(ValueError, match="'chunk_size=8'"):
        split_options(["m", "--continuous-batching", "--sarathi", "chunk_size=8"])
    run = subprocess.run([sys.executable, "-m", "sarathi_lite.integrations.transformers.serve", "m",
                          "--continuous-batching", "--sarathi", '{"chunk_size": 0}'],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "chunk_size=0" in run.stderr
