"""One offline run of ``benchmarks/vs_vllm.py`` in a fresh process: our engine (run by this interpreter) or vLLM's
CPU build (run by the vLLM virtual environment's interpreter), on the token-id prompts of a spec file.

    python benchmarks/vs_vllm_worker.py ours|vllm SPEC.json RESULT.json

The spec (written by vs_vllm.py): model folder, dtype, threads, prompts (token ids), output lengths, the engine's
token budget (``None``: its default) and ``max_model_len``. The result: start-up (import, construct to first
request, process start to first request), the timed run's elapsed seconds and output tokens/s, each request's
greedy output token ids, and the versions that ran. Only the standard library is imported at module level, so
either interpreter can load this file; each engine is imported inside its own run.
"""

from __future__ import annotations

import json
import os
import sys
import time

WARM_UP_PROMPT, WARM_UP_TOKENS = 16, 4  # the first request: a short prompt's first tokens (offline_throughput's)


def run_ours(spec: dict) -> dict:
    t0 = time.perf_counter()
    import torch

    from sarathi_lite import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    imported = time.perf_counter()
    options = {"chunk_size": spec["budget"]} if spec["budget"] else {}
    llm = LLM(spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], enable_prefix_caching=False,
              **options)
    constructed = time.perf_counter()
    llm.generate([spec["prompts"][0][:WARM_UP_PROMPT]], SamplingParams(temperature=0.0, max_tokens=WARM_UP_TOKENS),
                 use_tqdm=False)
    first = time.perf_counter()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in spec["outputs"]]
    start = time.perf_counter()
    results = llm.generate(spec["prompts"], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"import_s": imported - t0, "construct_s": constructed - imported, "startup_s": first - imported,
            "first_request_s": first, "elapsed_s": elapsed, "tokens": [list(r.token_ids) for r in results],
            "threads": torch.get_num_threads(), "versions": {"torch": torch.__version__},
            "token_budget": llm.engine.scheduler_config.token_budget,
            "attention_backend": llm.engine.runner.attention_backend}


def run_vllm(spec: dict) -> dict:
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    options = {"max_num_batched_tokens": spec["budget"]} if spec["budget"] else {}
    llm = LLM(spec["model"], dtype=spec["dtype"], enforce_eager=True, seed=0, max_model_len=spec["max_model_len"],
              enable_prefix_caching=False, **options)
    constructed = time.perf_counter()
    llm.generate([{"prompt_token_ids": spec["prompts"][0][:WARM_UP_PROMPT]}],
                 SamplingParams(temperature=0.0, max_tokens=WARM_UP_TOKENS, detokenize=False), use_tqdm=False)
    first = time.perf_counter()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in spec["outputs"]]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    return {"import_s": imported - t0, "construct_s": constructed - imported, "startup_s": first - imported,
            "first_request_s": first, "elapsed_s": elapsed, "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "threads": torch.get_num_threads(), "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
            "token_budget": budget}


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in ("ours", "vllm"):
        sys.exit(f"usage: {sys.argv[0]} ours|vllm SPEC.json RESULT.json (got {sys.argv[1:]})")
    system, spec_path, result_path = sys.argv[1:]
    with open(spec_path) as f:
        spec = json.load(f)
    result = (run_ours if system == "ours" else run_vllm)(spec)
    # first_request_s so far is a perf_counter reading: make it the time from the process's launch (the spec's
    # wall-clock "launched", taken just before the parent started this process) to the first request's answer
    result["process_s"] = time.time() - (time.perf_counter() - result.pop("first_request_s")) - spec["launched"]
    lengths = [len(t) for t in result["tokens"]]
    if lengths != spec["outputs"]:
        sys.exit(f"{system}: output lengths {lengths} differ from the requested {spec['outputs']}")
    result["output_tokens_per_s"] = sum(lengths) / result["elapsed_s"]
    result["pid"] = os.getpid()
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
