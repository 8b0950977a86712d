"""Analytic roofline cost model: a model's shape on a hardware description, so a laptop predicts GPU serving.

Torch-free. Per iteration, two groups of work each take ``max(FLOPs / attainable FLOP/s, bytes / attainable
bandwidth)``, and the step adds a fixed host overhead:

- linear layers (QKV, output, gate/up/down projections of every layer, and the LM head for sampled rows):
  FLOPs = 2 * P_layer * L * T + 2 * H * V * S; bytes = every weight once + each projection's input and output
  activations;
- attention: FLOPs = 4 * L * heads * head_dim * (query x key pairs, causal: a chunk of q new tokens after c cached
  ones has q * c + q * (q + 1) / 2); bytes = the K/V each request reads (its context) and writes (its new tokens)
  + queries read and outputs written.

(T: query tokens, S: rows that sample, L: layers, H: hidden size, V: vocabulary, P_layer: a layer's projection
weights.) Attainable = peak * efficiency. Hardware presets are vendor data-sheet figures (dense bf16 tensor
FLOP/s without sparsity, HBM bandwidth, memory, NVLink bandwidth); model shape presets are Hugging Face
``config.json`` contents.

With ``tensor_parallel_size`` N (Megatron-style, as the engine shards): every rank holds 1/N of the weights,
query heads, MLP and vocabulary and ``max(1, kv_heads / N)`` KV heads, so the FLOPs, weight, K/V and query bytes
above are per rank; each layer adds two all-reduces of the ``[T, H]`` activations (after the attention output and
the down projection) and the step one gather of the sampled rows' logits, each priced as a ring over the
interconnect: ``latency + 2 (N - 1) / N * bytes / attainable link bandwidth`` (the gather ``(N - 1) / N``), not
overlapped with compute. The KV pool is what one rank's memory leaves after its weights.

With ``pipeline_parallel_size`` P (pipeline parallelism; ``sarathi_lite.sim.simulator`` simulates it): the layers
are split into P contiguous stages (``models.stages.stage_layers``), each on its own tensor-parallel group; the
last stage also runs the LM head. A stage's time (``predict_stage_times``) is the groups above over its layers'
share of the layer work (and the head on the last stage), its collectives, plus ``step_overhead`` (each stage's
host prepares its inputs and launches its kernels). Between stages the hidden states and the residual of every
query token, ``2 * H * dtype_bytes`` per token, cross the pipeline link: ``latency + bytes / attainable
bandwidth`` (``send_time``). ``predict_step_time`` is then a micro-batch's time through the whole pipeline (the
stages and the sends one after another). Each device holds only its stage's weights and its layers' K/V, so the
KV pool (in tokens) grows with P; the pool is the tightest stage's.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sarathi_lite.costs.base import CostModel, StepTiming
from sarathi_lite.costs.memory import device_kv_budget
from sarathi_lite.models.config import ModelConfig, check_tensor_parallel
from sarathi_lite.models.stages import check_pipeline_parallel, stage_layers
from sarathi_lite.scheduler import SchedulerOutput


@dataclass(slots=True, frozen=True)
class Hardware:
    """peak_flops: dense bf16 FLOP/s. memory_bandwidth: bytes/s. memory: bytes of device memory.
    interconnect_bandwidth: bytes/s one device sends (one direction) to its tensor-parallel peers, 0 when it has
    no such link; interconnect_latency: seconds a collective takes however small (launch and synchronisation).
    pipeline_bandwidth: bytes/s one device sends (one direction) to its peer in the next pipeline stage, on another
    node (0: no such link); pipeline_latency: seconds one such send takes however small."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory: float
    interconnect_bandwidth: float = 0.0
    interconnect_latency: float = 0.0
    pipeline_bandwidth: float = 0.0
    pipeline_latency: float = 0.0


