"""``CalibratedCostModel``: the roofline's step, with every non-attention operator and every collective priced by
curves fitted to measured GPU timings.

The measurements are Vidur's (microsoft/vidur, MIT license; see ``data/README.md`` and ``data/LICENSE``): every
non-attention operator of one transformer layer on A100 and H100 GPUs, for six model shapes at 1 to 32,768 tokens
and tensor parallel 1 to 8, and NCCL all-reduce and send/recv times. Only the fitted parameters ship here
(``data/<gpu>.json``, a few kB each); ``sarathi_lite.sim.gpu_fit`` fits them and
``benchmarks/gpu_calibration.py`` measures their error, model by model, leaving each model out of its own fit.

How an operator's time is modelled (each family's coefficients are non-negative, so every operator's predicted
time is non-decreasing in tokens):

- matrix multiplications (QKV, output, gate/up and down projections, the LM head) of ``T`` tokens, ``K`` inputs
  and ``N`` outputs per rank: ``c0 + c_w * weight bytes + c_a * activation bytes + c_p * padded FLOPs + c_f *
  FLOPs``, where padded FLOPs round ``T`` up to a whole tile (``TILE_TOKENS``). ``c0`` is the kernel's launch
  floor, ``1 / c_w`` the bandwidth a weight read attains, ``1 / (c_p + c_f)`` the FLOP/s a large product attains;
  summing the memory and compute terms (rather than taking their maximum) is a smooth knee between the
  bandwidth-bound and compute-bound regimes, and the padded term is the staircase a tiled kernel climbs
  (a 129-token product costs about as much as a 256-token one at large ``N``);
- element-wise operators (RMSNorm, rotary embedding, SiLU-and-mul, residual add, embedding lookup):
  ``c0 + c_b * bytes`` each, one family per operator;
- all-reduce (two per layer under tensor parallelism) and send/recv: a table of the measured median times
  against message bytes, per number of GPUs, interpolated linearly (dips included: NCCL's protocol and
  algorithm switches make some larger messages cheaper, so under tensor parallelism a step's collectives are
  not non-decreasing in tokens; everything else is); the logits' gather costs an all-reduce of half its bytes
  (a ring all-gather moves half what a ring all-reduce does).

Attention is NOT measured (Vidur's attention files were not available). It stays analytic, priced as the
uncalibrated roofline prices it (``RooflineCostModel.work``'s FLOPs and bytes at 0.7 of peak FLOP/s and 0.85 of
peak bandwidth), plus one measured launch floor per layer. ``attention_share`` tells how much of a step that is;
docs/guides/gpu_calibration.md bounds it for typical batches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

from sarathi_lite.costs.roofline import Hardware, RooflineCostModel, hardware, model_shape
from sarathi_lite.models.config import ModelConfig
from sarathi_lite.scheduler import SchedulerOutput

CALIBRATION_SCHEMA = "sarathi-lite/gpu-calibration/1"
TILE_TOKENS = 128
GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add", "emb")
OPERATORS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
"""Vidur's operator names, in its files' order: one layer's non-attention work (``emb`` once per step)."""
GEMM_BASIS = ("constant", "weight_bytes", "activation_bytes", "padded_flops", "flops")
ELEMENTWISE_BASIS = ("constant", "bytes")
CALIBRATED_HARDWARE = {"a100-80gb": "a100", "h100": "h100"}
"""Hardware presets with measurements: preset -> package data file (``data/<name>.json``)."""


def family(op: str) -> str:
    """The fitted family an operator belongs to: ``gemm`` for the projections, ``norm`` for both RMSNorms, else
    the operator itself."""
    if op in GEMMS or op == "lm_head":
        return "gemm"
    return "norm" if op.endswith("layernorm") else op


