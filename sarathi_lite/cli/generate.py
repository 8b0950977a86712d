"""``sarathi-lite generate``: run prompts under the chunked-prefill scheduler and show how each iteration mixed
prefill chunks and decodes, then TTFT/TBT per request.

To show the idea on any prompt, a built-in long prompt (a passage to summarize) arrives a few iterations after
the given prompts, while they decode, and the chunk size defaults to 64 tokens here: the table then shows the long
prompt cut into chunks, each run in one forward pass beside the running decodes (hybrid batches), and the decodes
never waiting for a whole prompt. --no-long-prompt runs only the given prompts.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from sarathi_lite.cli.common import add_engine_args, add_threads_arg, apply_threads, engine_config, set_flag_help
from sarathi_lite.metrics import IterationRecord, Stats

DEFAULT_PROMPTS = (
    "Explain in two sentences why a long prompt can stall other users of an LLM server.",
    "Write a haiku about paged memory.",
)

# generate's chunk size unless --chunk-size is given: small enough that the long prompt takes several chunks.
DEMO_CHUNK_SIZE = 64
# The iteration at which the long prompt arrives: the given prompts are prefilled and decoding by then.
LONG_PROMPT_ARRIVAL = 3
LONG_PROMPT = (
    "Summarize this passage in one sentence.\n\n"
    "A request to a language model has two phases. Prefill reads the whole prompt at once: it is compute-bound, "
    "and its cost grows with the prompt's length, so a long prompt can take a large share of a second even on a "
    "fast accelerator. Decode then writes the answer one token at a time: each step reads all the model's "
    "weights and the request's cached keys and values to produce a single token, so it is memory-bound and "
    "leaves most of the compute idle. A server that batches requests naively runs a new prompt's whole prefill "
    "as one step, and every request already streaming its answer waits for that step to finish: its users see "
    "the text stall. Chunked prefill cuts a long prompt into pieces of a fixed token budget and runs one piece "
    "per step beside one token for every running request, in the same forward pass. The prefill still finishes, "
    "a little later than it would alone, but no running request ever waits for more than one short step, and "
    "every step costs about the same, which makes the time between tokens steady and predictable. The token "
    "budget is the knob: a larger budget finishes prompts sooner and raises throughput, a smaller one keeps the "
    "time between tokens low."
)


def iteration_table(iterations: Sequence[IterationRecord]) -> str:
    """Consecutive iterations of the same shape folded into one row: how each batch mixed work (prefill only,
    decode only, or hybrid: prefill chunks and decodes in one forward pass)."""
    rows: list[list] = []
    for it in iterations:
        shape = (it.num_prefills, it.num_prefill_tokens, it.num_decodes, it.num_preempted)
        if rows and rows[-1][0] == shape:
            rows[-1][2] = it.index
            rows[-1][3].append(it.step_time)
        else:
            rows.append([shape, it.index, it.index, [it.step_time]])
    lines = [f"{'iterations':>12} {'batch':>7} {'prefill chunks':>14} {'prefill tok':>11} {'decodes':>8} "
             f"{'preempt':>7} {'step ms':>8}"]
    for (n_pre, pre_tok, n_dec, n_preempt), first, last, times in rows:
        span = f"{first}" if first == last else f"{first}-{last}"
        kind = "hybrid" if n_pre and n_dec else "prefill" if n_pre else "decode"
        lines.append(f"{span:>12} {kind:>7} {n_pre:>14} {pre_tok:>11} {n_dec:>8} {n_preempt:>7} "
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
    config = engine_config(args, **({} if args.chunk_size is not None else {"chunk_size": DEMO_CHUNK_SIZE}))
    llm = LLM(config=config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    prompts = args.prompts or list(DEFAULT_PROMPTS)
    arrivals = {f"p{i}": (0, p) for i, p in enumerate(prompts)}
    if args.long_prompt:
        arrivals["long"] = (LONG_PROMPT_ARRIVAL, LONG_PROMPT)
    outputs = _run_staggered(llm, arrivals, params, raw=args.raw)
    for rid, (arrival, prompt) in arrivals.items():
        out = outputs[rid]
        shown = prompt if rid != "long" else (f"[{rid}: the built-in long prompt, {len(out.prompt_token_ids)} "
                                              f"tokens, arriving at iteration {arrival}] {prompt[:60]}...")
        print(f"\n>>> {shown}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    stats = llm.stats()
    print(f"\nIterations (policy {config.policy}, chunk_size {config.chunk_size}): one forward pass each; "
          f"hybrid = prefill chunks and decodes in the same pass")
    print(iteration_table(stats.iterations))
    print("\nLatency per request")
    print(latency_table(stats))
    s = stats.summary()
    print(f"\nTTFT p50 {1000 * s['ttft_p50']:.1f} ms | TBT p50 {1000 * s['tbt_p50']:.1f} ms, "
          f"p99 {1000 * s['tbt_p99']:.1f} ms | {s['throughput_output_tokens_per_s']:.1f} output tokens/s")
    print(HOW_TO_READ.format(chunk_size=config.chunk_size))
    return 0


HOW_TO_READ = (
    "How to read it: TTFT (time to first token) is a request's wait from arrival to its first token, i.e. its "
    "whole prefill: the more chunks a prompt needs, the longer (the first step also pays a one-off warm-up). "
    "TBT (time between tokens) is one step of a running request: a chunk beside its decode makes that step "
    "longer (the hybrid rows' step ms), but never as long as a whole prompt's prefill. A larger --chunk-size "
    "(now {chunk_size}) trades TBT for TTFT."
)


def _run_staggered(llm: Any, arrivals: dict[str, tuple[int, str]], params: Any, *, raw: bool) -> dict[str, Any]:
    """Run every prompt of ``arrivals`` (request id -> (iteration it arrives at, text)) to completion on
    ``llm``'s engine, adding each at its iteration (chat-templated unless ``raw``); the final outputs by id."""
    engine = llm.engine
    pending = sorted(arrivals.items(), key=lambda item: item[1][0])
    outputs: dict[str, Any] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (pending[0][1][0] <= step or not engine.has_unfinished_requests()):
            rid, (_, text) = pending.pop(0)
            prompt = text if raw else llm.chat_token_ids([{"role": "user", "content": text}], f"prompt {rid}")
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
    return outputs


