"""Prometheus metrics of a serving engine (``GET /metrics``), with ``prometheus_client``.

Queue sizes and KV blocks are read when scraped, from the engine's thread-safe ``snapshot()``; per-iteration token
mix and per-token latencies are recorded by ``on_step``, which the engine thread calls after every step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sarathi_lite.engine.async_engine import AsyncLLMEngine
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.outputs import RequestOutput

PREFIX = "sarathi_lite"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServerMetrics:
    """The server's metrics in their own ``registry`` (so several servers can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge(f"{PREFIX}_num_requests_running", "Requests being prefilled or decoded", registry=r)
        self.waiting = Gauge(f"{PREFIX}_num_requests_waiting", "Requests waiting to be admitted", registry=r)
        self.kv_used = Gauge(f"{PREFIX}_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge(f"{PREFIX}_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.streams = Gauge(f"{PREFIX}_num_streams", "Requests with a client waiting for their outputs", registry=r)
        self.iterations = Counter(f"{PREFIX}_iterations", "Engine iterations (one forward pass each)", registry=r)
        self.prefill_tokens = Counter(f"{PREFIX}_prefill_tokens", "Prompt tokens run in iterations", registry=r)
        self.decode_tokens = Counter(f"{PREFIX}_decode_tokens", "Decode tokens run in iterations", registry=r)
        self.iteration_tokens = Histogram(f"{PREFIX}_iteration_tokens", "Tokens per iteration", registry=r,
                                          buckets=TOKEN_BUCKETS)
        self.iteration_requests = Histogram(f"{PREFIX}_iteration_requests", "Requests per iteration", registry=r,
                                            buckets=TOKEN_BUCKETS)
        self.step_time = Histogram(f"{PREFIX}_iteration_seconds", "Iteration time (seconds)", registry=r,
                                   buckets=LATENCY_BUCKETS)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Arrival to first token (seconds)",
                              registry=r, buckets=LATENCY_BUCKETS)
        self.tbt = Histogram(f"{PREFIX}_time_between_tokens_seconds", "Gap between output tokens (seconds)",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.finished = Counter(f"{PREFIX}_requests_finished", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Output tokens of finished requests",
                                         registry=r)
        self._seen_iterations = 0

    def watch(self, engine: AsyncLLMEngine) -> None:
        """Read ``engine``'s queues and KV pool at every scrape (on the server's thread), only through its
        thread-safe ``snapshot()``."""
        self.running.set_function(lambda: engine.snapshot().num_running)
        self.waiting.set_function(lambda: engine.snapshot().num_waiting)
        self.kv_used.set_function(lambda: engine.snapshot().kv_blocks_used)
        self.kv_total.set_function(lambda: engine.snapshot().kv_blocks_total)
        self.streams.set_function(lambda: engine.num_streams)
        states = getattr(getattr(engine, "engine", None), "instance_states", None)
        if states is not None:  # instances as processes: how many of each role are alive, lost, stopped
            gauge = Gauge(f"{PREFIX}_instances", "Instances by role and state (alive, lost, stopped)",
                          ["role", "state"], registry=self.registry)
            for role, counts in states().items():
                for state in counts:
                    gauge.labels(role, state).set_function(lambda r=role, s=state: states()[r][s])

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Record the iterations ``engine`` ran since the last call (one for an ``LLMEngine`` step; any number for
        instances as processes, whose step returns when one of them ends one) and the tokens and endings of
        ``outputs``. A stats reset (fewer iterations than seen) starts the count over."""
        rec = engine.metrics
        if rec.num_iterations < self._seen_iterations:
            self._seen_iterations = 0
        new = min(rec.num_iterations - self._seen_iterations, len(rec.iterations))
        self._seen_iterations = rec.num_iterations
        for k in range(new, 0, -1):  # oldest new one first; indexing from the end is cheap on a list or deque
            it = rec.iterations[-k]
            self.iterations.inc()
            self.prefill_tokens.inc(it.num_prefill_tokens)
            self.decode_tokens.inc(it.num_decode_tokens)
            self.iteration_tokens.observe(it.num_tokens)
            self.iteration_requests.observe(it.num_prefills + it.num_decodes)
            self.step_time.observe(it.step_time)
        for out in outputs:
            m = out.metrics
            if out.new_token_ids:
                times = m.token_times
                if len(times) == 1:
                    self.ttft.observe(m.ttft)
                elif len(times) > 1:
                    self.tbt.observe(times[-1] - times[-2])
            if out.finished:
                self.finished.labels(out.finish_reason).inc()
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.generation_tokens.inc(out.num_output_tokens)
