"""Async scheduling: what overlapping the CPU's scheduling and output processing with the forward pass buys.

One model (SmolLM2-135M-Instruct by default) loaded once; two engines on its weights (``LLMEngine.from_model``):
``sync`` (the default: schedule, forward, update, one after the other) and ``async`` (``async_scheduling=True``: the
forward pass runs on its own thread, and while batch N runs the engine schedules batch N+1, decodes continued with
their input token filled in from batch N, and processes batch N-1's outputs). The same offline workload (the first
``--num-requests`` rows of the conversation trace, prompts <= ``--max-prompt``, outputs <= ``--max-output``, EOS
ignored) runs on each in ``--rounds`` alternating rounds. Per run: wall time, output tokens/s, iterations, wall time
per iteration, and the host time per iteration outside the forward pass (schedule + update + outputs). Greedy outputs
must be equal (checked).

    python benchmarks/async_scheduling.py --threads 1                 # ~3 minutes on this CPU

Prints a table and writes JSON (default benchmarks/results/async_scheduling.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.bench.results import host

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import load_rows, make_prompts  # noqa: E402


def run(engine: LLMEngine, prompts: list[list[int]], outputs: list[int]) -> tuple[dict, dict[str, list[int]]]:
    engine.reset_stats()
    for i, (prompt, n) in enumerate(zip(prompts, outputs)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens[o.request_id] = o.token_ids
    elapsed = time.perf_counter() - t0
    its = engine.stats().iterations
    forward = sum(it.forward_time + it.prepare_time + it.sample_time for it in its)
    return {"elapsed_s": elapsed, "output_tokens_per_s": sum(outputs) / elapsed, "iterations": len(its),
            "wall_per_iteration_ms": 1e3 * elapsed / len(its),
            "forward_per_iteration_ms": 1e3 * forward / len(its),
            "host_outside_forward_per_iteration_ms": 1e3 * (elapsed - forward) / len(its)}, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/async_scheduling.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = dict(chunk_size=args.chunk_size, device="cpu")
    base = LLMEngine(args.model, **options)
    engines = {"sync": base, "async": LLMEngine.from_model(base, async_scheduling=True, **options)}
    rows = load_rows("conversation", args.num_requests, args.max_prompt, args.max_output)
    prompts = make_prompts(rows, base.model_config.vocab_size, 0)
    outputs = [o for _, o in rows]
    run(base, [p[:16] for p in prompts[:4]], [4] * 4)  # warm-up
    run(engines["async"], [p[:16] for p in prompts[:4]], [4] * 4)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    reference = None
    for r in range(args.rounds):
        for name in (engines if r % 2 == 0 else reversed(engines)):
            load = os.getloadavg()
            result, tokens = run(engines[name], prompts, outputs)
            reference = reference or tokens
            assert tokens == reference, f"{name}: greedy outputs differ from the first run's"
            runs[name].append({"round": r, "loadavg_before": load, **result})
            print(f"round {r} {name:<5} load {load[0]:.2f}: {result['elapsed_s']:.1f} s, "
                  f"{result['output_tokens_per_s']:.1f} out tok/s, {result['iterations']} iterations, "
                  f"{result['wall_per_iteration_ms']:.1f} ms/iteration "
                  f"(host outside forward {result['host_outside_forward_per_iteration_ms']:.2f} ms)", flush=True)
    engines["async"].shutdown()
    ratios = [a["output_tokens_per_s"] / s["output_tokens_per_s"] for a, s in zip(runs["async"], runs["sync"])]
    summary = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0] if k not in ("round", "loadavg_before")}
               for name, rs in runs.items()}
    print(f"\n{len(rows)} conversation requests (prompts <= {args.max_prompt}, outputs <= {args.max_output}), chunk "
          f"{args.chunk_size}, {args.threads} torch thread(s); medians over {args.rounds} alternating rounds")
    print(f"{'engine':<6} {'out tok/s':>9} {'ms/iteration':>12} {'forward ms/it':>13} {'host outside fwd ms/it':>22} "
          f"{'iterations':>10}")
    for name, s in summary.items():
        print(f"{name:<6} {s['output_tokens_per_s']:>9.1f} {s['wall_per_iteration_ms']:>12.1f} "
              f"{s['forward_per_iteration_ms']:>13.1f} {s['host_outside_forward_per_iteration_ms']:>22.2f} "
              f"{s['iterations']:>10.0f}")
    print(f"async / sync throughput per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    report = {"command": "python benchmarks/async_scheduling.py " + " ".join(sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": host(),
              "loadavg_end": os.getloadavg(), "runs": runs, "median": summary,
              "async_over_sync_throughput_per_round": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
