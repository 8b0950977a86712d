"""What the planner searches: a ``Setup`` (model, GPU preset and count, SLOs and the knobs of the space), the
``Candidate`` deployments that fit it, their simulated form and the arguments that run each for real.

The space, for every tensor-parallel degree T and pipeline degree P (powers of two) whose instance fits the GPU
(its weights leave a KV pool; the cost model's constructor says so):

- ``N`` colocated ``sarathi`` replicas (``N = gpus // (T * P)``) at each of ``chunk_sizes`` (``"auto"``: the budget
  sized to the TBT SLO by the cost model, aiming at P99; not under pipeline parallelism);
- with ``P = 1`` and ``N >= 2``: every ``xPyD`` split (``x + y = N``) with prefill chunk ``prefill_chunk`` and
  decode chunk ``decode_chunk``, and the conditional variant of each split with ``x <= y`` (prompts of at most
  ``threshold`` tokens prefilled on a decode instance), KV over ``link``; with ``hybrid``, the hybrid
  ``xPHyDH`` of each split (TaiChi: ``x`` prefill-heavy instances at ``prefill_chunk``, ``y`` decode-heavy ones at
  ``decode_chunk``, all colocated; ``hybrid_rule`` derives its routing rule from the SLOs and the decode chunk);
- with ``P > 1``: one instance over all its GPUs only (``T * P == gpus``): replicas of a pipelined instance
  would need the simulator of several instances to pipeline, which it does not (``sim.disagg`` runs one step
  at a time per instance).

These are the organizations of the colocate-or-disaggregate study (benchmarks/colocate_vs_disaggregate.py), which
the planner extends with ``auto`` and the parallel degrees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from sarathi_lite.bench.workload import Workload
from sarathi_lite.costs import CostModel, load_cost_model, roofline
from sarathi_lite.costs.calibrated import CALIBRATED_HARDWARE, calibrated
from sarathi_lite.costs.roofline import hardware, model_shape
from sarathi_lite.engine.config import OPTIONS, parse_chunk_size
from sarathi_lite.scheduler import ScheduledRequest, SchedulerOutput
from sarathi_lite.scheduler.routing import HybridRule, Layout
from sarathi_lite.sim.disagg import DEFAULT_ATTAINMENT, LINKS, Deployment

CHUNK_SIZES: tuple[int | str, ...] = (256, 512, 1024, 2048, "auto")
SIM_OPTIONS = {"enable_prefix_caching": False, "max_num_seqs": 512}
"""Every instance's scheduler options, as the study's: the traces share no prefix, and seats never bind."""
AUTO_PERCENTILE = 99.0
"""``chunk_size="auto"`` aims at this percentile of time between tokens (``tbt_percentile``)."""
PROFILE_DECODE_BATCH = 8
"""Decodes per step ``start_rate`` assumes when a measured profile prices the instances."""
LLAMA3_8B_BYTES = 16.06e9
"""Llama-3-8B's weights in bf16 (bytes), the reference of ``start_rate``."""
MAX_CANDIDATES = 1000
"""The most candidates one search takes (each is simulated at several rates): ``space`` refuses more."""


@dataclass(frozen=True)
class Setup:
    """What to plan for: ``model`` (a shape preset or a config.json / checkpoint folder), ``gpu`` (a hardware
    preset), ``gpus`` (how many), SLOs ``ttft`` (seconds) and ``tbt`` (a request's P99 time between tokens,
    seconds) met by at least ``attainment`` of the requests; the space's knobs (module docstring); ``max_degree``:
    the largest tensor x pipeline degree tried (default: ``gpus``); ``checkpoint``: the model the printed commands
    name (default: ``model``); ``hybrid``: list the hybrid variants. Raises ``ValueError`` naming a bad value."""

    model: str
    gpu: str
    gpus: int
    ttft: float
    tbt: float
    attainment: float = DEFAULT_ATTAINMENT
    chunk_sizes: tuple[int | str, ...] = CHUNK_SIZES
    prefill_chunk: int = 2048
    decode_chunk: int = 512
    threshold: int | None = 512
    hybrid: bool = True
    link: str = "infiniband"
    max_degree: int | None = None
    checkpoint: str | None = None
    profile: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"gpus={self.gpus!r} must be a positive integer")
        for name in ("ttft", "tbt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r}: SLOs must be positive (seconds)")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment={self.attainment!r} must be in (0, 1]")
        if self.link not in LINKS:
            raise ValueError(f"link={self.link!r}; choose from {', '.join(LINKS)}")
        if not self.chunk_sizes:
            raise ValueError("chunk_sizes is empty: give at least one chunk size (or 'auto')")
        for c in (*self.chunk_sizes, self.prefill_chunk, self.decode_chunk):
            if c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
                raise ValueError(f"chunk size {c!r} is neither a positive token count nor 'auto'")
        if self.max_degree is not None and self.max_degree < 1:
            raise ValueError(f"max_degree={self.max_degree!r} must be >= 1")
        if self.profile is None:
            hardware(self.gpu)  # an unknown preset: the error names it and the presets
        elif not Path(self.profile).is_file():
            raise ValueError(f"profile={self.profile!r} is not a file (a `sarathi-lite profile` JSON)")
        model_shape(self.model)  # an unknown model: the error names it and the presets

    @property
    def calibrated(self) -> bool:
        """Whether steps are priced on measured GPU timings (else the analytic roofline)."""
        return self.profile is None and self.gpu.lower() in CALIBRATED_HARDWARE


