"""Where one engine step's time goes at a given concurrency: scheduling, input preparation, the forward pass,
sampling, and the rest (scheduler update, outputs, metrics).

    python benchmarks/step_profile.py                    # SmolLM2, 32 requests from the conversation trace
    python benchmarks/step_profile.py --torch-profile    # also the top torch ops of one hybrid step

Requests come from the first rows of the trace (prompts clipped to --max-prompt, outputs to --max-output, EOS
ignored); every step of the run is measured, split into decode-only and hybrid (prefill + decode) steps. Prints a
table and writes JSON (default results/step_profile.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.bench.traces import trace_path

PARTS = ("schedule", "prepare", "forward", "sample", "update")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--trace", default="conversation", help="built-in trace name or CSV path")
    ap.add_argument("--torch-profile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("results/step_profile.json"))
    args = ap.parse_args()

    import csv
    import random

    with open(trace_path(args.trace)) as f:
        rows = list(csv.DictReader(f))[:args.num_requests]
    engine = LLMEngine(args.model, chunk_size=args.chunk_size, max_num_seqs=args.num_requests, dtype=args.dtype)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for i, r in enumerate(rows):
        prompt = [rng.randrange(100, vocab) for _ in range(min(int(r["num_prefill_tokens"]), args.max_prompt))]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                           max_tokens=min(int(r["num_decode_tokens"]),
                                                                          args.max_output)))
    samples: dict[str, list[dict[str, float]]] = {"decode-only": [], "hybrid": [], "prefill-only": []}
    profiled = profiled_result = None
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        hybrid = out.num_prefills and out.num_decodes
        if args.torch_profile and hybrid and profiled is None:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                result = profiled_result = engine._run(out)
            profiled = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        else:
            result = engine._run(out)
        t2 = time.perf_counter()
        engine._postprocess(out, result, t0, t1)
        t3 = time.perf_counter()
        if profiled is not None and result is profiled_result:
            continue  # the profiler's own cost would skew this step
        kind = "hybrid" if hybrid else "prefill-only" if out.num_prefills else "decode-only"
        samples[kind].append({"schedule": t1 - t0, "prepare": result.prepare_time, "forward": result.forward_time,
                              "sample": result.sample_time,
                              "update": (t3 - t2) + (t2 - t1 - result.prepare_time - result.forward_time
                                                     - result.sample_time),
                              "batch": out.num_decodes + out.num_prefills})
    print(f"\n{args.num_requests} requests, chunk_size {args.chunk_size}, dtype {engine.dtype}, "
          f"{torch.get_num_threads()} threads; mean ms per step")
    print(f"{'steps':<14} {'n':>4} {'batch':>6} " + " ".join(f"{p:>9}" for p in PARTS) + f" {'total':>9} "
          f"{'non-model':>9}")
    report = {}
    for kind, rows_ in samples.items():
        if not rows_:
            continue
        mean = {p: 1000 * float(np.mean([r[p] for r in rows_])) for p in PARTS}
        total = sum(mean.values())
        non_model = (total - mean["forward"]) / total
        batch = float(np.mean([r["batch"] for r in rows_]))
        report[kind] = {"steps": len(rows_), "mean_batch": batch, "ms": mean, "total_ms": total,
                        "non_model_fraction": non_model}
        print(f"{kind:<14} {len(rows_):>4} {batch:>6.1f} " + " ".join(f"{mean[p]:>9.2f}" for p in PARTS)
              + f" {total:>9.1f} {100 * non_model:>8.1f}%")
    print("forward = the model and the logits of sampling rows; non-model = everything else (scheduling, "
          "input preparation, sampling, update and outputs)")
    if profiled:
        print("\nTop torch ops of one hybrid step:\n" + profiled)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.processor(),
                                    "threads": torch.get_num_threads(), "args": {k: str(v) for k, v in
                                                                                 vars(args).items()},
                                    "steps": report}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