def add_generate_parser(sub: Any) -> None:
    """Add ``generate`` to the ``sarathi-lite`` subcommands."""
    gen = sub.add_parser("generate", help="generate text for prompts and show the iterations and TTFT/TBT",
                         description=__doc__)
    gen.add_argument("prompts", nargs="*", help="prompts (default: two built-in ones)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample only from the smallest set of tokens whose probability reaches this (default 1)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: none)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--long-prompt", action=argparse.BooleanOptionalAction, default=True,
                     help=f"add a built-in long prompt that arrives at iteration {LONG_PROMPT_ARRIVAL}, while the "
                          f"given prompts decode, so the table shows it chunked beside their decodes (default: on)")
    add_threads_arg(gen)
    # One thread: this demo's batches (a chunk and a few decodes of a small model) gain little from more, and on a
    # CPU shared with other work every multi-threaded layer waits for the slowest thread (measured: 24-38 s at
    # load 7 with one thread, 172 s with torch's two).
    gen.set_defaults(threads=1)
    set_flag_help(gen, "--threads", "torch CPU threads (default here: 1, steady on a CPU shared with other work; "
                                    "0 for torch's own default)")
    add_engine_args(gen)
    set_flag_help(gen, "--chunk-size", f"the token budget of one iteration: decodes first, then prompt chunks; "
                                       f"an int or auto (default here: {DEMO_CHUNK_SIZE}, small so the long prompt "
                                       f"takes several chunks; the engine's own default is 512)")
    gen.set_defaults(func=cmd_generate)