HARDWARE = {
    "a100-80gb": Hardware("A100-80GB SXM", 312e12, 2.039e12, 80e9, 300e9, 10e-6, 25e9, 10e-6),
    "h100": Hardware("H100 SXM", 989e12, 3.35e12, 80e9, 450e9, 10e-6, 50e9, 10e-6),
    "h200": Hardware("H200 SXM", 989e12, 4.8e12, 141e9, 450e9, 10e-6, 50e9, 10e-6),
    "a100-80gb-100gbe": Hardware("A100-80GB SXM, nodes on 100 GbE", 312e12, 2.039e12, 80e9, 300e9, 10e-6, 12.5e9,
                                 50e-6),
}
"""NVIDIA data sheets: A100 80GB SXM (312 TFLOP/s bf16, 2,039 GB/s HBM2e, NVLink 3: 600 GB/s both directions),
H100 SXM (989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4: 900 GB/s both directions), H200 SXM (989 TFLOP/s bf16
dense, 4.8 TB/s HBM3e, 141 GB, NVLink 4). The 10 us per collective is an assumption of the order NCCL's small
all-reduces take within an NVSwitch node, to calibrate like the efficiencies. Pipeline links (between nodes): one
200 Gb/s HDR InfiniBand NIC per A100 (DGX A100), one 400 Gb/s NDR NIC per H100/H200 (DGX H100), 10 us a send;
``a100-80gb-100gbe``: A100s whose nodes meet over 100 Gb/s Ethernet (12.5 GB/s, 50 us a send, assumed), the
link of Sarathi-Serve's Falcon-180B deployment (two nodes of four A100s, TP 4 x PP 2)."""

_LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA3_8B,
    "llama3.1-8b": {**_LLAMA3_8B, "max_position_embeddings": 131072},
    "llama3-70b": {**_LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64},
    "mistral-7b": {**_LLAMA3_8B, "model_type": "mistral", "vocab_size": 32768, "max_position_embeddings": 32768,
                   "rope_theta": 1e6, "sliding_window": None},
    "yi-34b": {**_LLAMA3_8B, "vocab_size": 64000, "hidden_size": 7168, "intermediate_size": 20480,
               "num_hidden_layers": 60, "num_attention_heads": 56, "max_position_embeddings": 4096,
               "rope_theta": 5e6},
    "smollm2-135m": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                     "tie_word_embeddings": True},
    "falcon-180b": {"model_type": "llama", "vocab_size": 65024, "hidden_size": 14848, "intermediate_size": 39592,
                    "num_hidden_layers": 80, "num_attention_heads": 232, "num_key_value_heads": 8, "head_dim": 64,
                    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
}
"""Shapes (weights are irrelevant here) of Meta-Llama-3-8B, Llama-3.1-8B (the same with 128k context; RoPE scaling
does not change the cost), Meta-Llama-3-70B, Mistral-7B-v0.3, Yi-34B (01-ai/Yi-34B: 60 layers, hidden 7168, 56
query and 8 KV heads, MLP 20480, vocabulary 64000) and SmolLM2-135M-Instruct; ``falcon-180b`` is
Falcon-180B's shape on the Llama layer (80 layers, hidden 14,848, 232 query heads of 64, 8 KV heads, vocabulary
65,024): Falcon's non-gated 4H MLP (2 x 14,848 x 59,392 weights) becomes a gated one of the same weight count
(3 x 14,848 x 39,592), so FLOPs and bytes match (179.6 B parameters); its parallel attention/MLP block and
context of 2,048 (8,192 here, so the traces fit) do not change the roofline."""


_DTYPE_NAMES = {1: "fp8", 2: "bfloat16", 4: "float32"}


def hardware(name: str) -> Hardware:
    """A preset of ``HARDWARE`` by name (case-insensitive)."""
    key = name.lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; presets: {', '.join(HARDWARE)}")
    return HARDWARE[key]


def model_shape(spec: str | Path) -> tuple[str, ModelConfig]:
    """``(name, ModelConfig)`` of a preset in ``MODEL_SHAPES``, a checkpoint folder with ``config.json``, or a
    ``config.json`` file."""
    key = str(spec).lower()
    if key in MODEL_SHAPES:
        return key, ModelConfig.from_dict(MODEL_SHAPES[key])
    path = Path(spec)
    if path.is_file():
        return path.parent.name, ModelConfig.from_dict(json.loads(path.read_text()))
    if path.is_dir():
        return path.name, ModelConfig.from_pretrained(path)
    raise ValueError(f"model shape {str(spec)!r} is neither a preset ({', '.join(MODEL_SHAPES)}) nor a config.json "
                     f"file or checkpoint folder")


