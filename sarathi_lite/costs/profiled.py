"""``ProfiledCostModel``: a step time fitted to one machine's measured model runner (the prediction side; the
profiler and the fit live in ``sarathi_lite.sim``). Torch-free (numpy only)."""

from __future__ import annotations

import bisect
import json
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sarathi_lite.costs.base import CostModel, StepTiming
from sarathi_lite.scheduler import SchedulerOutput

COST_MODEL_SCHEMA = "sarathi-lite/cost-model/1"

TERMS = ("decode_tokens", "prefill_chunks", "sampled", "prefill_attention", "decode_attention")
"""The per-request terms of ``ProfiledCostModel``, each summed over an iteration's batch:

decode_tokens: decodes (each: its decode-attention bookkeeping and gather beyond the dense layers);
prefill_chunks: prompt chunks (each runs its own masked attention call per layer);
sampled: rows that sample a token (the LM head over the vocabulary, and the sampler);
prefill_attention: sum over prompt chunks of ``num_new_tokens * (num_computed_tokens + num_new_tokens)`` (query x
    key pairs of a masked attention call over the chunk's whole context);
decode_attention: sum over decodes of their context ``num_computed_tokens + 1`` (keys read).
"""

MEASURED = ("tokens", "prefill_chunks", "prefill_attention")
"""What ``ProfiledCostModel.measured`` bounds: a step's query tokens, its prompt chunks and their query x key pairs
(the quantities a policy of whole prompts, several at once, drives beyond a grid of chunks)."""


def batch_terms(out: SchedulerOutput) -> tuple[int, ...]:
    """``(query tokens, *TERMS)`` of one iteration (see ``TERMS``)."""
    chunks = sampled = attn_pf = attn_dec = 0
    for s in out.scheduled:
        kv = s.num_computed_tokens + s.num_new_tokens
        if s.is_prefill:
            chunks += 1
            attn_pf += s.num_new_tokens * kv
        else:
            attn_dec += kv
        sampled += s.sample
    return (out.num_prefill_tokens + out.num_decode_tokens, out.num_decode_tokens, chunks, sampled, attn_pf,
            attn_dec)


EXTRAPOLATION_BASE = 4
"""Above its last knot K the token curve continues along its chord from the largest knot at or below
K / ``EXTRAPOLATION_BASE`` to K, not along its last segment: a step far beyond the grid then rests on a slope
measured over two octaves, whose error (timing noise of two knots over a base of 3K/4 tokens) grows three times
slower with the distance than the last segment's (base K/4 with knots 1.5x apart)."""

EXTRAPOLATION_BOUND = (3.0, 0.20)
"""The stated bound on extrapolation: a step of up to 3x the largest measured step's tokens (and prompt chunks)
is predicted within 20% by a profile fitted on the quick or the full grid, on a synthetic cost curve with this
engine's shape (its cost per token rising about 5% per doubling of the step) at this VM's timing noise (each
shape's time off by up to 10%): ``tests/test_sim_extrapolation.py``. ``ProfiledCostModel`` warns beyond what
was measured."""


def extrapolation_anchor(knots: Sequence[int]) -> int:
    """Index of the knot the token curve's extrapolation above ``knots[-1]`` starts from (``EXTRAPOLATION_BASE``)."""
    return max(bisect.bisect_right(knots, knots[-1] / EXTRAPOLATION_BASE) - 1, 0)


def token_basis(tokens: float, knots: Sequence[int]) -> list[float]:
    """Weights ``w`` with ``g(tokens) = sum(w[j] * g(knots[j]))`` for every ``g`` that is linear between the
    knots, constant below the first and, above the last, continues the chord from the knot at
    ``extrapolation_anchor`` to the last (``EXTRAPOLATION_BASE``)."""
    w = [0.0] * len(knots)
    if tokens <= knots[0]:
        w[0] = 1.0
        return w
    if tokens > knots[-1]:
        a = extrapolation_anchor(knots)
        f = (tokens - knots[a]) / (knots[-1] - knots[a])
        w[a], w[-1] = 1.0 - f, f
        return w
    j = bisect.bisect_left(knots, tokens)  # tokens in (knots[j - 1], knots[j]]
    f = (tokens - knots[j - 1]) / (knots[j] - knots[j - 1])
    w[j - 1], w[j] = 1.0 - f, f
    return w


