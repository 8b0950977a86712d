"""Hugging Face transformers' continuous batching on this CPU, with its own schedulers and with sarathi-lite's.

The same model (SmolLM2-135M, float32, ``attn_implementation="sdpa"``), the same paged cache and the same token
budget ``--budget`` (transformers' ``max_batch_tokens``) for every system; only ``scheduler_type`` differs:

- ``fifo``: transformers' default (decodes first, then prompts mid-prefill, then waiting ones, in arrival order);
- ``prefill_first``: transformers' other scheduler (prompts mid-prefill first);
- ``sarathi``: sarathi-lite's decision (``sarathi_lite.integrations.transformers``) at ``chunk_size=--budget``;
- ``sarathi-auto``: the same with ``chunk_size="auto"`` at ``--tbt-slo`` on ``--cost-model`` (a profile of
  sarathi-lite's own engine on this machine, which the host corrects online with transformers' measured steps).

Online: each request is added to a running ``init_continuous_batching`` manager at its arrival time, and every
token's time is recorded (``record_timestamps``). Workloads: the long-tail mix (every ``--long-every``-th prompt
``--long-prompt`` tokens, the others 32-256, outputs 32-64, Poisson at ``--qps``; ``benchmarks/vllm_plugin.py``'s
``long_tail``), with short and long requests' TTFT apart; and the conversation trace scaled by 1/4 (prompts at
most 1,024 tokens) at ``--conversation-qps``. Systems run in alternating order round by round; the load average
is recorded before every run. The long-tail rounds are also pooled (``vllm_plugin.pooled``).

    python benchmarks/transformers_cb.py            # about 40 minutes on 2 cores under a load average of 7
    python benchmarks/transformers_cb.py --quick    # a check of the script (a few minutes)

Prints a table and writes ``--out`` (JSON: command, date, commit, machine, load averages).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from sarathi_lite.bench.replay import machine
from sarathi_lite.bench.results import commit, portable_arg
from sarathi_lite.bench.workload import Workload
from sarathi_lite.integrations.transformers import register
from sarathi_lite.models import builtin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_plugin import long_tail, pooled  # noqa: E402  the mix and the pooling the vLLM plugin's runs use

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("fifo", "prefill_first", "sarathi", "sarathi-auto")


def scheduler_name(system: str, args: argparse.Namespace) -> str:
    if system == "sarathi":
        return register("sarathi-bench", chunk_size=args.budget)
    if system == "sarathi-auto":
        return register("sarathi-bench-auto", chunk_size="auto", tbt_slo=args.tbt_slo, cost_model=args.cost_model)
    return system


def run_online(model: Any, workload: Workload, prompts: list[list[int]], scheduler: str, args: argparse.Namespace
               ) -> list[dict[str, Any]]:
    """Replay ``workload`` through a continuous-batching manager with ``scheduler``: each request added at its
    arrival time. Returns per request: prompt and output tokens, arrival and token times (seconds from the start)."""
    config = ContinuousBatchingConfig(scheduler_type=scheduler, max_batch_tokens=args.budget, page_size=args.page_size,
                                      num_blocks=args.num_blocks)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in workload.requests),
                           eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    manager.warmup()
    manager.start()
    start = time.perf_counter()

    def send() -> None:
        for spec, prompt in zip(workload.requests, prompts):
            delay = start + spec.arrival_time - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            manager.add_request(prompt, request_id=spec.request_id, max_new_tokens=spec.output_len,
                                record_timestamps=True)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    done: dict[str, Any] = {}
    deadline = time.monotonic() + args.run_timeout
    try:
        while len(done) < len(workload.requests):
            if time.monotonic() > deadline or not manager.is_running():
                raise RuntimeError(f"{scheduler}: {len(done)} of {len(workload.requests)} requests finished")
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                done[out.request_id] = out
    finally:
        sender.join()
        manager.stop(block=True, timeout=30)
    rows = []
    for spec in workload.requests:
        out = done[spec.request_id]
        rows.append({"id": spec.request_id, "prompt": spec.prompt_len, "output": len(out.generated_tokens),
                     "arrival": out.created_time - start, "tokens": [t - start for t in out.timestamps],
                     "error": out.error})
    return rows


def summarize(rows: list[dict[str, Any]], long_threshold: int) -> dict[str, Any]:
    """TTFT (short and long requests apart), TBT and output throughput of one run (seconds, tokens/s)."""
    cells: dict[str, Any] = {"num_requests": len(rows), "errors": sum(r["error"] is not None for r in rows)}
    ttft = {r["id"]: r["tokens"][0] - r["arrival"] for r in rows if r["tokens"]}
    for name, keep in (("short", lambda r: r["prompt"] < long_threshold),
                       ("long", lambda r: r["prompt"] >= long_threshold), ("all", lambda r: True)):
        values = [ttft[r["id"]] for r in rows if r["id"] in ttft and keep(r)]
        if name != "all":
            cells[f"{name}_ttfts"] = [round(t, 4) for t in values]
        if values:
            cells[f"{name}_ttft_p50"] = float(np.percentile(values, 50))
            cells[f"{name}_ttft_p99"] = float(np.percentile(values, 99))
    gaps = [b - a for r in rows for a, b in zip(r["tokens"], r["tokens"][1:])]
    cells["tbt_p50"] = float(np.percentile(gaps, 50)) if gaps else None
    cells["tbt_p99"] = float(np.percentile(gaps, 99)) if gaps else None
    first = min(r["arrival"] for r in rows)
    last = max(r["tokens"][-1] for r in rows if r["tokens"])
    cells["output_tokens"] = sum(r["output"] for r in rows)
    cells["duration_s"] = last - first
    cells["throughput_output_tokens_per_s"] = cells["output_tokens"] / cells["duration_s"]
    return cells


def warm_up(model: Any, vocab: int, args: argparse.Namespace) -> None:
    """Prompts of the step sizes the workloads bring, once, discarded: the CPU kernels pick their primitives on
    first use, and the first system measured must not pay for it alone."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab, n).tolist() for n in (32, 256, 700, min(2000, args.long_prompt), 64)]
    gen = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=-1, pad_token_id=0)
    config = ContinuousBatchingConfig(max_batch_tokens=args.budget, page_size=args.page_size,
                                      num_blocks=args.num_blocks)
    model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config)


