"""``sarathi-lite``: the command line. ``generate`` runs prompts under the chunked-prefill scheduler and shows
how each iteration mixed prefill chunks and decodes, then TTFT/TBT. ``bench`` and ``capacity`` run the serving
benchmark (``sarathi_lite.cli.bench``); ``sim`` and ``profile`` the simulator (``sarathi_lite.cli.sim``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from sarathi_lite.cli.bench import add_bench_parsers
from sarathi_lite.cli.sim import add_sim_parsers
from sarathi_lite.metrics import IterationRecord, Stats
from sarathi_lite.scheduler import POLICIES

DEFAULT_PROMPTS = (
    "Explain in two sentences why a long prompt can stall other users of an LLM server.",
    "Write a haiku about paged memory.",
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every subcommand that builds an engine."""
    p.add_argument("--model", default=None, help="built-in name (default smollm2-135m) or checkpoint folder")
    p.add_argument("--scheduler", default="sarathi", choices=POLICIES, help="batching policy")
    p.add_argument("--chunk-size", type=int, default=256, help="token budget per iteration (chunked policies)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "flashinfer"))
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N ranks (worker processes; gloo on CPU, NCCL on CUDA)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(scheduler=args.scheduler, chunk_size=args.chunk_size, max_num_seqs=args.max_num_seqs,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, dtype=args.dtype,
                device=args.device, attention_backend=args.attention_backend,
                tensor_parallel_size=args.tensor_parallel_size)


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
    from sarathi_lite import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
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
    print(f"\nIterations (policy {args.scheduler}, chunk_size {args.chunk_size}): one forward pass each")
    print(iteration_table(stats.iterations))
    print("\nLatency per request (request ids follow the prompts' order)")
    print(latency_table(stats))
    s = stats.summary()
    print(f"\nTTFT p50 {1000 * s['ttft_p50']:.1f} ms | TBT p50 {1000 * s['tbt_p50']:.1f} ms, "
          f"p99 {1000 * s['tbt_p99']:.1f} ms | {s['throughput_output_tokens_per_s']:.1f} output tokens/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sarathi-lite", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts and show the iterations and TTFT/TBT")
    gen.add_argument("prompts", nargs="*", help="prompts (default: two built-in ones)")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.set_defaults(func=cmd_generate)
    add_bench_parsers(sub)
    add_sim_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"sarathi-lite: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
