"""``sarathi-lite generate``: run prompts under the chunked-prefill scheduler and show how each iteration mixed
prefill chunks and decodes, then TTFT/TBT per request."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from sarathi_lite.cli.common import add_engine_args, add_threads_arg, apply_threads, engine_config
from sarathi_lite.metrics import IterationRecord, Stats

DEFAULT_PROMPTS = (
    "Explain in two sentences why a long prompt can stall other users of an LLM server.",
    "Write a haiku about paged memory.",
)


def iteration_table(iterations: Sequence[IterationRecord]) -> str:
    """Consecutive iterations of the same shape folded into one row: how each batch mixed work."""
    rows: list[list] = []
    for it in iterations:
        shape = (it.num_prefills, it.num_prefill_tokens, it.num_decodes, it.num_preempted)
        if rows and rows[-1][0] == shape:
            rows[-1][2] = it.index
            rows[-1][3].append(it.step_time)
        else:
            rows.append([shape, it.index, it.index, [it.step_time]])
    lines = [f"{'iterations':>12} {'prefill chunks':>14} {'prefill tok':>11} {'decodes':>8} {'preempt':>7} "
             f"{'step ms':>8}"]
    for (n_pre, pre_tok, n_dec, n_preempt), first, last, times in rows:
        span = f"{first}" if first == last else f"{first}-{last}"
        lines.append(f"{span:>12} {n_pre:>14} {pre_tok:>11} {n_dec:>8} {n_preempt:>7} "
                     f"{1000 * sum(times) / len(times):>8.1f}")
    return "\n".join(lines)


def latency_table(stats: Stats) -> str:
    """One row per request: prompt and output tokens, TTFT, TBT p50 and max (ms)."""
    lines = [f"{'request':>8} {'prompt':>7} {'output':>7} {'TTFT ms':>8} {'TBT p50 ms':>10} {'TBT max ms':>10}"]
    for r in stats.requests:
        tbt = sorted(r.tbt)
        p50 = f"{1000 * tbt[len(tbt) // 2]:.1f}" if tbt else "-"
        mx = f"{1000 * tbt[-1]:.1f}" if tbt else "-"
        ttft = f"{1000 * r.ttft:.1f}" if r.ttft is not None else "-"
        lines.append(f"{r.request_id:>8} {r.num_prompt_tokens:>7} {r.num_output_tokens:>7} {ttft:>8} {p50:>10} "
                     f"{mx:>10}")
    return "\n".join(lines)


def cmd_generate(args: argparse.Namespace) -> int:
    from sarathi_lite.engine.llm import LLM
    from sarathi_lite.engine.sampling_params import SamplingParams

    apply_threads(args)
    config = engine_config(args)
    llm = LLM(config=config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    prompts = args.prompts or list(DEFAULT_PROMPTS)
    if args.raw:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    stats = llm.stats()
    print(f"\nIterations (policy {config.policy}, chunk_size {config.chunk_size}): one forward pass each")
    print(iteration_table(stats.iterations))
    print("\nLatency per request (request ids follow the prompts' order)")
    print(latency_table(stats))
    s = stats.summary()
    print(f"\nTTFT p50 {1000 * s['ttft_p50']:.1f} ms | TBT p50 {1000 * s['tbt_p50']:.1f} ms, "
          f"p99 {1000 * s['tbt_p99']:.1f} ms | {s['throughput_output_tokens_per_s']:.1f} output tokens/s")
    return 0


def add_generate_parser(sub: Any) -> None:
    """Add ``generate`` to the ``sarathi-lite`` subcommands."""
    gen = sub.add_parser("generate", help="generate text for prompts and show the iterations and TTFT/TBT",
                         description=__doc__)
    gen.add_argument("prompts", nargs="*", help="prompts (default: two built-in ones)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_threads_arg(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
