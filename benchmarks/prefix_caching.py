"""Prefix caching on a multi-turn chat workload: the same conversations served with the cache off and on.

Workload: ``Workload.conversations`` on the conversation trace (one trace row per turn: the user's message and
the reply length), ``--turns`` turns each, every prompt starting with one shared ``--system-prompt``, turn k
resending turns 1 .. k-1. Lengths are scaled down (``--prompt-scale``, ``--output-scale``, clipped) so that both
runs take a few minutes on a CPU.

Closed loop, as a chat client does: ``--conversations`` chats run at once, each sending its next turn as soon
as the previous reply is complete (so turn k can find turn k-1's prompt cached). TTFT counts from when a turn is
sent; throughput is (prompt + output tokens) over the run's span. Both configurations share one model (weights
loaded once), run one after the other in this process on one torch thread, and are compared as ratios.

    python benchmarks/prefix_caching.py                       # SmolLM2-135M, ~3 minutes on this CPU
    python benchmarks/prefix_caching.py --conversations 4 --out /tmp/prefix_caching.json

Prints a table (TTFT p50/p99, TBT p50/p99, throughput, cached prompt tokens) and writes it, with the machine,
the load average before and after each run and the settings, as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.bench.replay import machine, warm_up
from sarathi_lite.bench.workload import Workload


def serve(engine: LLMEngine, workload: Workload, turns: int) -> dict[str, Any]:
    """Serve every conversation of ``workload`` closed-loop: all first turns at once, each later turn when the
    turn before it has finished. Returns the run's summary and the load average around it."""
    prompts = dict(zip((r.request_id for r in workload.requests),
                       workload.prompt_token_ids(engine.model_config.vocab_size)))
    specs = {r.request_id: r for r in workload.requests}
    conversations = sorted({rid.rsplit("-turn-", 1)[0] for rid in specs})

    def send(conv: str, turn: int) -> None:
        rid = f"{conv}-turn-{turn}"
        engine.add_request(rid, prompts[rid], SamplingParams(temperature=0.0, max_tokens=specs[rid].output_len,
                                                             ignore_eos=True))

    engine.reset_stats()
    load_start = os.getloadavg()
    for conv in conversations:
        send(conv, 1)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                conv, turn = out.request_id.rsplit("-turn-", 1)
                if int(turn) < turns:
                    send(conv, int(turn) + 1)
    summary = engine.stats().summary()
    summary["load_average_start"] = list(load_start)
    summary["load_average_end"] = list(os.getloadavg())
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="built-in name (default smollm2-135m) or checkpoint folder")
    parser.add_argument("--conversations", type=int, default=6, help="chats served at once")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompt", type=int, default=256, help="shared system prompt (tokens)")
    parser.add_argument("--start", type=int, default=1000, help="first trace row")
    parser.add_argument("--prompt-scale", type=float, default=0.05, help="scale of each user message's length")
    parser.add_argument("--output-scale", type=float, default=0.25, help="scale of each reply's length")
    parser.add_argument("--max-prompt", type=int, default=128, help="clip each user message (tokens)")
    parser.add_argument("--max-output", type=int, default=32, help="clip each reply (tokens)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/prefix_caching.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    workload = Workload.conversations(
        "conversation", num_conversations=args.conversations, turns=args.turns, system_prompt=args.system_prompt,
        turn_gap=0.0, start=args.start, prompt_scale=args.prompt_scale, output_scale=args.output_scale,
        max_prompt=args.max_prompt, max_output=args.max_output, seed=args.seed)
    print(f"workload: {workload.describe()} (arrivals: closed loop)", flush=True)
    off = LLMEngine(args.model, chunk_size=args.chunk_size, enable_prefix_caching=False)
    on = LLMEngine.from_model(off, chunk_size=args.chunk_size, enable_prefix_caching=True)
    rows = {}
    for label, engine in (("off", off), ("on", on)):
        warm_up(engine)
        rows[label] = serve(engine, workload, args.turns)
        s = rows[label]
        print(f"caching {label}: {s['num_requests']} turns in {s['duration']:.1f} s, load average "
              f"{s['load_average_start'][0]:.2f} -> {s['load_average_end'][0]:.2f}", flush=True)

    metrics = [("TTFT p50 s", "ttft_p50", False), ("TTFT p99 s", "ttft_p99", False),
               ("TBT p50 s", "tbt_p50", False), ("TBT p99 s", "tbt_p99", False),
               ("throughput tok/s", "throughput_tokens_per_s", True),
               ("output tok/s", "throughput_output_tokens_per_s", True),
               ("cached prompt tokens", "cached_prompt_tokens", True), ("run s", "duration", False)]
    print(f"\n{'':<22}{'off':>12}{'on':>12}{'on vs off':>12}")
    ratios = {}
    for name, key, higher_better in metrics:
        a, b = rows["off"][key], rows["on"][key]
        ratio = (b / a if higher_better else a / b) if a and b else None
        ratios[key] = ratio
        print(f"{name:<22}{a:>12.3f}{b:>12.3f}" + (f"{ratio:>11.2f}x" if ratio else f"{'-':>12}"))
    print("(on vs off: how many times better with caching: off/on for times, on/off for rates)")
    print(f"prefix-cache hit rate (cached / prompt tokens): {rows['on']['prefix_cache_hit_rate']:.2f}")

    result = {
        "benchmark": "prefix_caching",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "machine": machine(),
        "model": off.model_path.name,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "workload": workload.describe(),
        "off": rows["off"], "on": rows["on"], "improvement": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
