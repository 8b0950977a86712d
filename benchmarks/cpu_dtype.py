"""bfloat16 against float32 on this CPU: what ``dtype="auto"`` should pick here.

Loads the embedded SmolLM2-135M-Instruct once per dtype and times, in alternating rounds (A B A B ...), a
prefill-only step of one prompt and decode-only steps of 1, 8 and 32 running requests (median milliseconds per
step over each round's steps), with the sarathi scheduler on the CPU attention backend. The ratio is bfloat16's
time over float32's per round; the table gives each figure's median over rounds.

    python benchmarks/cpu_dtype.py                       # 3 rounds, ~2 minutes on a 2-core VM
    python benchmarks/cpu_dtype.py --rounds 5 --out /tmp/cpu_dtype.json

Prints a table and writes JSON with the machine (CPU model, torch's CPU capability, load average), the command,
the date and the commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.models.parallel import cpu_packs

DTYPES = ("float32", "bfloat16")
PROMPT = 256
DECODES = (1, 8, 32)
DECODE_STEPS = 16


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _step_ms(engine: LLMEngine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return (time.perf_counter() - t0) * 1e3


def one_round(engine: LLMEngine, tag: str) -> dict[str, float]:
    """Median ms of a PROMPT-token prefill step and of decode steps at each batch size in DECODES."""
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    row: dict[str, float] = {}
    engine.add_request(f"{tag}-p", list(range(10, 10 + PROMPT)), params)
    row[f"prefill_{PROMPT}"] = _step_ms(engine)
    engine.abort_request(f"{tag}-p")
    for n in DECODES:
        for i in range(n):
            engine.add_request(f"{tag}-{n}-{i}", [10 + i, 11, 12, 13], params)
        while _prefilling(engine):
            engine.step()
        times = [_step_ms(engine) for _ in range(DECODE_STEPS)]
        row[f"decode_{n}"] = statistics.median(times)
        for i in range(n):
            engine.abort_request(f"{tag}-{n}-{i}")
    return row


def _prefilling(engine: LLMEngine) -> bool:
    sched = engine.scheduler
    return bool(sched.waiting) or any(r.num_computed_tokens < r.num_prefill_tokens for r in sched.running)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per dtype")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "cpu_dtype.json",
                    help="where the JSON goes")
    args = ap.parse_args()
    engines = {d: LLMEngine("smollm2-135m", dtype=d, chunk_size=512, max_num_seqs=64) for d in DTYPES}
    for d in DTYPES:  # warm-up: oneDNN primitives, the compiled kernel
        one_round(engines[d], f"warm-{d}")
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        rounds.append({d: one_round(engines[d], f"r{r}-{d}") for d in DTYPES})
    keys = list(rounds[0][DTYPES[0]])
    summary = {k: {d: statistics.median(x[d][k] for x in rounds) for d in DTYPES} for k in keys}
    for k in keys:
        summary[k]["ratio_bf16_over_fp32"] = statistics.median(x["bfloat16"][k] / x["float32"][k] for x in rounds)
    print(f"{'step':>14} {'float32 ms':>11} {'bfloat16 ms':>12} {'bf16/fp32':>10}")
    for k in keys:
        s = summary[k]
        print(f"{k:>14} {s['float32']:>11.1f} {s['bfloat16']:>12.1f} {s['ratio_bf16_over_fp32']:>10.2f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": {"cpu": _cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(),
                    "cores": os.cpu_count(), "loadavg": os.getloadavg(), "torch": torch.__version__,
                    "packs": {d: cpu_packs(getattr(torch, d)) for d in DTYPES}},
        "rounds": rounds,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
