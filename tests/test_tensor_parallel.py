"""Tensor parallelism: the shards add up to the model, TP=2 (two gloo processes on CPU) generates what TP=1 and
Hugging Face do, and the worker processes never outlive the engine or hang it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sarathi_lite import LLMEngine
from sarathi_lite.engine import worker
from sarathi_lite.models.config import ModelConfig, check_tensor_parallel
from sarathi_lite.models.loader import load_model
from sarathi_lite.models.parallel import TensorParallel
from sarathi_lite.scheduler import make_scheduler

from .conftest import TINY, HFReference
from .parity import LOGPROB_ATOL, NEAR_TIE, assert_matches_hf, run_staggered, workload

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tp_checkpoints(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama (4 query heads, 2 KV heads: split), Qwen2 (biases, tied embeddings) and a multi-query
    Llama (1 KV head: replicated on both ranks) with an odd vocabulary (321: the last rank's rows are padded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tp") / "mqa"
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_key_value_heads": 1, "vocab_size": 321}))
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return {"llama": tiny_checkpoints["llama"], "qwen2": tiny_checkpoints["qwen2"], "mqa": path}


# ---------------------------------------------------------------- sharding, no processes


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mqa"])
def test_each_ranks_shard_concatenated_equals_the_full_tensor(tp_checkpoints, kind):
    full = load_model(tp_checkpoints[kind], torch.float32, CPU)
    ranks = [load_model(tp_checkpoints[kind], torch.float32, CPU, tp=TensorParallel(r, 2)) for r in range(2)]
    cfg, d = full.config, full.config.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    for i, layer in enumerate(full.model.layers):
        shards = [m.model.layers[i] for m in ranks]
        for part, (start, size) in enumerate([(0, q), (q, kv), (q + kv, kv)]):
            names = ["weight", "bias"] if cfg.attention_bias else ["weight"]
            for name in names:
                whole = getattr(layer.self_attn.qkv_proj, name).narrow(0, start, size)
                local = [getattr(s.self_attn.qkv_proj, name) for s in shards]
                offsets = [(0, s.self_attn.q_size) if part == 0 else
                           (s.self_attn.q_size + (part - 1) * s.self_attn.kv_size, s.self_attn.kv_size)
                           for s in shards]
                pieces = [t.narrow(0, o, n) for t, (o, n) in zip(local, offsets)]
                if part and cfg.num_kv_heads < 2:  # replicated KV head: every rank holds all of it
                    assert all(torch.equal(p, whole) for p in pieces)
                else:
                    assert torch.equal(torch.cat(pieces), whole)
        assert torch.equal(torch.cat([s.self_attn.o_proj.weight for s in shards], dim=1), layer.self_attn.o_proj.weight)
        inter = cfg.intermediate_size
        for part in range(2):
            pieces = [s.mlp.gate_up_proj.weight.narrow(0, part * inter // 2, inter // 2) for s in shards]
            assert torch.equal(torch.cat(pieces), layer.mlp.gate_up_proj.weight.narrow(0, part * inter, inter))
        assert torch.equal(torch.cat([s.mlp.down_proj.weight for s in shards], dim=1), layer.mlp.down_proj.weight)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert all(torch.equal(getattr(s, norm).weight, getattr(layer, norm).weight) for s in shards)
    for name in ("embed_tokens", "lm_head"):
        module = (lambda m: m.model.embed_tokens) if name == "embed_tokens" else (lambda m: m.lm_head)
        cat = torch.cat([module(m).weight[:module(m).stop - module(m).start] for m in ranks])
        assert torch.equal(cat, module(full).weight)
    if cfg.tie_word_embeddings:
        assert all(m.lm_head.weight is m.model.embed_tokens.weight for m in ranks)


def test_shapes_that_do_not_split_are_refused_with_the_numbers():
    def cfg(**kw) -> ModelConfig:
        base = dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=160, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64)
        return ModelConfig(**{**base, **kw})

    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        check_tensor_parallel(cfg(), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and num_key_value_heads=3"):
        check_tensor_parallel(cfg(num_heads=6, num_kv_heads=3, head_dim=8), 2)
    with pytest.raises(ValueError, match="does not divide intermediate_size=161"):
        check_tensor_parallel(cfg(intermediate_size=161), 2)
    check_tensor_parallel(cfg(num_heads=8, num_kv_heads=2, head_dim=8), 8)  # 2 KV heads, each on 4 ranks


def test_bad_tensor_parallel_size_errors_before_any_process_starts(tp_checkpoints, monkeypatch):
    def no_start(*args, **kwargs):
        raise AssertionError("worker processes were started")

    monkeypatch.setattr(worker.WorkerGroup, "start", no_start)
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be a positive integer"):
        LLMEngine(tp_checkpoints["llama"], tensor_parallel_size=0, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLMEngine(tp_checkpoints["llama"], tensor_parallel_size=3, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="tensor_parallel_size=2 exceeds the 0 CUDA device"):
            worker.check_parallel_config(ModelConfig.from_pretrained(tp_checkpoints["llama"]), 2,
                                         torch.device("cuda"))


# ---------------------------------------------------------------- one layer, two processes


def _layer_rank(rank: int, port: int, path: str, results) -> None:
    """Rank ``rank`` of 2: this rank's shard of layer 0's MLP and attention output projection, the embedding and
    the LM head, run with real all-reduces / gathers, against the unsharded model in the same process."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        tp = TensorParallel(rank, 2)
        full = load_model(path, torch.float32, CPU)
        shard = load_model(path, torch.float32, CPU, tp=tp)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, full.config.hidden_size, generator=gen)
        ids = torch.randint(0, full.config.vocab_size, (7,), generator=gen)
        with torch.no_grad():
            mlp = (shard.model.layers[0].mlp(x) - full.model.layers[0].mlp(x)).abs().max()
            attn_in = torch.randn(5, full.config.num_heads * full.config.head_dim, generator=gen)
            o = shard.model.layers[0].self_attn.o_proj
            o_full = full.model.layers[0].self_attn.o_proj(attn_in)
            o_err = (o(attn_in[:, o.start:o.start + o.size]) - o_full).abs().max()
            emb = (shard.model.embed_tokens(ids) - full.model.embed_tokens(ids)).abs().max()
            logits = shard.compute_logits(x)
        head = None if logits is None else float((logits - full.compute_logits(x)).abs().max())
        results.put((rank, float(mlp), float(o_err), float(emb), head))
    finally:
        dist.destroy_process_group()