@dataclass(frozen=True)
class Candidate:
    """One deployment of the space: ``layout`` (``"4C"``, ``"2P2D"``, ``"2PH2DH"``), each instance's tensor (``tp``)
    and pipeline (``pp``) degree, ``chunk_size`` (a replica's, or a decode or decode-heavy instance's),
    ``prefill_chunk`` (prefill or prefill-heavy instances'), the conditional ``threshold`` and the ``hybrid``
    rule."""

    layout: str
    tp: int = 1
    pp: int = 1
    chunk_size: int | str = 512
    prefill_chunk: int | None = None
    threshold: int | None = None
    hybrid: HybridRule | None = None

    @property
    def colocated(self) -> bool:
        return self.layout.endswith("C")

    @property
    def spec(self) -> Layout:
        """The ``routing.Layout`` it runs (its ``label`` is what ``LLM``/``serve`` take)."""
        layout = Layout.parse(self.layout, self.threshold)
        return layout if self.hybrid is None else Layout(prefill=layout.prefill, decode=layout.decode,
                                                         hybrid=self.hybrid)

    @property
    def instances_spec(self) -> str:
        """What ``Layout.parse`` (``LLM(disaggregation=...)``, ``serve --instances``) takes, beside ``threshold``:
        ``"2P2D"``, or a hybrid's label with its rule."""
        return self.layout if self.hybrid is None else self.spec.label

    @property
    def instances(self) -> int:
        layout = self.spec
        return layout.colocated + layout.prefill + layout.decode

    @property
    def num_gpus(self) -> int:
        return self.instances * self.tp * self.pp

    @property
    def label(self) -> str:
        """As the study labels it (``4C@1024``, ``2P2D/cond512``), with the degrees when not 1 (`` tp2 pp2``)."""
        base = f"{self.layout}@{self.chunk_size}" if self.colocated else self.spec.label
        if self.hybrid is not None and self.chunk_size == "auto":
            base += " DH@auto"  # decode-heavy instances at the TBT-sized budget
        return base + (f" tp{self.tp}" if self.tp > 1 else "") + (f" pp{self.pp}" if self.pp > 1 else "")


@dataclass(slots=True)
class Space:
    """The candidates that fit, and the instance shapes that did not with the reason (``skipped``)."""

    candidates: list[Candidate]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _powers_of_two(top: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(top)) + 1)]