@dataclass(slots=True, frozen=True)
class LayerShape:
    """One rank's share of a transformer layer: hidden size, query and KV heads and head size, MLP width, whether
    the MLP is gated (SwiGLU: gate and up projections together), vocabulary, tensor-parallel degree, and bytes
    per element."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated: bool = True
    tensor_parallel: int = 1
    dtype_bytes: int = 2

    @classmethod
    def of(cls, model: ModelConfig, tensor_parallel: int = 1, dtype_bytes: int = 2) -> LayerShape:
        return cls(model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim, model.intermediate_size,
                   model.vocab_size, True, tensor_parallel, dtype_bytes)

    @property
    def q_dim(self) -> int:
        return self.heads // self.tensor_parallel * self.head_dim

    @property
    def kv_dim(self) -> int:
        return max(self.kv_heads // self.tensor_parallel, 1) * self.head_dim

    @property
    def inter(self) -> int:
        return self.intermediate // self.tensor_parallel

    def gemm(self, op: str) -> tuple[int, int]:
        """``(K, N)`` of a projection per rank (``lm_head``: hidden x vocabulary / degree)."""
        h = self.hidden
        return {"attn_pre_proj": (h, self.q_dim + 2 * self.kv_dim), "attn_post_proj": (self.q_dim, h),
                "mlp_up_proj": (h, (2 if self.gated else 1) * self.inter), "mlp_down_proj": (self.inter, h),
                "lm_head": (h, -(-self.vocab // self.tensor_parallel))}[op]

    def elementwise_bytes(self, op: str) -> int:
        """Bytes an element-wise operator reads and writes per token."""
        per_token = {"input_layernorm": 2 * self.hidden, "post_attention_layernorm": 2 * self.hidden,
                     "attn_rope": 2 * (self.q_dim + self.kv_dim),
                     "mlp_act": (3 if self.gated else 2) * self.inter, "add": 3 * self.hidden, "emb": self.hidden}
        return per_token[op] * self.dtype_bytes


def operator_terms(op: str, tokens: np.ndarray | float, shape: LayerShape) -> np.ndarray:
    """The basis values of operator ``op`` at ``tokens`` (one row per token count): ``GEMM_BASIS`` for a
    projection, ``ELEMENTWISE_BASIS`` otherwise. The same function builds the fit's rows and the predictions."""
    t = np.atleast_1d(np.asarray(tokens, dtype=np.float64))
    one = np.ones_like(t)
    if family(op) == "gemm":
        k, n = shape.gemm(op)
        b = shape.dtype_bytes
        padded = np.ceil(t / TILE_TOKENS) * TILE_TOKENS
        return np.stack([one, one * b * k * n, b * t * (k + n), 2.0 * padded * k * n, 2.0 * t * k * n], axis=1)
    return np.stack([one, t * shape.elementwise_bytes(op)], axis=1)


@dataclass(slots=True)
class Collective:
    """A measured collective's time (s) against message bytes, per number of GPUs: a table of knots, linear
    between them, the first knot's time below the first size and, beyond the last, the bandwidth of the largest
    messages (the average slope over the upper half of the measured sizes).

    The table follows the measurements, so it is not non-decreasing everywhere: NCCL switches protocol and
    algorithm at size thresholds and a larger message can be cheaper (docs/results/gpu_calibration.md,
    "Collectives")."""

    knots: dict[int, tuple[tuple[float, ...], tuple[float, ...]]]

    def time(self, nbytes: float, workers: int) -> float | None:
        """Seconds for ``nbytes`` over ``workers`` GPUs, ``None`` if that degree was not measured."""
        if workers not in self.knots:
            return None
        x, y = self.knots[workers]
        if nbytes <= x[-1]:
            return float(np.interp(nbytes, x, y))
        j = int(np.searchsorted(x, x[-1] / 2))
        j = min(j, len(x) - 2)
        slope = max((y[-1] - y[j]) / (x[-1] - x[j]), 0.0)
        return y[-1] + slope * (nbytes - x[-1])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Collective:
        return cls({int(w): (tuple(v["bytes"]), tuple(v["seconds"])) for w, v in d.items()})

    def to_dict(self) -> dict[str, Any]:
        return {str(w): {"bytes": list(x), "seconds": list(y)} for w, (x, y) in sorted(self.knots.items())}