def test_all_reduced_forward_of_one_layer_equals_the_unsharded_layer(tp_checkpoints):
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = worker.free_port()
    procs = [ctx.Process(target=_layer_rank, args=(r, port, str(tp_checkpoints["qwen2"]), results))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    got = sorted(results.get() for _ in range(2))
    for rank, mlp, o_err, emb, head in got:
        assert mlp < 1e-5 and o_err < 1e-5 and emb == 0.0  # the sum of partial products, float32 rounding only
        assert (head is not None) == (rank == 0)  # only rank 0 receives the logits
    assert got[0][4] < 1e-5


# ---------------------------------------------------------------- the engine at TP=2 vs TP=1 and Hugging Face


def _use_scheduler(engine: LLMEngine, policy: str, chunk_size: int) -> None:
    """Give ``engine`` a fresh scheduler with another policy and chunk size. The workers only run forward passes
    of whatever rank 0 schedules, so one set of worker processes serves every scheduler setting."""
    config = engine.config.replace(policy=policy, chunk_size=chunk_size)
    engine.scheduler_config = config.scheduler_config(engine.scheduler_config.num_blocks,
                                                      engine.scheduler_config.max_model_len)
    engine.scheduler = make_scheduler(engine.scheduler_config)
    engine.reset_stats()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mqa"])
def test_tp2_greedy_matches_tp1_and_hf_for_sarathi_and_vllm_chunks_7_and_64_with_preemption(tp_checkpoints, kind):
    # 14 prompts of up to 120 tokens, up to 40 outputs each, in a pool of 192 token slots: preemption in every run.
    options = dict(block_size=16, num_kv_blocks=12, device="cpu", attention_backend="torch")
    ref = HFReference(tp_checkpoints[kind])
    work = workload(seed=11, max_prompt=120, max_output=40, vocab=320)
    tp1 = LLMEngine(tp_checkpoints[kind], **options)
    tp2 = LLMEngine(tp_checkpoints[kind], tensor_parallel_size=2, **options)
    try:
        assert tp2.runner.kv_cache.shape[-2] == max(1, tp1.runner.kv_cache.shape[-2] // 2)  # this rank's KV heads
        for policy in ("sarathi", "vllm"):
            for chunk_size in (7, 64):
                runs = {}
                for name, engine in (("tp1", tp1), ("tp2", tp2)):
                    _use_scheduler(engine, policy, chunk_size)
                    runs[name] = run_staggered(engine, work)
                    assert sum(r.num_preemptions for r in engine.stats().requests) > 0
                    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler_config.num_blocks
                exact = 0
                for i, (prompt, n) in enumerate(work):
                    _, tokens, logprobs = runs["tp2"][f"r{i}"]
                    _, tokens1, logprobs1 = runs["tp1"][f"r{i}"]
                    assert_matches_hf(ref, prompt, tokens, logprobs, n)
                    same = next((j for j, (a, b) in enumerate(zip(tokens, tokens1)) if a != b), len(tokens))
                    if same < len(tokens):  # a flip between TP=1 and TP=2 must be a near-tie under teacher forcing
                        hf = ref.logits(prompt + tokens[:same])[-1]
                        assert abs(float(hf[tokens[same]] - hf[tokens1[same]])) <= NEAR_TIE
                    assert all(abs(a - b) <= LOGPROB_ATOL for a, b in zip(logprobs[:same], logprobs1[:same]))
                    exact += tokens == tokens1
                assert exact >= len(work) - 1, (policy, chunk_size, exact)
        # a prompt again through the warm prefix cache: the workers' KV blocks hold the cached prefix too
        repeat = [(work[1][0][:40], 8)]
        first = run_staggered(tp2, repeat)
        tp2.reset_stats()
        assert run_staggered(tp2, repeat)["r0"][1] == first["r0"][1]
        assert tp2.stats().requests[0].num_cached_tokens == 32
    finally:
        tp2.shutdown()
    assert mp.active_children() == []


# ---------------------------------------------------------------- lifecycle and faults


def _start(path: Path) -> tuple[LLMEngine, list]:
    engine = LLMEngine(path, tensor_parallel_size=2, num_kv_blocks=16, device="cpu", attention_backend="torch")
    return engine, list(engine.executor.workers.processes)


def test_dropping_the_engine_leaves_no_child_process(tp_checkpoints):
    engine, procs = _start(tp_checkpoints["llama"])
    engine.add_request("a", [5, 6, 7], None)
    while engine.has_unfinished_requests():
        engine.step()
    del engine
    assert all(p.exitcode == 0 for p in procs)  # told to stop, they left by themselves
    assert mp.active_children() == [] and not dist.is_initialized()


def test_an_exception_mid_step_stops_the_workers(tp_checkpoints, monkeypatch):
    engine, procs = _start(tp_checkpoints["llama"])
    engine.add_request("a", list(range(3, 50)), None)

    def interrupted(*args, **kwargs):  # Ctrl-C after the step went out: the workers wait in a collective
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.runner, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.shutdown()
    assert all(p.exitcode is not None for p in procs)
    assert mp.active_children() == [] and not dist.is_initialized()


def test_a_killed_worker_makes_rank_0_raise_a_clear_error_not_hang(tp_checkpoints):
    engine, procs = _start(tp_checkpoints["llama"])
    engine.add_request("a", list(range(3, 60)), None)
    engine.step()
    os.kill(procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 \(pid \d+\) was killed by signal 9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < worker.COLLECTIVE_TIMEOUT  # a bound on hanging, not a speed claim
    finally:  # a failure here must not leave the process group to the next test
        engine.shutdown()
    assert mp.active_children() == [] and not dist.is_initialized()



# ---------------------------------------------------------------- the roofline model at tensor_parallel_size N


def _decode_batch(num: int, context: int):
    from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput

    out = SchedulerOutput()
    for i in range(num):
        out.add(ScheduledRequest(f"d{i}", context, 1, [0], [0], True, False))
    return out


def test_roofline_divides_work_by_n_and_adds_two_all_reduces_per_layer():
    from sarathi_lite.costs import load_cost_model
    from sarathi_lite.costs.roofline import RooflineCostModel, hardware, model_shape

    _, cfg = model_shape("llama3-70b")
    h100 = hardware("h100")
    with pytest.raises(ValueError, match="leaves no memory for a KV cache"):
        RooflineCostModel(cfg, h100)  # 141 GB of bf16 weights on one 80 GB card
    tp4, tp8 = (RooflineCostModel(cfg, h100, tensor_parallel_size=n) for n in (4, 8))
    tp16 = RooflineCostModel(cfg, hardware("h200"), tensor_parallel_size=16)
    assert tp4.flops_per_token == 2 * tp8.flops_per_token
    assert tp4.kv_bytes_per_token == 2 * tp8.kv_bytes_per_token
    assert tp8.kv_bytes_per_token == tp16.kv_bytes_per_token  # 8 KV heads: one per rank, then replicated
    assert tp8.kv_cache_memory > tp4.kv_cache_memory > 0
    out = _decode_batch(32, 1000)
    n, layers, hidden = 4, cfg.num_layers, cfg.hidden_size
    link = h100.interconnect_bandwidth * tp4.bandwidth_efficiency
    all_reduce = h100.interconnect_latency + 2 * (n - 1) / n * 32 * hidden * 2 / link
    gather = h100.interconnect_latency + (n - 1) / n * 32 * cfg.vocab_size * 4 / link
    assert tp4.comm_time(out) == pytest.approx(2 * layers * all_reduce + gather)
    assert tp4.analyze(out)["comm_time"] == tp4.comm_time(out)
    a = tp4.analyze(out)
    assert tp4.predict(out).step_time == pytest.approx(tp4.step_overhead + a["linear_time"] + a["attention_time"]
                                                       + a["comm_time"])
    one = RooflineCostModel(model_shape("llama3-8b")[1], h100)
    assert one.comm_time(out) == 0.0 and one.describe()["tensor_parallel_size"] == 1
    spec = load_cost_model("roofline-uncalibrated:8xh100:llama3-70b")
    assert spec.tensor_parallel_size == 8 and spec.predict(out) == tp8.predict(out)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=64"):
        RooflineCostModel(cfg, h100, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="needs an interconnect"):
        RooflineCostModel(cfg, h100.__class__("bare", 1e15, 3e12, 80e9), tensor_parallel_size=4)


_RANK0 = """
import sys, time
from sarathi_lite import LLMEngine
if __name__ == "__main__":
    engine = LLMEngine(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=16, device="cpu", attention_backend="torch")
    print(engine.executor.workers.processes[0].pid, flush=True)
    time.sleep(120)
"""


def _exited(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return True


def test_workers_exit_when_rank_0_is_killed(tp_checkpoints, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "rank0.py"
    script.write_text(_RANK0)
    rank0 = subprocess.Popen([sys.executable, str(script), str(tp_checkpoints["llama"])], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        pid = int(rank0.stdout.readline())
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + worker.COLLECTIVE_TIMEOUT  # a bound on lingering, not a speed claim
    while not _exited(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    lingered = not _exited(pid)
    if lingered:
        os.kill(pid, signal.SIGKILL)
    assert not lingered, f"worker {pid} outlived its killed rank 0"
