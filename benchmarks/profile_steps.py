"""Where one engine step's time goes, per torch operator: a decode-heavy step and a prefill-heavy step.

    python benchmarks/profile_steps.py                       # SmolLM2-135M, float32, 2 threads
    python benchmarks/profile_steps.py --rows 25 --repeats 20

The two steps are built directly (no scheduler): the engine's model runner runs them through its ``execute``
(inputs, attention metadata, the forward pass, logits and greedy sampling), exactly as ``LLMEngine.step`` would.

- decode-heavy: ``--decodes`` running decodes (default 32) at contexts drawn uniformly from
  ``--decode-context`` (default 300-600 tokens);
- prefill-heavy: one ``--chunk``-token prefill chunk (default 512, at the start of its prompt) beside
  ``--side-decodes`` decodes (default 4) drawn the same way.

Block tables are shuffled over the KV pool (every request's pages scattered, as after a while of serving). Each
step is warmed up, timed ``--repeats`` times (median), then profiled once per repeat with ``torch.profiler``; the
per-operator table (self CPU time, sorted) is printed for each. It also prints what the step achieves against this
machine's measured peaks: GFLOP/s of the prefill-heavy step against a matmul probe, GB/s of weight + KV reads of
the decode-heavy step against a memory-copy probe (``--no-probe`` skips the probes).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.bench.replay import step_seconds
from sarathi_lite.kernels.metadata import scattered_block_tables
from sarathi_lite.models.parallel import PackedWeight
from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput


def make_step(engine: LLMEngine, rng: np.random.Generator, q_lens: list[int], contexts: list[int]
              ) -> SchedulerOutput:
    """A batch of requests with ``q_lens[i]`` new tokens after ``contexts[i]`` cached ones, pages scattered."""
    bs = engine.runner.block_size
    kv_lens = [c + q for c, q in zip(contexts, q_lens)]
    tables, needed = scattered_block_tables(kv_lens, bs, rng)
    num_blocks = engine.runner.kv_cache.shape[1]
    if needed > num_blocks:
        raise ValueError(f"the step needs {needed} KV blocks, the pool has {num_blocks}")
    vocab = engine.model_config.vocab_size
    out = SchedulerOutput()
    for i, (q, c, table) in enumerate(zip(q_lens, contexts, tables)):
        out.scheduled.append(ScheduledRequest(
            request_id=f"r{i}", num_computed_tokens=c, num_new_tokens=q,
            token_ids=rng.integers(100, vocab, size=q).tolist(), block_table=table, sample=True,
            is_prefill=q > 1))
        if q > 1:
            out.num_prefills += 1
            out.num_prefill_tokens += q
        else:
            out.num_decodes += 1
            out.num_decode_tokens += 1
    return out


def time_step(engine: LLMEngine, out: SchedulerOutput, repeats: int) -> float:
    """Median seconds of ``repeats`` runs of the step (after two warm-ups)."""
    params = {s.request_id: SamplingParams(temperature=0.0) for s in out.scheduled}
    return step_seconds(engine, out, params, repeats, warmups=2)


def profile_step(engine: LLMEngine, out: SchedulerOutput, repeats: int, rows: int) -> str:
    params = {s.request_id: SamplingParams(temperature=0.0) for s in out.scheduled}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            engine.runner.execute(out, params)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def step_costs(engine: LLMEngine, out: SchedulerOutput) -> tuple[float, float]:
    """``(flops, bytes)`` of one step: matmul + attention FLOPs, and bytes of weights + KV cache read."""
    cfg = engine.model_config
    model = engine.model
    layer_params = sum(p.numel() for name, p in model.named_parameters()
                       if ".layers." in name and name.endswith("proj.weight"))
    head = model.lm_head.weight.numel()
    tokens = sum(s.num_new_tokens for s in out.scheduled)
    sampled = sum(s.sample for s in out.scheduled)
    flops = 2.0 * (layer_params * tokens + head * sampled)
    hq, d = cfg.num_heads, cfg.head_dim
    kv_read = 0
    for s in out.scheduled:
        c, q = s.num_computed_tokens, s.num_new_tokens
        keys_seen = q * c + q * (q + 1) / 2  # causal: query j sees c + j + 1 keys
        flops += cfg.num_layers * 4.0 * hq * d * keys_seen
        kv_read += c + q
    item = engine.runner.kv_cache.element_size()
    kv_bytes = kv_read * cfg.num_layers * 2 * cfg.num_kv_heads * d * item
    weight_bytes = (layer_params + head) * item
    return flops, weight_bytes + kv_bytes


def probes(dtype: torch.dtype) -> tuple[float, float]:
    """This machine's peaks at the current thread count: ``(GFLOP/s of a matmul, GB/s of a memory copy)`` (the
    copy counts its reads and its writes), each the best of a few runs."""
    a = torch.randn(1024, 1024, dtype=dtype)
    b = torch.randn(1024, 1024, dtype=dtype)
    best = float("inf")
    for _ in range(8):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    gflops = 2 * 1024 ** 3 / best / 1e9
    src = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return gflops, 2 * src.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--decode-context", type=int, nargs=2, default=(300, 600))
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--side-decodes", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rows", type=int, default=20, help="operators shown per table")
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--no-profile", action="store_true", help="time the steps only (for A/B runs)")
    ap.add_argument("--unpacked", action="store_true",
                    help="drop the packed weights after loading (A/B of packing alone)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    engine = LLMEngine(args.model, dtype=args.dtype, device="cpu")
    packed = [m for m in engine.runner.model.modules() if isinstance(m, PackedWeight) and m._packed is not None]
    if args.unpacked:
        for m in packed:
            m._packed = None
    rng = np.random.default_rng(0)
    lo, hi = args.decode_context
    steps = {
        f"decode-heavy: {args.decodes} decodes, contexts {lo}-{hi}":
            make_step(engine, rng, [1] * args.decodes, rng.integers(lo, hi + 1, args.decodes).tolist()),
        f"prefill-heavy: a {args.chunk}-token chunk + {args.side_decodes} decodes":
            make_step(engine, rng, [args.chunk] + [1] * args.side_decodes,
                      [0] + rng.integers(lo, hi + 1, args.side_decodes).tolist()),
    }
    peak_flops, peak_bw = (None, None) if args.no_probe else probes(engine.dtype)
    print(f"{engine.model_path.name}, {engine.dtype}, {torch.get_num_threads()} threads, "
          f"{0 if args.unpacked else len(packed)} packed weights, attention "
          f"{engine.runner.attention_backend}, load average {open('/proc/loadavg').read().split()[:3]}")
    if peak_flops:
        print(f"probes: matmul 1024^3 {peak_flops:.1f} GFLOP/s, memory copy {peak_bw:.1f} GB/s (read + write)")
    for label, out in steps.items():
        seconds = time_step(engine, out, args.repeats)
        flops, nbytes = step_costs(engine, out)
        line = (f"\n== {label}: {1000 * seconds:.1f} ms per step (median of {args.repeats}); "
                f"{flops / seconds / 1e9:.1f} GFLOP/s, {nbytes / seconds / 1e9:.1f} GB/s of weight + KV reads")
        if peak_flops:
            line += f" ({flops / seconds / 1e9 / peak_flops:.0%} of the matmul probe, " \
                    f"{nbytes / seconds / 1e9 / peak_bw:.0%} of the copy probe)"
        print(line)
        if not args.no_profile:
            print(profile_step(engine, out, args.repeats, args.rows))


if __name__ == "__main__":
    main()
