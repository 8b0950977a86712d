"""Replay a ``Workload`` against any OpenAI-compatible server (sarathi-lite, vLLM, SGLang, ...) over HTTP.

Each request is sent at its arrival time as a streamed ``POST /v1/completions`` with the same token-id prompt
the in-process replay uses (``Workload.prompt_token_ids``), greedy, ``max_tokens = output_len`` and
``ignore_eos`` (vLLM's and SGLang's extension; it forces the output length). TTFT and every gap between
tokens are measured at the client, on ``time.perf_counter``; the result is the same ``BenchResult`` as the
in-process replay's (``compare``, plots and capacity work on it), with no iteration records (a client cannot
see the server's iterations) and no scheduling delay.

Token times: with ``continuous_usage`` (``stream_options.continuous_usage_stats``, which vLLM and sarathi-lite
support) each chunk's ``usage.completion_tokens`` says how many tokens arrived; without it every chunk counts as
one token, as most benchmark clients assume.

>>> from sarathi_lite.bench.http_client import replay_http
>>> result = replay_http(Workload.synthetic("fixed:128:64", num_requests=20, qps=2), "http://127.0.0.1:8000")
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import time
from typing import Any

from sarathi_lite.bench.results import BenchResult, host
from sarathi_lite.bench.workload import RequestSpec, Workload
from sarathi_lite.metrics import RequestMetrics, Stats

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 32000  # prompt token ids are drawn below this; every common model's vocabulary is larger


def replay_http(workload: Workload, base_url: str, *, model: str | None = None, api_key: str | None = None,
                vocab_size: int = DEFAULT_VOCAB_SIZE, label: str | None = None, continuous_usage: bool = True,
                progress: bool = True, timeout: float = 600.0) -> BenchResult:
    """Replay ``workload`` in real time against the server at ``base_url`` (e.g. ``http://127.0.0.1:8000``).

    model: the served model name (default: the first of ``GET /v1/models``). api_key: sent as a bearer token.
    vocab_size: prompt token ids are drawn from ``[100, vocab_size)``; give the server model's vocabulary size
    to replay exactly the prompts of the in-process replay. label: the result's label (default
    ``openai:<model>``). timeout: seconds one request may take. Requests that fail (HTTP error, error event)
    are logged, counted in ``meta["num_errors"]`` and left unfinished, so summaries skip them.
    """
    return asyncio.run(_replay(workload, base_url.rstrip("/"), model, api_key, vocab_size, label,
                               continuous_usage, progress, timeout))


async def _replay(workload: Workload, base_url: str, model: str | None, api_key: str | None, vocab_size: int,
                  label: str | None, continuous_usage: bool, progress: bool, timeout: float) -> BenchResult:
    try:
        import httpx
    except ImportError as e:
        raise RuntimeError(f"the HTTP client needs httpx (pip install 'sarathi-lite[serve]'): {e}") from e

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits) as http:
        model = await _served_model(http, base_url, model, httpx)
        prompts = workload.prompt_token_ids(vocab_size)
        bar = _progress(len(prompts), label or f"openai:{model}", progress)
        load_start = os.getloadavg()
        wall = time.perf_counter()
        start = time.perf_counter()
        tasks = [asyncio.create_task(_one(http, model, spec, ids, start + spec.arrival_time, continuous_usage, bar))
                 for spec, ids in zip(workload.requests, prompts)]
        metrics = await asyncio.gather(*tasks)
        if bar is not None:
            bar.close()
    errors = sum(m.finished_time is None for m in metrics)
    config = {"label": label or f"openai:{model}", "policy": "openai", "chunk_size": None, "backend": "openai",
              "base_url": base_url, "model": model}
    meta = {"replay": "real-time over HTTP", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": host(), "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
            "wall_time": time.perf_counter() - wall, "num_errors": errors,
            "token_times": "continuous usage" if continuous_usage else "one token per chunk"}
    return BenchResult(config, workload, Stats(metrics, []), meta)


async def _served_model(http: Any, base_url: str, model: str | None, httpx: Any) -> str:
    """``model``, else the server's first (``GET /v1/models``); asked either way, so an unreachable server is
    reported before any request is timed. Raises ``RuntimeError`` naming ``base_url``."""
    try:
        r = await http.get("/v1/models")
    except httpx.TransportError as e:
        raise RuntimeError(f"cannot reach the server at {base_url} ({type(e).__name__}: {e}); is it running, and "
                           f"is --base-url its address (e.g. http://127.0.0.1:8000)?") from None
    if model is not None:
        return model
    if r.status_code != 200:
        raise RuntimeError(f"{base_url}/v1/models answered HTTP {r.status_code}: {r.text[:200]} (give the model "
                           f"name with --served-model-name, or the key with --api-key)")
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"{base_url}/v1/models lists no model ({r.text[:200]!r}); give --served-model-name") \
            from None


async def _one(http: Any, model: str, spec: RequestSpec, prompt: list[int], arrival: float,
               continuous_usage: bool, bar: Any) -> RequestMetrics:
    """Send one request at ``arrival`` (``perf_counter`` seconds) and time its tokens."""
    await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
    m = RequestMetrics(spec.request_id, arrival, len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": spec.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": continuous_usage}}
    finish = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error'].get('message')}")
                usage = event.get("usage")
                if usage and usage.get("prompt_tokens") is not None:
                    m.num_prompt_tokens = usage["prompt_tokens"]
                if not event.get("choices"):
                    continue
                new = usage["completion_tokens"] - len(m.token_times) if continuous_usage and usage else 1
                m.token_times += [now] * new
                finish = event["choices"][0].get("finish_reason") or finish
    except Exception as e:  # one failed request must not end the benchmark
        logger.warning("request %s failed: %s", spec.request_id, e)
        m.finish_reason = "error"
        return m
    if m.token_times:
        m.first_token_time = m.token_times[0]
        m.finished_time = m.token_times[-1]
    m.finish_reason = finish
    if bar is not None:
        bar.update(1)
    return m


def _progress(total: int, label: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=label, unit="req", leave=False)