@dataclass(slots=True)
class GpuCalibration:
    """The fitted parameters of one GPU: per operator family, basis coefficients in seconds per unit
    (``GEMM_BASIS`` or ``ELEMENTWISE_BASIS``); the all-reduce and send/recv curves; where they came from."""

    gpu: str
    families: dict[str, tuple[float, ...]]
    all_reduce: Collective
    send_recv: Collective
    meta: dict[str, Any]

    def operator_time(self, op: str, tokens: np.ndarray | float, shape: LayerShape) -> np.ndarray:
        """Seconds of ``op`` at each of ``tokens`` on one rank of ``shape``."""
        coef = self.families.get(family(op))
        if coef is None:
            raise ValueError(f"{self.gpu} calibration has no {family(op)!r} family (operator {op!r})")
        return operator_terms(op, tokens, shape) @ np.asarray(coef)

    def layer_time(self, tokens: np.ndarray | float, shape: LayerShape, ops: tuple[str, ...] = OPERATORS
                   ) -> np.ndarray:
        """Seconds of the operators ``ops`` (default: a whole row of Vidur's files) at each of ``tokens``."""
        return sum(self.operator_time(op, tokens, shape) for op in ops)

    @property
    def gemm_flops(self) -> float:
        """FLOP/s a large matrix multiplication attains (``1 / (c_p + c_f)``)."""
        c = self.families["gemm"]
        return 1.0 / (c[3] + c[4])

    @property
    def gemm_bandwidth(self) -> float:
        """Bytes/s a one-token projection attains reading its weights: ``1 / (c_w + TILE_TOKENS * c_p + c_f)``
        (at one token the padded tile's compute adds to the weight read)."""
        c = self.families["gemm"]
        return 1.0 / (c[1] + TILE_TOKENS * c[3] + c[4])

    def to_dict(self) -> dict[str, Any]:
        basis = {f: list(GEMM_BASIS if f == "gemm" else ELEMENTWISE_BASIS) for f in self.families}
        return {"schema": CALIBRATION_SCHEMA, "gpu": self.gpu, "tile_tokens": TILE_TOKENS,
                "families": {f: {"basis": basis[f], "coefficients": list(c)} for f, c in self.families.items()},
                "all_reduce": self.all_reduce.to_dict(), "send_recv": self.send_recv.to_dict(), "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuCalibration:
        if d.get("schema") != CALIBRATION_SCHEMA:
            raise ValueError(f"not a {CALIBRATION_SCHEMA} file (schema={d.get('schema')!r})")
        if d.get("tile_tokens") != TILE_TOKENS:
            raise ValueError(f"calibration fitted with tile_tokens={d.get('tile_tokens')}, this code uses "
                             f"{TILE_TOKENS}")
        families = {f: tuple(float(c) for c in v["coefficients"]) for f, v in d["families"].items()}
        if any(c < 0 for v in families.values() for c in v):
            raise ValueError("calibration coefficients must be >= 0")
        return cls(d["gpu"], families, Collective.from_dict(d["all_reduce"]), Collective.from_dict(d["send_recv"]),
                   d.get("meta", {}))


_MAX_REMEMBERED = 1 << 16  # (tokens, sampled rows) pairs a CalibratedCostModel keeps (a few MB at most)


@cache
def load_calibration(gpu: str) -> GpuCalibration:
    """The shipped calibration of ``gpu`` (``a100`` or ``h100``) from the package data."""
    names = sorted(set(CALIBRATED_HARDWARE.values()))
    if gpu not in names:
        raise ValueError(f"no calibration for GPU {gpu!r}; measured: {', '.join(names)}")
    text = resources.files("sarathi_lite.costs").joinpath("data", f"{gpu}.json").read_text()
    return GpuCalibration.from_dict(json.loads(text))


class CalibratedCostModel(RooflineCostModel):
    """A roofline model whose operators and collectives are priced by a ``GpuCalibration`` (see the module
    docstring). Host overheads (``step_overhead``, ``schedule_time``, ``step_gap``) and the KV pool are the
    roofline's; the efficiencies are used only where nothing was measured (all-reduce at a degree without
    measurements). Options as ``RooflineCostModel``'s."""

    def __init__(self, model: ModelConfig, hw: Hardware, calibration: GpuCalibration, **options: Any) -> None:
        super().__init__(model, hw, **options)
        self.calibration = calibration
        self.shape = LayerShape.of(model, self.tensor_parallel_size, self.dtype_bytes)
        self._gemm_floor = calibration.families["gemm"][0]
        # (tokens, sampled rows) -> seconds: a step's operators depend on nothing else, and a simulation asks for
        # the same few thousand pairs again and again (the numpy evaluation dominated a simulated step)
        self._operator_times: dict[tuple[int, int], float] = {}

    def operators_time(self, out: SchedulerOutput) -> float:
        """Seconds of every measured operator of one iteration: each layer's projections and element-wise
        operators, the embedding lookup and final norm once, the LM head over the sampled rows."""
        tokens = out.num_prefill_tokens + out.num_decode_tokens
        sampled = sum(s.sample for s in out.scheduled)
        key = (tokens, sampled)
        seconds = self._operator_times.get(key)
        if seconds is None:
            if len(self._operator_times) >= _MAX_REMEMBERED:  # bounded in a long-running process (a server's
                self._operator_times.clear()                   # auto budget): start over, never grow past it
            seconds = self._operator_times[key] = self._operators_time(tokens, sampled)
        return seconds

    def _operators_time(self, tokens: int, sampled: int) -> float:
        cal, shape = self.calibration, self.shape
        layer = float(cal.layer_time(tokens, shape, tuple(op for op in OPERATORS if op != "emb"))[0])
        once = float(cal.operator_time("emb", tokens, shape)[0] + cal.operator_time("input_layernorm", tokens,
                                                                                      shape)[0])
        head = float(cal.operator_time("lm_head", sampled, shape)[0]) if sampled else 0.0
        return self.model.num_layers * layer + once + head

    def attention_time(self, out: SchedulerOutput) -> float:
        """Seconds of attention (analytic, not measured): the uncalibrated roofline's (its FLOPs and bytes at
        ``flops_efficiency`` of peak FLOP/s and ``bandwidth_efficiency`` of peak bandwidth) plus one measured
        kernel launch floor (the projections') per layer."""
        _, _, flops, nbytes = self.work(out)
        return self.model.num_layers * self._gemm_floor + max(flops / self._flops, nbytes / self._bandwidth)

    def comm_time(self, out: SchedulerOutput, num_layers: int | None = None, gather: bool = True) -> float:
        """Seconds of the collectives: two all-reduces of the ``[T, hidden]`` activations per layer and a gather
        of the sampled logits, at the measured times (the roofline's ring formula where the degree was not
        measured, and for one pipeline stage's ``num_layers``)."""
        n = self.tensor_parallel_size
        if n == 1:
            return 0.0
        if num_layers is not None:
            return super().comm_time(out, num_layers, gather)
        tokens = out.num_prefill_tokens + out.num_decode_tokens
        sampled = sum(s.sample for s in out.scheduled)
        measured = self.calibration.all_reduce.time(self.allreduce_bytes_per_token * tokens, n)
        if measured is None:
            return super().comm_time(out)
        gather = self.calibration.all_reduce.time(self.gather_bytes_per_sample * sampled / 2, n) if sampled else 0.0
        return 2 * self.model.num_layers * measured + gather

    def analyze(self, out: SchedulerOutput) -> dict[str, Any]:
        """The roofline's analysis, with the calibrated seconds: ``operators_time``, ``attention_time``,
        ``comm_time`` and the attention's share of the step."""
        result = super().analyze(out)
        result.update(operators_time=self.operators_time(out), attention_time=self.attention_time(out),
                      comm_time=self.comm_time(out))
        result["attention_share"] = result["attention_time"] / self.predict_step_time(out)
        return result

    def attention_share(self, out: SchedulerOutput) -> float:
        """The fraction of the predicted step that is (analytic) attention."""
        return self.attention_time(out) / self.predict_step_time(out)

    def predict_step_time(self, out: SchedulerOutput) -> float:
        return self.step_overhead + self.operators_time(out) + self.attention_time(out) + self.comm_time(out)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": "calibrated", "calibration": self.calibration.gpu,
                "calibration_source": self.calibration.meta.get("source")}


def calibrated(hw: str = "h100", model: Any = "llama3-8b", **options: Any) -> CalibratedCostModel:
    """``CalibratedCostModel`` of a model shape on a hardware preset with measurements (``a100-80gb``, ``h100``;
    ``"<N>x<preset>"`` for tensor parallelism), as ``roofline`` takes them."""
    name, cfg = model_shape(model)
    count, x, preset = hw.partition("x")
    if x and count.isdigit():
        options = {**options, "tensor_parallel_size": int(count)}
        hw = preset
    key = hw.lower()
    hardware(key)  # an unknown preset is an error naming the presets
    if key not in CALIBRATED_HARDWARE:
        raise ValueError(f"no GPU measurements for {hw!r}; calibrated presets: {', '.join(CALIBRATED_HARDWARE)} "
                         f"(use roofline-uncalibrated:{hw} for the analytic formula)")
    return CalibratedCostModel(cfg, hardware(key), load_calibration(CALIBRATED_HARDWARE[key]), name=name, **options)
