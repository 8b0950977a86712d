"""A real pipeline-parallel run on this CPU: SmolLM2 at pipeline_parallel_size 2 (two processes, gloo point-to-point)
against 1, on the same offline workload, with the measured bubble fraction beside the simulator's prediction.

Workload: the first ``--num-requests`` rows of the conversation trace (prompts <= ``--max-prompt``, outputs <=
``--max-output``, EOS ignored), all at once. Each engine runs it in ``--rounds`` alternating rounds; per run: wall
time, output tokens/s, iterations, and (PP=2) the bubble fraction from the iteration records' per-stage busy time.
The prediction: the same workload in the simulator with the profiled SmolLM2 cost model split over 2
stages (``PipelineCostModel``).

    python benchmarks/pipeline_real.py --threads 1

Prints a table and writes JSON (default benchmarks/results/pipeline_real.json).
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
from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import load_cost_model
from sarathi_lite.costs.pipeline import PipelineCostModel, head_layer_units
from sarathi_lite.sim import simulator as sim

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import load_rows, make_prompts  # noqa: E402

PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sim_profile_smollm2.json"


def run(engine: LLMEngine, prompts: list[list[int]], outputs: list[int], keep_prefix_cache: bool = False
        ) -> tuple[dict, dict[str, list[int]]]:
    engine.reset_stats()
    if not keep_prefix_cache:
        engine.reset_prefix_cache()  # every round the same work: no prompt found cached from the round before
    for i, (prompt, n) in enumerate(zip(prompts, outputs)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens[o.request_id] = o.token_ids
    elapsed = time.perf_counter() - t0
    s = engine.stats().summary()
    return {"elapsed_s": elapsed, "output_tokens_per_s": sum(outputs) / elapsed,
            "iterations": s["num_iterations"], "bubble_fraction": s.get("bubble_fraction"),
            "stage_busy": s.get("stage_busy"), "stage_idle": s.get("stage_idle"),
            "tbt_p50": s["tbt_p50"], "ttft_p50": s["ttft_p50"]}, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="keep the prompts cached between rounds: after the first, every prompt is one cached hit, "
                         "all requests start decoding in the same iteration (decodes that become ready together)")
    ap.add_argument("--balance", choices=("on", "off"), default="on",
                    help="balance_micro_batches of every engine")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline_real.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    options = dict(chunk_size=args.chunk_size, device="cpu", num_kv_blocks=1024,
                   balance_micro_batches=args.balance == "on")
    engines = {"pp1": LLMEngine(**options), "pp2": LLMEngine(pipeline_parallel_size=2, **options)}
    # (engine, torch threads of this process): PP=2 uses two processes of --threads each, so PP=1 runs both with
    # --threads (one core) and with twice that (the same cores as PP=2, split by intra-op parallelism instead)
    setups = {"pp1": ("pp1", args.threads), f"pp1_{2 * args.threads}threads": ("pp1", 2 * args.threads),
              "pp2": ("pp2", args.threads)}
    rows = load_rows("conversation", args.num_requests, args.max_prompt, args.max_output)
    prompts = make_prompts(rows, engines["pp1"].model_config.vocab_size, 0)
    outputs = [o for _, o in rows]
    for engine in engines.values():
        run(engine, [p[:16] for p in prompts[:2]], [2, 2])  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    reference = None
    try:
        for r in range(args.rounds):
            for name in (setups if r % 2 == 0 else reversed(setups)):
                load = os.getloadavg()
                engine_name, threads = setups[name]
                torch.set_num_threads(threads)
                result, tokens = run(engines[engine_name], prompts, outputs, args.keep_prefix_cache)
                reference = reference or tokens
                assert tokens == reference, f"{name}: greedy outputs differ"
                runs[name].append({"round": r, "loadavg_before": load, "threads": threads, **result})
                print(f"round {r} {name} load {load[0]:.2f}: {result['elapsed_s']:.1f} s, "
                      f"{result['output_tokens_per_s']:.1f} out tok/s, bubble {result['bubble_fraction']}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    # the same trace rows, all arriving at once (prompt ids differ from the real run's; no prefix is shared)
    workload = Workload.from_trace("conversation", num_requests=args.num_requests, qps=1e6,
                                   max_prompt=args.max_prompt, max_output=args.max_output)
    model = engines["pp1"].model_config
    predictions = {}
    for name, head in (("layers_only", 0.0), ("with_lm_head", head_layer_units(model))):
        cost = PipelineCostModel(load_cost_model(str(PROFILE)), 2, num_layers=model.num_layers,
                                 head_layers=head)
        config = sim.scheduler_config(cost, "sarathi", args.chunk_size, num_kv_blocks=1024)
        summary = sim.simulate(workload, cost, config).summary()
        predictions[name] = {"head_layers": head, **{k: summary.get(k) for k in (
            "bubble_fraction", "stage_busy", "stage_idle", "throughput_tokens_per_s")}}
    median = {name: {k: statistics.median(x[k] for x in rs) for k in ("output_tokens_per_s", "bubble_fraction")
                     if rs[0][k] is not None} for name, rs in runs.items()}
    print(f"\nmedian: {median}")
    for name, p in predictions.items():
        print(f"simulated PP=2 bubble fraction ({name}, head_layers {p['head_layers']:.2f}): "
              f"{p['bubble_fraction']:.3f}")
    report = {"command": "python benchmarks/pipeline_real.py " + " ".join(sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": host(),
              "loadavg_end": os.getloadavg(), "runs": runs, "median": median,
              "simulated_pp2": predictions}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
