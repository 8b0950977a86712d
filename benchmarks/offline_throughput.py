"""Offline throughput: sarathi-lite vs Hugging Face ``generate`` in static batches, same model, same process.

Workload: the first N rows of the Azure conversation trace (prompt and output lengths), prompts clipped to
--max-prompt tokens and outputs to --max-output, random prompt token ids (seeded), EOS ignored so every request
produces exactly its trace length. Hugging Face runs static batches of --hf-batch requests (left-padded); a
batch runs until its longest output, and only each request's own output tokens count.

    python benchmarks/offline_throughput.py                  # SmolLM2-135M on this CPU, 32 requests
    python benchmarks/offline_throughput.py --skip-hf        # ours only

Prints a table and writes JSON (default results/offline_throughput.json).
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import random
import time
from pathlib import Path

import torch

from sarathi_lite import LLM, SamplingParams
from sarathi_lite.bench.traces import trace_label, trace_path


def load_rows(trace: str, n: int, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    with open(trace_path(trace)) as f:
        rows = list(csv.DictReader(f))[:n]
    return [(min(int(r["num_prefill_tokens"]), max_prompt), min(int(r["num_decode_tokens"]), max_output))
            for r in rows]


def make_prompts(rows: list[tuple[int, int]], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(p)] for p, _ in rows]


def run_ours(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.engine.reset_stats()
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    assert [len(r.token_ids) for r in results] == outputs
    s = llm.stats().summary()
    its = llm.stats().iterations
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": sum(outputs) / elapsed,
        "total_tokens_per_s": (sum(outputs) + sum(map(len, prompts))) / elapsed,
        "iterations": len(its),
        "ttft_p50_s": s["ttft_p50"], "ttft_p90_s": s["ttft_p90"], "ttft_p99_s": s["ttft_p99"],
        "tbt_p50_s": s["tbt_p50"], "tbt_p90_s": s["tbt_p90"], "tbt_p99_s": s["tbt_p99"],
        "mean_schedule_ms": 1000 * sum(it.schedule_time for it in its) / len(its),
        "mean_step_ms": 1000 * sum(it.step_time for it in its) / len(its),
    }


@torch.inference_mode()
def run_hf(path: Path, prompts: list[list[int]], outputs: list[int], batch: int, device: torch.device,
           dtype: torch.dtype, dummy: bool) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy:  # random weights of the checkpoint's shape: speed only
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    pad = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        n = max(outputs[start:start + batch])
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=pad)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "output_tokens_per_s": sum(outputs) / elapsed,
            "total_tokens_per_s": (sum(outputs) + sum(map(len, prompts))) / elapsed, "batch_size": batch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--trace", default="conversation", help="built-in trace name or CSV path")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--scheduler", default="sarathi")
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/offline_throughput.json"))
    args = ap.parse_args()

    rows = load_rows(args.trace, args.num_requests, args.max_prompt, args.max_output)
    llm = LLM(args.model, scheduler=args.scheduler, chunk_size=args.chunk_size, device=args.device,
              dtype=args.dtype, load_format=args.load_format)
    prompts = make_prompts(rows, llm.engine.model_config.vocab_size, args.seed)
    outputs = [o for _, o in rows]
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    ours = run_ours(llm, prompts, outputs)
    hf = None if args.skip_hf else run_hf(llm.engine.model_path, prompts, outputs, args.hf_batch,
                                          llm.engine.device, llm.engine.dtype, args.load_format == "dummy")
    print(f"\n{len(rows)} requests, {sum(map(len, prompts))} prompt + {sum(outputs)} output tokens "
          f"({trace_label(args.trace)}, prompts <= {args.max_prompt}, outputs <= {args.max_output}, EOS ignored)")
    print(f"{'system':<34} {'time s':>8} {'out tok/s':>10} {'all tok/s':>10}")
    label = f"sarathi-lite {args.scheduler} chunk {args.chunk_size}"
    print(f"{label:<34} {ours['elapsed_s']:>8.1f} {ours['output_tokens_per_s']:>10.1f} "
          f"{ours['total_tokens_per_s']:>10.1f}")
    if hf:
        print(f"{'HF generate, static batch ' + str(args.hf_batch):<34} {hf['elapsed_s']:>8.1f} "
              f"{hf['output_tokens_per_s']:>10.1f} {hf['total_tokens_per_s']:>10.1f}")
        print(f"speed-up: {ours['output_tokens_per_s'] / hf['output_tokens_per_s']:.2f}x")
    print(f"ours: TTFT p50/p90/p99 {ours['ttft_p50_s']:.2f}/{ours['ttft_p90_s']:.2f}/{ours['ttft_p99_s']:.2f} s, "
          f"TBT p50/p90/p99 {1000 * ours['tbt_p50_s']:.0f}/{1000 * ours['tbt_p90_s']:.0f}/"
          f"{1000 * ours['tbt_p99_s']:.0f} ms, {ours['iterations']} iterations, "
          f"scheduling {ours['mean_schedule_ms']:.2f} ms of {ours['mean_step_ms']:.1f} ms per step")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {torch.get_num_threads()} "
              f"threads, {platform.processor() or platform.system()}", "device": str(llm.engine.device),
              "model": str(llm.engine.model_path), "args": {k: str(v) for k, v in vars(args).items()},
              "ours": ours, "hf": hf,
              "speedup": None if not hf else ours["output_tokens_per_s"] / hf["output_tokens_per_s"]}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
