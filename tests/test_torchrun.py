"""Ranks launched by ``torchrun`` (as on several machines) instead of spawned: PP=2 and TP=2 x PP=2 over gloo on
this CPU, every rank a process of its own, give rank 0 the same greedy tokens as one process, and every rank
exits by itself when rank 0 shuts the engine down. Loopback only, bounded by a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sarathi_lite import LLMEngine, SamplingParams

from .live_server import free_port

SCRIPT = textwrap.dedent('''
    import json, os, sys
    from sarathi_lite import LLMEngine, SamplingParams

    path, pp, tp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    engine = LLMEngine(path, pipeline_parallel_size=pp, tensor_parallel_size=tp, device="cpu",
                       attention_backend="torch", num_kv_blocks=64, chunk_size=16)
    assert os.environ["RANK"] == "0"  # the other ranks serve inside LLMEngine(...) and exit there
    for i, prompt in enumerate(json.loads(sys.argv[5])):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tokens = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                tokens[o.request_id] = o.token_ids
    engine.shutdown()
    with open(out, "w") as f:
        json.dump(tokens, f)
''')
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [30, 31, 32], [40, 41, 42, 43]]


@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)])
def test_torchrun_ranks_give_rank_0_the_tokens_of_one_process(tiny_checkpoints, tmp_path, pp, tp):
    path = tiny_checkpoints["llama"]
    ref = LLMEngine(path, device="cpu", attention_backend="torch", num_kv_blocks=64, chunk_size=16)
    for i, prompt in enumerate(PROMPTS):
        ref.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    expected = {}
    while ref.has_unfinished_requests():
        for o in ref.step():
            if o.finished:
                expected[o.request_id] = o.token_ids
    script, out = tmp_path / "run.py", tmp_path / "tokens.json"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={pp * tp}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(script), str(path), str(pp), str(tp), str(out), json.dumps(PROMPTS)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]  # every rank exited 0: the workers stopped by themselves
    assert json.loads(out.read_text()) == expected