def _keys_seen(computed: int, new: int, window: int) -> int:
    """Query x key pairs of ``new`` causal queries after ``computed`` cached tokens when one query sees at most
    ``window`` keys. Query j (0-based) sees ``min(computed + j + 1, window)`` keys."""
    lo, hi = computed + 1, computed + new
    if hi <= window:
        return (lo + hi) * new // 2
    if lo >= window:
        return new * window
    return (lo + window) * (window - lo + 1) // 2 + (hi - window) * window


class RooflineCostModel(CostModel):
    """Roofline step times of ``model`` on ``hw`` (see the module docstring).

    dtype_bytes: bytes per weight, activation and K/V element (1: fp8, 2: bf16, 4: float32).
    flops_efficiency, bandwidth_efficiency: fractions of peak FLOP/s and bandwidth that kernels attain.
    step_overhead: host seconds per step outside the device (scheduling, input preparation, launches), of which
    schedule_time is the scheduler's. step_gap: host seconds between steps. memory_utilization: fraction of
    device memory the engine may use (weights + KV pool), as the engine's ``gpu_memory_utilization``.
    tensor_parallel_size: devices the model is sharded over (see the module docstring); the interconnect attains
    ``bandwidth_efficiency`` of its peak too.
    pipeline_parallel_size: pipeline stages, each on its own ``tensor_parallel_size`` devices (see the module
    docstring); the pipeline link attains ``bandwidth_efficiency`` of its peak too.
    The efficiencies and host times are assumptions to calibrate, not measurements.
    """

    def __init__(self, model: ModelConfig, hw: Hardware, *, name: str = "model", dtype_bytes: int = 2,
                 flops_efficiency: float = 0.7, bandwidth_efficiency: float = 0.85, step_overhead: float = 1e-3,
                 schedule_time: float = 1e-4, step_gap: float = 1e-4, memory_utilization: float = 0.9,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
        if dtype_bytes not in _DTYPE_NAMES:
            raise ValueError(f"dtype_bytes={dtype_bytes} is not one of {sorted(_DTYPE_NAMES)}")
        if not (0 < flops_efficiency <= 1 and 0 < bandwidth_efficiency <= 1):
            raise ValueError("efficiencies must be in (0, 1]")
        if not 0 <= schedule_time <= step_overhead:
            raise ValueError(f"schedule_time={schedule_time} must be within step_overhead={step_overhead}")
        n = tensor_parallel_size
        check_tensor_parallel(model, n)
        if n > 1 and hw.interconnect_bandwidth <= 0:
            raise ValueError(f"tensor_parallel_size={n} needs an interconnect; {hw.name} has none")
        pp = pipeline_parallel_size
        check_pipeline_parallel(model.num_layers, pp)
        if pp > 1 and hw.pipeline_bandwidth <= 0:
            raise ValueError(f"pipeline_parallel_size={pp} needs a pipeline link; {hw.name} has none")
        self.pipeline_parallel_size = pp
        self.stage_num_layers = [len(stage_layers(model.num_layers, pp, s)) for s in range(pp)]
        self.model, self.hw, self.name = model, hw, name
        self.dtype_bytes = dtype_bytes
        self.flops_efficiency, self.bandwidth_efficiency = flops_efficiency, bandwidth_efficiency
        self.step_overhead, self.schedule_time, self.step_gap = step_overhead, schedule_time, step_gap
        self.tensor_parallel_size = n
        m, b = model, dtype_bytes
        # per rank: 1/n of the query heads, MLP and vocabulary; KV heads split or replicated
        q_dim, kv_dim = m.num_heads // n * m.head_dim, m.kv_heads_per_rank(n) * m.head_dim
        inter = m.intermediate_size // n
        layer_params, head_params = m.layer_weights(n), m.lm_head_weights(n)
        self.flops_per_token = 2 * m.num_layers * layer_params
        self.flops_per_sample = 2 * head_params
        self.weight_bytes = (m.num_layers * layer_params + head_params) * b
        self.activation_bytes_per_token = m.num_layers * (4 * m.hidden_size + 2 * q_dim + 2 * kv_dim
                                                          + 3 * inter) * b
        self.attention_flops_per_pair = 4 * m.num_heads // n * m.head_dim
        self.kv_bytes_per_token = m.kv_bytes_per_token(b, n)
        self.head_bytes = head_params * b
        self.kv_bytes_per_token_layer = 2 * kv_dim * b
        self.qo_bytes_per_token = m.num_layers * 2 * q_dim * b
        # (most keys one query sees, 0 for no limit; number of such layers): HF window W = window_left + 1
        self.window_layers = sorted(Counter(w + 1 if w >= 0 else 0 for w in m.layer_windows).items())
        embedding_bytes = 0 if m.tie_word_embeddings else head_params * b
        self.max_position_embeddings = m.max_position_embeddings
        # what the engine's KV pool gets on this device once the weights are loaded (the same kv_pool then
        # sizes the pool in the simulator)
        self.kv_cache_memory = device_kv_budget(hw.memory - self.weight_bytes - embedding_bytes, hw.memory,
                                                memory_utilization)
        if pp > 1:  # each device: its stage's layers (+ the embedding on the first, the LM head on the last)
            layer_bytes = (self.weight_bytes - self.head_bytes) // m.num_layers
            stages = [(device_kv_budget(hw.memory - layer_bytes * layers - self.head_bytes * ((s == 0) + (s == pp - 1)),
                                        hw.memory, memory_utilization),
                       self.kv_bytes_per_token // m.num_layers * layers)
                      for s, layers in enumerate(self.stage_num_layers)]
            self.kv_cache_memory, self.kv_bytes_per_token = min(stages, key=lambda mk: mk[0] / mk[1])
        if self.kv_cache_memory <= 0:
            raise ValueError(f"{name} ({(self.weight_bytes + embedding_bytes) / 1e9:.1f} GB of weights) leaves no "
                             f"memory for a KV cache on {hw.name}")
        self._flops = hw.peak_flops * flops_efficiency
        self._bandwidth = hw.memory_bandwidth * bandwidth_efficiency
        self._link = hw.interconnect_bandwidth * bandwidth_efficiency
        self.allreduce_bytes_per_token = m.hidden_size * b
        self.gather_bytes_per_sample = m.vocab_size * 4  # float32 logits
        self.send_bytes_per_token = 2 * m.hidden_size * b  # hidden states and residual, to the next stage
        self._pipeline_link = hw.pipeline_bandwidth * bandwidth_efficiency

    def comm_time(self, out: SchedulerOutput, num_layers: int | None = None, gather: bool = True) -> float:
        """Seconds of one iteration's collectives: two ring all-reduces of the ``[T, hidden]`` activations per
        layer and one gather of the sampled rows' logits (0 on one device). num_layers: of one pipeline stage
        (default: all); gather: whether the logits' gather is included (the last stage's)."""
        n = self.tensor_parallel_size
        if n == 1:
            return 0.0
        tokens = out.num_prefill_tokens + out.num_decode_tokens
        sampled = sum(s.sample for s in out.scheduled) if gather else 0
        latency = self.hw.interconnect_latency
        all_reduce = latency + 2 * (n - 1) / n * self.allreduce_bytes_per_token * tokens / self._link
        gather_time = latency + (n - 1) / n * self.gather_bytes_per_sample * sampled / self._link if sampled else 0.0
        return 2 * (self.model.num_layers if num_layers is None else num_layers) * all_reduce + gather_time

    def send_time(self, out: SchedulerOutput) -> float:
        """Seconds to send one micro-batch's activations (``[T, hidden]`` hidden states and residual) from one
        pipeline stage to the next (0 without pipeline parallelism)."""
        if self.pipeline_parallel_size == 1:
            return 0.0
        tokens = out.num_prefill_tokens + out.num_decode_tokens
        return self.hw.pipeline_latency + self.send_bytes_per_token * tokens / self._pipeline_link

    def predict_stage_times(self, out: SchedulerOutput) -> list[float]:
        """Seconds each pipeline stage works on ``out``: ``step_overhead`` + its layers' share of the linear and
        attention work (and the LM head on the last stage), each group ``max(compute, memory)`` + its collectives.
        One stage: ``[predict_step_time(out)]``."""
        lin_flops, lin_bytes, attn_flops, attn_bytes = self.work(out)
        head_flops = self.flops_per_sample * sum(s.sample for s in out.scheduled)
        layer_flops, layer_bytes = lin_flops - head_flops, lin_bytes - self.head_bytes
        f, b, total = self._flops, self._bandwidth, self.model.num_layers
        last = self.pipeline_parallel_size - 1
        times = []
        for stage, layers in enumerate(self.stage_num_layers):
            share = layers / total
            head = stage == last
            times.append(self.step_overhead
                         + max((layer_flops * share + head_flops * head) / f,
                               (layer_bytes * share + self.head_bytes * head) / b)
                         + max(attn_flops * share / f, attn_bytes * share / b)
                         + self.comm_time(out, layers, head))
        return times

    def work(self, out: SchedulerOutput) -> tuple[float, float, float, float]:
        """FLOPs and bytes of one iteration: ``(linear FLOPs, linear bytes, attention FLOPs, attention bytes)``."""
        tokens = out.num_prefill_tokens + out.num_decode_tokens
        sampled = pairs = kv_read = 0
        for s in out.scheduled:
            sampled += s.sample
            c, q = s.num_computed_tokens, s.num_new_tokens
            for window, layers in self.window_layers:
                if window:
                    pairs += layers * _keys_seen(c, q, window)
                    kv_read += layers * min(c + q, window)
                else:
                    pairs += layers * (2 * c + q + 1) * q // 2
                    kv_read += layers * (c + q)
        return (self.flops_per_token * tokens + self.flops_per_sample * sampled,
                self.weight_bytes + self.activation_bytes_per_token * tokens,
                self.attention_flops_per_pair * pairs,
                self.kv_bytes_per_token_layer * (kv_read + self.model.num_layers * tokens)  # every layer's K/V
                + self.qo_bytes_per_token * tokens)

    def analyze(self, out: SchedulerOutput) -> dict[str, Any]:
        """The roofline of one iteration: FLOPs, bytes and seconds of the linear and attention groups, and each
        group's bound (``"compute"`` or ``"memory"``)."""
        lin_flops, lin_bytes, attn_flops, attn_bytes = self.work(out)
        result: dict[str, Any] = {"linear_flops": lin_flops, "linear_bytes": lin_bytes,
                                  "attention_flops": attn_flops, "attention_bytes": attn_bytes}
        for group, flops, nbytes in (("linear", lin_flops, lin_bytes), ("attention", attn_flops, attn_bytes)):
            compute, memory = flops / self._flops, nbytes / self._bandwidth
            result[f"{group}_time"] = max(compute, memory)
            result[f"{group}_bound"] = "compute" if compute >= memory else "memory"
        result["comm_time"] = self.comm_time(out)
        return result

    def predict_step_time(self, out: SchedulerOutput) -> float:
        if self.pipeline_parallel_size > 1:  # through every stage and every send
            return sum(self.predict_stage_times(out)) + (self.pipeline_parallel_size - 1) * self.send_time(out)
        lin_flops, lin_bytes, attn_flops, attn_bytes = self.work(out)
        f, b = self._flops, self._bandwidth
        return self.step_overhead + max(lin_flops / f, lin_bytes / b) + max(attn_flops / f, attn_bytes / b) \
            + self.comm_time(out)

    def predict(self, out: SchedulerOutput) -> StepTiming:
        return StepTiming(self.schedule_time, self.predict_step_time(out))

    def describe(self) -> dict[str, Any]:
        return {"kind": "roofline", "model": self.name, "dtype": _DTYPE_NAMES[self.dtype_bytes],
                "device": self.hw.name, "attention_backend": "roofline", "dtype_bytes": self.dtype_bytes,
                "flops_efficiency": self.flops_efficiency, "bandwidth_efficiency": self.bandwidth_efficiency,
                "step_overhead": self.step_overhead, "schedule_time": self.schedule_time, "step_gap": self.step_gap,
                "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size}


def roofline(hw: str = "h100", model: str | Path = "llama3-8b", **options: Any) -> RooflineCostModel:
    """``RooflineCostModel`` of a model shape (``model_shape``) on a hardware preset (``hardware``); ``hw`` may
    be ``"<N>x<preset>"`` (e.g. ``"4xh100"``) for ``tensor_parallel_size=N``, or ``"<N>x<P>x<preset>"`` (e.g.
    ``"4x2xa100-80gb"``: N x P devices) for tensor parallelism N within each of P pipeline stages."""
    name, cfg = model_shape(model)
    counts = []
    while (part := hw.partition("x"))[1] and part[0].isdigit() and len(counts) < 2:
        counts.append(int(part[0]))
        hw = part[2]
    if counts:
        options = {**options, "tensor_parallel_size": counts[0]}
    if len(counts) == 2:
        options["pipeline_parallel_size"] = counts[1]
    return RooflineCostModel(cfg, hardware(hw), name=name, **options)