@lru_cache(maxsize=64)
def cost_model(model: str, gpu: str, tp: int = 1, pp: int = 1, profile: str | None = None) -> CostModel:
    """The cost model of one instance: the measured ``profile`` when given (degree 1 only), else calibrated on
    measured timings where the preset has them, else the analytic roofline. Raises ``ValueError`` when the model
    does not fit (no memory left for a KV pool, heads or layers that do not split)."""
    if profile is not None:
        if tp * pp > 1:
            raise ValueError(f"a measured profile prices one instance on one device: tensor x pipeline degree "
                             f"{tp * pp} is not in it")
        return load_cost_model(profile)
    if gpu.lower() in CALIBRATED_HARDWARE:
        return calibrated(gpu.lower(), model, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return roofline(gpu.lower(), model, tensor_parallel_size=tp, pipeline_parallel_size=pp)


def cost_spec(setup: Setup, tp: int) -> str:
    """The ``cost_model`` text (``roofline:2xh100:llama3-8b``, or the profile's path) the engine's ``auto`` budget
    loads for it."""
    if setup.profile is not None:
        # as given, when the printed commands find it from where plan ran; absolute when it lies above (../)
        path = Path(setup.profile)
        return str(path.resolve()) if ".." in path.parts else str(path)
    return f"roofline:{f'{tp}x' if tp > 1 else ''}{setup.gpu.lower()}:{setup.model}"


def space(setup: Setup) -> Space:
    """Every candidate of ``setup`` (module docstring). Raises ``ValueError`` naming the model, GPU and count
    when none fits."""
    out = Space([])
    top = setup.max_degree or setup.gpus
    for tp in _powers_of_two(min(top, setup.gpus)):
        for pp in _powers_of_two(min(top, setup.gpus) // tp):
            n = setup.gpus // (tp * pp)
            if n < 1 or (pp > 1 and n != 1):
                continue
            try:
                cost_model(setup.model, setup.gpu, tp, pp, setup.profile)
            except ValueError as e:
                out.skipped.append((f"tp{tp} pp{pp}", str(e)))
                continue
            out.candidates += _organizations(setup, n, tp, pp)
            if len(out.candidates) > MAX_CANDIDATES:
                raise ValueError(f"gpus={setup.gpus}: more than {MAX_CANDIDATES} candidate deployments (each is "
                                 f"simulated at several rates); plan for fewer GPUs (goodput is per GPU: plan one "
                                 f"group, then run copies of it), or narrow the space (--max-degree, "
                                 f"fewer --chunk-sizes, --no-hybrid, --conditional-threshold -1)")
    if not out.candidates:
        reasons = "; ".join(f"{shape}: {why}" for shape, why in out.skipped) or "no instance shape to try"
        raise ValueError(f"model={setup.model!r} fits no deployment on gpus={setup.gpus} x gpu={setup.gpu!r} "
                         f"({reasons})")
    return out


def hybrid_rule(setup: Setup) -> HybridRule:
    """The hybrid candidates' routing rule, from the SLOs and the decode-heavy chunk ``c`` (512 for ``auto``): a
    decode-heavy step (at most ``c`` tokens) is taken to fit the TBT SLO, so ``tbt_tokens = c`` and, the TTFT SLO
    lasting ``ttft / tbt`` such steps, ``ttft_tokens = c * ttft / tbt``; prompts of at most ``c`` tokens are short.
    Every prompt a prefill-heavy instance gets is longer than ``c``, so every one moves after its prefill, as
    the study's ``move`` rule (docs/results/hybrid.md). With ``auto`` among the chunk sizes, each split's hybrid
    is also listed with decode-heavy instances at ``auto``: the study's best hybrid in most cells."""
    c = setup.decode_chunk if isinstance(setup.decode_chunk, int) else 512
    return HybridRule(short=c, ttft_tokens=int(c * setup.ttft / setup.tbt), tbt_tokens=c)


def _organizations(setup: Setup, n: int, tp: int, pp: int) -> list[Candidate]:
    chunks = [c for c in setup.chunk_sizes if pp == 1 or c != "auto"]
    found = [Candidate(f"{n}C", tp, pp, c) for c in chunks]
    if pp == 1:
        for x in range(1, n):
            found.append(Candidate(f"{x}P{n - x}D", tp, 1, setup.decode_chunk, setup.prefill_chunk))
            if setup.threshold is not None and x <= n - x:
                found.append(Candidate(f"{x}P{n - x}D", tp, 1, setup.decode_chunk, setup.prefill_chunk,
                                       setup.threshold))
            if setup.hybrid:
                for chunk in dict.fromkeys([setup.decode_chunk] + (["auto"] if "auto" in setup.chunk_sizes else [])):
                    found.append(Candidate(f"{x}PH{n - x}DH", tp, 1, chunk, setup.prefill_chunk,
                                           hybrid=hybrid_rule(setup)))
    return found


def scheduler_options(setup: Setup, chunk: int | str) -> dict[str, Any]:
    """The scheduler options of an instance at ``chunk`` (``auto``: the TBT target and its percentile)."""
    if chunk == "auto":
        return {**SIM_OPTIONS, "tbt_slo": setup.tbt, "tbt_percentile": AUTO_PERCENTILE}
    return dict(SIM_OPTIONS)


def deployment(setup: Setup, cand: Candidate) -> Deployment:
    """The simulated deployment of ``cand`` (``sim.disagg``)."""
    cm = cost_model(setup.model, setup.gpu, cand.tp, cand.pp, setup.profile)
    if cand.colocated:
        return Deployment.parse(cand.layout, cm, chunk_size=cand.chunk_size,
                                options=scheduler_options(setup, cand.chunk_size))
    return Deployment.parse(cand.instances_spec, cm, chunk_size=cand.chunk_size, prefill_chunk_size=cand.prefill_chunk,
                            threshold=cand.threshold, link=LINKS[setup.link],
                            options=scheduler_options(setup, cand.chunk_size))


def start_rate(setup: Setup, workload: Workload) -> float:
    """Where a candidate's rate search starts (requests/s per GPU, on the grid ``2 ** (k / 2)``): the study's 2
    for Llama-3-8B on the conversation trace (1,324 tokens a request), scaled by the model's weights and the
    requests' mean tokens. With a measured ``profile``: half of what one instance would serve if every prompt
    were prefilled alone and every output decoded in batches of ``PROFILE_DECODE_BATCH``."""
    if setup.profile is not None:
        return _snap(0.5 / _seconds_per_request(cost_model(setup.model, setup.gpu, 1, 1, setup.profile), workload))
    _, m = model_shape(setup.model)
    weights = 2 * (m.num_layers * m.layer_weights(1) + m.lm_head_weights(1))
    tokens = sum(r.prompt_len + r.output_len for r in workload.requests) / max(len(workload.requests), 1)
    guess = 2.0 * (LLAMA3_8B_BYTES / weights) * (1324.0 / max(tokens, 1.0))
    return _snap(guess)


def _snap(rate: float) -> float:
    """The grid point ``2 ** (k / 2)`` at or below ``rate``."""
    return 2.0 ** (math.floor(2 * math.log2(rate) + 1e-6) / 2)


def _seconds_per_request(cm: CostModel, workload: Workload) -> float:
    """Predicted busy seconds of one instance per request of ``workload``: its mean prompt in one step, and its
    mean output in decode steps of ``PROFILE_DECODE_BATCH`` requests at that context."""
    n = max(len(workload.requests), 1)
    prompt = max(1, round(sum(r.prompt_len for r in workload.requests) / n))
    output = sum(r.output_len for r in workload.requests) / n
    prefill, decodes = SchedulerOutput(), SchedulerOutput()  # ``add`` keeps their token and request counts
    prefill.add(ScheduledRequest("p", 0, prompt, [0] * prompt, [], True, True))
    for i in range(PROFILE_DECODE_BATCH):
        decodes.add(ScheduledRequest(f"d{i}", prompt, 1, [0], [], True, False))
    return cm.predict_step_time(prefill) + output * cm.predict_step_time(decodes) / PROFILE_DECODE_BATCH


# ---------------------------------------------------------------------- how to run it for real

def launch(setup: Setup, cand: Candidate) -> dict[str, Any]:
    """How to run ``cand``: ``llm`` (``LLM(...)``'s keywords, with ``disaggregation`` as text), ``serve``
    (``sarathi-lite serve``'s arguments) and ``note`` (what the real engine cannot run as simulated)."""
    model = setup.checkpoint or setup.model
    common: dict[str, Any] = {"chunk_size": cand.chunk_size, **SIM_OPTIONS}
    if cand.chunk_size == "auto":
        common.update(cost_model=cost_spec(setup, cand.tp), tbt_slo=setup.tbt, tbt_percentile=AUTO_PERCENTILE)
    if cand.tp > 1:
        common["tensor_parallel_size"] = cand.tp
    if cand.pp > 1:
        common["pipeline_parallel_size"] = cand.pp
    llm: dict[str, Any] = {"model": model}
    serve = ["serve", model]
    notes = []
    if cand.colocated and cand.instances > 1:
        llm["data_parallel_size"] = cand.instances
        serve += ["--data-parallel-size", str(cand.instances)]
    elif not cand.colocated:
        llm["disaggregation"] = (f"Layout.parse({cand.layout!r}, threshold={cand.threshold})"
                                 if cand.threshold is not None else repr(cand.instances_spec))
        serve += ["--instances", cand.instances_spec]
        if cand.threshold is not None:
            serve += ["--conditional-threshold", str(cand.threshold)]
        if cand.prefill_chunk != cand.chunk_size:
            llm["prefill_options"] = {"chunk_size": cand.prefill_chunk}
            serve += ["--prefill-chunk-size", str(cand.prefill_chunk)]
    if cand.instances > 1 and cand.tp * cand.pp > 1:
        notes.append("this engine runs instances as processes at tensor/pipeline degree 1 only "
                     "(engine.instances): the command shows the planned shape")
    llm.update(common)
    serve += _flags(common)
    return {"llm": llm, "serve": serve, "note": "; ".join(notes)}


def _flags(options: dict[str, Any]) -> list[str]:
    """The command-line flags of engine options (``cli.common.flag_name``'s rule)."""
    out = []
    for name, value in options.items():
        flag = "--" + OPTIONS[name].metadata.get("flag", name).replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def llm_text(llm: dict[str, Any]) -> str:
    """``LLM(...)`` as Python text (``disaggregation`` is already text)."""
    parts = [repr(llm["model"])]
    for k, v in llm.items():
        if k != "model":
            parts.append(f"{k}={v}" if k == "disaggregation" else f"{k}={v!r}")
    return f"LLM({', '.join(parts)})"


def parse_chunk_sizes(text: str) -> tuple[int | str, ...]:
    """``"256,512,auto"`` -> ``(256, 512, "auto")``; raises ``ValueError`` naming bad text."""
    return tuple(parse_chunk_size(x.strip()) for x in text.split(",") if x.strip())