def table(rows: list[dict[str, Any]], pooled_cells: dict[str, dict[str, Any]]) -> str:
    def f(v: Any, digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    lines = ["| workload | round | system | short TTFT p50 / p99 (s) | long TTFT p50 / p99 (s) | TBT p99 (s) | "
             "output tok/s | load 1m |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['round']} | {r['system']} | {f(r.get('short_ttft_p50'))} / "
                     f"{f(r.get('short_ttft_p99'))} | {f(r.get('long_ttft_p50'))} / {f(r.get('long_ttft_p99'))} | "
                     f"{f(r['tbt_p99'], 3)} | {f(r['throughput_output_tokens_per_s'])} | {f(r['load_before'])} |")
    lines += ["", "| long-tail, rounds pooled | short TTFT p50 / p99 (s) | long TTFT p50 / p99 (s) | output tok/s |",
              "|---|---|---|---|"]
    for name, c in pooled_cells.items():
        lines.append(f"| {name} | {f(c.get('short_ttft_p50'))} / {f(c.get('short_ttft_p99'))} | "
                     f"{f(c.get('long_ttft_p50'))} / {f(c.get('long_ttft_p99'))} | "
                     f"{f(c['throughput_output_tokens_per_s'])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="*", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--budget", type=int, default=512, help="transformers' max_batch_tokens (and sarathi's chunk)")
    p.add_argument("--tbt-slo", type=float, default=3.0,
                   help="seconds, for sarathi-auto (above the ~2 s every step with prefill takes here)")
    p.add_argument("--cost-model", default=str(ROOT / "benchmarks" / "results" / "sim_profile_smollm2_2026-12-06.json"))
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--num-blocks", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--qps", type=float, default=0.2, help="the long-tail mix's rate (requests/s)")
    p.add_argument("--long-prompt", type=int, default=3000)
    p.add_argument("--long-every", type=int, default=8)
    p.add_argument("--conversation-requests", type=int, default=8)
    p.add_argument("--conversation-qps", type=float, default=0.2)
    p.add_argument("--conversation-rounds", type=int, default=1)
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--quick", action="store_true", help="one round of 8 requests each: a check of the script")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "transformers_cb.json"))
    args = p.parse_args()
    if args.quick:
        args.rounds, args.num_requests, args.conversation_requests = 1, 8, 4
    command = "python " + " ".join(portable_arg(a) for a in sys.argv)
    head, started = commit(), time.time()
    torch.manual_seed(0)
    path = builtin.resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    vocab = model.config.vocab_size
    warm_up(model, vocab, args)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        # the long-tail rounds first (the bar), then the conversation rounds
        plan = [(rnd, "long-tail", long_tail(Path(tmp), rnd, args.num_requests, args.qps, args.long_prompt,
                                             args.long_every)) for rnd in range(args.rounds)]
        plan += [(rnd, "conversation", Workload.from_trace(
            "conversation", num_requests=args.conversation_requests, qps=args.conversation_qps, prompt_scale=0.25,
            output_scale=0.25, max_prompt=1024, max_output=128, seed=rnd)) for rnd in range(args.conversation_rounds)]
        for rnd, wl_name, wl in plan:
            prompts = wl.prompt_token_ids(vocab)
            for system in args.systems[rnd % len(args.systems):] + args.systems[:rnd % len(args.systems)]:
                load = os.getloadavg()[0]
                print(f"round {rnd} {wl_name} {system} (load {load:.2f}) ...", flush=True)
                requests = run_online(model, wl, prompts, scheduler_name(system, args), args)
                rows.append({"workload": wl_name, "round": rnd, "system": system, "load_before": load,
                             **summarize(requests, args.long_prompt)})
                write(args, command, head, started, rows)
    print(table(rows, pooled(rows)))
    print(f"wrote {args.out}")


def write(args: argparse.Namespace, command: str, head: str | None, started: float, rows: list[dict[str, Any]]
          ) -> None:
    """Write the result so far (after every run: a run cut short keeps what it measured)."""
    date = datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="minutes")
    result = {"command": command, "date": date,
              "commit": head, "machine": machine(), "wall_s": round(time.time() - started),
              "transformers": __import__("transformers").__version__,
              "settings": {k: portable_arg(str(v)) if k in ("cost_model", "out") else v for k, v in vars(args).items()},
              "load_average_end": os.getloadavg(), "long_tail_pooled": pooled(rows), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