@dataclass
class ProfiledCostModel(CostModel):
    """Step time fitted to this machine: the dense layers' cost as a measured curve over the batch's tokens, plus
    non-negative per-request terms (``TERMS``), plus host overheads.

    step_time = schedule_time + g(query tokens) + sum(coefficients[t] * term t for t in TERMS)
    schedule_time = schedule_constant + schedule_per_request * (scheduled requests)

    and, when ``jitter`` is given, the forward part (g and the terms) multiplied by a factor drawn per iteration
    from that distribution: the same batch does not take the same time twice on a real machine, and a
    deterministic model predicts the typical step, so it underestimates tail latencies (P99 TBT) by the width of
    that spread.

    g is linear between ``token_knots`` (tokens) where it takes ``token_times`` (seconds): CPU BLAS libraries
    switch kernels with the batch size, so the cost of the projections is far from a straight line below a few
    dozen tokens. coefficients: seconds per unit of each term (missing terms are 0). schedule_constant (s),
    schedule_per_request (s per scheduled request) and step_gap (s, between steps) are host overheads. jitter:
    quantiles (evenly spaced, from the 0th to the 100th percentile) of a step's time over its typical time, as
    measured by the profile's repeated runs; empty: deterministic. measured: the largest value of each of
    ``MEASURED`` in one measured step (tokens; prompt chunks; query x key pairs of prompt chunks); empty: the
    last knot's tokens for a profile saved before it was recorded (``meta["grid"]``), no limit for a model
    built by hand. meta: how it was made (model, machine, threads, fit quality), free-form.

    ``predict`` warns (once per model) when a simulation asks for a step beyond ``measured``: the token curve and
    the terms are then extrapolated, within ``EXTRAPOLATION_BOUND`` up to its factor and without a bound beyond.
    """

    token_knots: tuple[int, ...]
    token_times: tuple[float, ...]
    coefficients: dict[str, float] = field(default_factory=dict)
    schedule_constant: float = 0.0
    schedule_per_request: float = 0.0
    step_gap: float = 0.0
    kv_bytes_per_token: int | None = None
    kv_cache_memory: int | None = None
    max_position_embeddings: int | None = None
    jitter: tuple[float, ...] = ()
    measured: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    _coef: tuple[float, ...] = field(init=False, repr=False)
    _rng: random.Random = field(init=False, repr=False)
    _warned: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_knots = tuple(int(k) for k in self.token_knots)
        self.token_times = tuple(float(t) for t in self.token_times)
        k = self.token_knots
        if len(k) < 2 or len(k) != len(self.token_times) or any(a >= b for a, b in zip(k, k[1:])) or k[0] < 1:
            raise ValueError(f"token_knots must be at least two increasing positive token counts, one per token "
                             f"time; got {k} and {len(self.token_times)} times")
        unknown = set(self.coefficients) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown cost term(s) {', '.join(sorted(unknown))}; terms are {', '.join(TERMS)}")
        if any(v < 0 for v in (*self.coefficients.values(), *self.token_times)):
            raise ValueError("cost coefficients and token times must be >= 0")
        self.jitter = tuple(float(q) for q in self.jitter)
        if len(self.jitter) == 1 or any(a > b for a, b in zip(self.jitter, self.jitter[1:])) or \
                any(q <= 0 for q in self.jitter):
            raise ValueError(f"jitter must be at least two increasing positive quantiles, got {self.jitter}")
        unknown = set(self.measured) - set(MEASURED)
        if unknown:
            raise ValueError(f"unknown measured range(s) {', '.join(sorted(unknown))}; they are {', '.join(MEASURED)}")
        self.measured = {k: float(v) for k, v in self.measured.items()}
        self._coef = tuple(float(self.coefficients.get(t, 0.0)) for t in TERMS)
        self._rng = random.Random(0)
        self._warned = False

    def token_time(self, tokens: float) -> float:
        """g(tokens): seconds of the dense layers for a batch of ``tokens`` query tokens."""
        return sum(w * t for w, t in zip(token_basis(tokens, self.token_knots), self.token_times))

    def typical_forward(self, row: Sequence[float]) -> float:
        """Typical model-runner seconds (no jitter, no host overheads) for one row of ``batch_terms`` values."""
        return self.token_time(row[0]) + sum(c * v for c, v in zip(self._coef, row[1:]))

    def forward_time(self, terms: Sequence[Sequence[float]]) -> np.ndarray:
        """``typical_forward`` of each row of ``batch_terms`` values."""
        return np.array([self.typical_forward(row) for row in terms])

    def beyond_measured(self, row: Sequence[float]) -> dict[str, tuple[float, float]]:
        """For one row of ``batch_terms`` values: each of ``MEASURED`` it exceeds, as ``(its value, the largest
        measured)``. Without a recorded range: for a profile saved before it was recorded (``meta["grid"]``),
        the token count against the last knot; for a model built by hand, nothing."""
        limits = self.measured or ({"tokens": float(self.token_knots[-1])} if "grid" in self.meta else {})
        values = dict(zip(("tokens", *TERMS), row))
        return {k: (values[k], v) for k, v in limits.items() if values[k] > v}

    def predict_step_time(self, out: SchedulerOutput) -> float:
        return self.schedule_constant + self.schedule_per_request * len(out.scheduled) + \
            self.typical_forward(batch_terms(out))

    def predict(self, out: SchedulerOutput) -> StepTiming:
        sched = self.schedule_constant + self.schedule_per_request * len(out.scheduled)
        row = batch_terms(out)
        forward = self.typical_forward(row)
        if not self._warned and (beyond := self.beyond_measured(row)):
            self._warned = True
            factor, bound = EXTRAPOLATION_BOUND
            asked = ", ".join(f"{k} {v:.0f} (largest measured {m:.0f})" for k, (v, m) in beyond.items())
            warnings.warn(f"the simulation asks the profile for a step beyond what was measured: {asked}; its time "
                          f"is extrapolated (within {100 * bound:.0f}% up to {factor:g}x the measured tokens, "
                          f"unbounded beyond); to measure such steps, profile with a larger max_step_tokens "
                          f"(sarathi-lite profile --max-step-tokens N, or profile(max_step_tokens=N))",
                          stacklevel=2)
        if self.jitter:  # inverse-CDF draw, linear between the quantiles
            x = self._rng.random() * (len(self.jitter) - 1)
            i = min(int(x), len(self.jitter) - 2)
            forward *= self.jitter[i] + (x - i) * (self.jitter[i + 1] - self.jitter[i])
        return StepTiming(sched, sched + forward)

    def reset(self, seed: int) -> None:
        self._rng.seed(seed)

    def describe(self) -> dict[str, Any]:
        keys = ("model", "dtype", "device", "attention_backend", "machine", "threads", "file")
        return {"kind": "profiled", **{k: self.meta.get(k) for k in keys}, "jitter": bool(self.jitter)}

    def to_dict(self) -> dict[str, Any]:
        return {"schema": COST_MODEL_SCHEMA, "kind": "profiled", "token_knots": list(self.token_knots),
                "token_times": list(self.token_times),
                "coefficients": {t: self.coefficients.get(t, 0.0) for t in TERMS},
                "schedule_constant": self.schedule_constant, "schedule_per_request": self.schedule_per_request,
                "step_gap": self.step_gap, "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_cache_memory": self.kv_cache_memory, "max_position_embeddings": self.max_position_embeddings,
                "jitter": list(self.jitter), "measured": self.measured, "meta": self.meta}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfiledCostModel:
        if d.get("schema") != COST_MODEL_SCHEMA or d.get("kind") != "profiled":
            raise ValueError(f"not a {COST_MODEL_SCHEMA} profiled cost model (schema={d.get('schema')!r}, "
                             f"kind={d.get('kind')!r})")
        if d.get("partial"):
            raise ValueError(f"a partial profile, stopped after {d['partial']}: it holds the raw timings measured "
                             f"so far, not a cost model (a grid cut short misses corners at random); run "
                             f"sarathi-lite profile to the end")
        fields = ("coefficients", "schedule_constant", "schedule_per_request", "step_gap", "kv_bytes_per_token",
                  "kv_cache_memory", "max_position_embeddings", "jitter", "measured", "meta")
        return cls(d["token_knots"], d["token_times"], **{k: d[k] for k in fields if k in d})

    @classmethod
    def load(cls, path: str | Path) -> ProfiledCostModel:
        """The profile saved at ``path``. Raises ``ValueError`` naming the file for one that is not JSON, not a
        profile, or misses a key."""
        try:
            model = cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cost model file {str(path)!r} is not JSON ({e})") from None
        except KeyError as e:
            raise ValueError(f"cost model file {str(path)!r} misses the key {e} (write it again with sarathi-lite "
                             f"profile)") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"cost model file {str(path)!r}: {e}") from None
        model.meta["file"] = str(path)
        return model
