"""What rank 0 sends the other tensor-parallel ranks each step, in pickled bytes, and the TP=2 step time.

A TP=2 engine on CPU (gloo) runs ``--requests`` requests (prompts of ``--min-prompt`` to ``--max-prompt`` tokens,
``--max-tokens`` output tokens each, all added at once) on SmolLM2-135M's shape with 8 query heads and random
weights (SmolLM2's 9 heads do not split over 2 ranks). Every object rank 0 broadcasts on the control group is
pickled once more here to count its bytes; the step time is the median of the engine's own iteration records
(``end_time - start_time``). Prints one JSON object.

    PYTHONPATH=. python3 benchmarks/tp_step_messages.py    # from the checkout root: this checkout's code
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch.distributed as dist

from sarathi_lite import LLMEngine, SamplingParams
from sarathi_lite.models.builtin import resolve_model


def _eight_head_shape(folder: Path) -> Path:
    """SmolLM2-135M's config with 8 query heads of 64 and 2 KV heads, so that it splits over 2 ranks."""
    cfg = json.loads((resolve_model(None) / "config.json").read_text())
    cfg.update(num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _count_broadcasts(sizes: list[int]) -> None:
    """Record the pickled size of every object list rank 0 broadcasts (the steps to the workers)."""
    broadcast = dist.broadcast_object_list

    def counting(object_list, src=0, group=None, device=None):
        if dist.get_rank() == 0 and object_list[0] is not None:
            sizes.append(len(pickle.dumps(object_list[0])))
        return broadcast(object_list, src=src, group=group, device=device)

    dist.broadcast_object_list = counting


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=100)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=256)
    args = ap.parse_args()
    sizes: list[int] = []
    _count_broadcasts(sizes)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        engine = LLMEngine(_eight_head_shape(Path(tmp)), tensor_parallel_size=2, device="cpu", load_format="dummy",
                           chunk_size=args.chunk_size, num_kv_blocks=1024, attention_backend="torch")
        try:
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            for i in range(args.requests):
                n = rng.randint(args.min_prompt, args.max_prompt)
                engine.add_request(f"r{i}", [rng.randrange(100, 40000) for _ in range(n)], params)
            while engine.has_unfinished_requests():
                engine.step()
            its = engine.stats().iterations
        finally:
            engine.shutdown()
    steps = [it.end_time - it.start_time for it in its]
    decodes = [it.end_time - it.start_time for it in its if not it.num_prefills]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({
        "commit": commit, "loadavg": Path("/proc/loadavg").read_text().split()[:3], "cpus": os.cpu_count(),
        "steps": len(its), "messages": len(sizes), "bytes_total": sum(sizes),
        "bytes_per_step_mean": sum(sizes) / len(sizes), "bytes_per_step_median": statistics.median(sizes),
        "bytes_max": max(sizes), "step_ms_median": 1e3 * statistics.median(steps),
        "decode_step_ms_median": 1e3 * statistics.median(decodes), "args": vars(args)}))


if __name__ == "__main__":
    main()
