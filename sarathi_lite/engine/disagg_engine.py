"""Disaggregated prefill/decode (and colocated replicas) behind one router, in one process.

``DisaggregatedEngine`` runs several ``LLMEngine`` instances on one set of loaded weights, each with its own KV
pool, scheduler and policy options, behind ``sarathi_lite.scheduler.coordinator`` (the routing and hand-over the
simulator and the instance processes drive too):

- colocated replicas (``"2"``): data parallel, each request served whole by one replica;
- ``"xPyD"``: a prompt is prefilled on a prefill instance as a request with ``max_tokens=1`` (EOS and stop
  strings off, so it always finishes by length and its KV is always sent); its connector saves the prompt's K/V
  (``InProcessKVConnector``, producer) and the blocks are released once saved; the request is then added to a
  decode instance with ``num_external_tokens = prompt_len - 1``, which admits it when its own pool has the
  blocks, loads the K/V of the tokens past its own prefix-cache hit (only the blocks it lacks are written),
  computes the last prompt token and decodes with the request's own sampling parameters. A load that fails
  (the K/V is gone) falls back to recomputing the prompt, with one warning (``LLMEngine``);
- conditional (``Layout.parse("1P1D", threshold=64)``): prompts of at most ``threshold`` tokens are prefilled
  on a decode instance itself;
- hybrid (``"1PH1DH"``, TaiChi): prefill-heavy and decode-heavy instances (the prefill and decode roles, with
  their own options, e.g. ``prefill_options={"chunk_size": 2048}``, ``decode_options={"chunk_size": 128}``), all
  serving requests whole; a request ``routing.HybridRule`` moves is added prefill only to its prefill-heavy
  instance, whose connector saves only such marked requests, and is handed over as above.

Greedy outputs equal one colocated engine's, token for token. The K/V moves through an in-process store, so this
measures the scheduling of both organizations on one machine, not a network transfer (the simulator,
``sarathi_lite.sim.disagg``, prices transfers on a link).

>>> engine = DisaggregatedEngine(instances="1P1D", chunk_size=128)
>>> engine.add_request("a", "Hello", SamplingParams(temperature=0.0, max_tokens=8))
>>> while engine.has_unfinished_requests():
...     outputs = engine.step()
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sarathi_lite.engine.interface import Engine
from sarathi_lite.engine.kv_connector import InProcessKVConnector, kv_store
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.prompts import tokenize_prompt
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.metrics import Stats
from sarathi_lite.scheduler.coordinator import Coordinator, Hold, RequestRecord
from sarathi_lite.scheduler.routing import COLOCATED, DECODE, PREFILL, Layout, Load, load_of

_STORE_IDS = itertools.count()

PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
"""How a real engine runs a request *prefill only* (``coordinator``): one token, by length (EOS and stop strings
off), so the prompt's K/V is always kept for sending; the decode side samples the first token again."""


def deployment_stats(stats: Iterable[tuple[str, Stats]], hybrid: bool = False) -> Stats:
    """A deployment's ``Stats`` from its instances' ``(role, stats)``: the per-request records of the instances
    that produce outputs (decode instances and replicas; TTFT from the arrival, so it includes the prefill
    elsewhere; in a ``hybrid`` deployment prefill-heavy instances too, for the requests no decode-heavy instance
    has a record of) and every instance's iterations."""
    stats = list(stats)
    decoded = {r.request_id for role, s in stats if role == DECODE for r in s.requests} if hybrid else set()
    requests: list[Any] = []
    iterations: list[Any] = []
    for role, s in stats:
        if role != PREFILL:
            requests += s.requests
        elif hybrid:
            requests += [r for r in s.requests if r.request_id not in decoded]
        iterations += s.iterations
    return Stats(requests, iterations)


class EngineInstance:
    """One ``LLMEngine`` of a ``DisaggregatedEngine`` as a ``coordinator.Instance``; its K/V goes through the
    in-process store ``store``."""

    __slots__ = ("engine", "role", "name", "requests", "store", "connector")

    def __init__(self, engine: LLMEngine, role: str, index: int, store: Any) -> None:
        self.engine, self.role, self.name, self.store = engine, role, f"{role}{index}", store
        self.connector = engine.kv_connector
        self.requests: set[str] = set()

    def load(self) -> Load:
        return load_of(self.engine.scheduler)

    def add(self, record: RequestRecord, prefill_only: bool, num_external_tokens: int, hold: Hold | None) -> None:
        prompt, token_ids, params = record.payload
        if prefill_only:
            self.connector.mark(record.request_id)
            self.engine.add_request(record.request_id, token_ids, PREFILL_ONLY, record.arrival)
        else:
            self.engine.add_request(record.request_id, prompt, params, record.arrival,
                                    num_external_tokens=num_external_tokens)

    def release(self, request_id: str, token: Any) -> None:
        self.store.pop(request_id)  # the K/V the decode side did not load (a full prefix-cache hit, an abort)


class DisaggregatedEngine(Engine):
    """Instances of ``layout`` (``"2"``, ``"1P1D"``, a ``Layout``) on one model, behind the router; the step API
    of every ``Engine`` (``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``, ``stats``).

    options: ``LLMEngine`` options for every instance; ``prefill_options`` / ``decode_options`` override them for
    one role (e.g. a larger ``chunk_size`` on prefill instances). Not with tensor parallelism.
    """

    def __init__(self, model: str | Path | None = None, *, instances: str | Layout = "1P1D",
                 prefill_options: dict[str, Any] | None = None, decode_options: dict[str, Any] | None = None,
                 **options: Any) -> None:
        self.layout = instances if isinstance(instances, Layout) else Layout.parse(instances)
        if options.get("tensor_parallel_size", 1) != 1:
            raise ValueError("disaggregation: instances share one process's weights; tensor_parallel_size must be 1")
        self.store_name = f"disagg-{next(_STORE_IDS)}"
        self.store = kv_store(self.store_name)
        role_options = {COLOCATED: options, PREFILL: {**options, **(prefill_options or {})},
                        DECODE: {**options, **(decode_options or {})}}
        counts = {COLOCATED: self.layout.colocated, PREFILL: self.layout.prefill, DECODE: self.layout.decode}
        self.engines: dict[str, list[LLMEngine]] = {COLOCATED: [], PREFILL: [], DECODE: []}
        source: LLMEngine | None = None
        for role in (PREFILL, DECODE, COLOCATED):
            for _ in range(counts[role]):
                connector = None if role == COLOCATED else \
                    InProcessKVConnector(self.store_name, "producer" if role == PREFILL else "consumer", True)
                if source is None:
                    engine = source = LLMEngine(model, connector=connector, **role_options[role])
                else:
                    engine = LLMEngine.from_model(source, connector=connector, **role_options[role])
                self.engines[role].append(engine)
        assert source is not None
        self.tokenizer = source.tokenizer
        self.model_config = source.model_config
        self.model_path = source.model_path
        self._source = source
        self.coordinator = Coordinator(self.layout, {role: [EngineInstance(e, role, i, self.store)
                                                            for i, e in enumerate(engines)]
                                                     for role, engines in self.engines.items()})
        self.routes = self.coordinator.routes
        """request id -> the instances it went through, e.g. ``["prefill0", "decode1"]``."""

    @property
    def scheduler_config(self) -> Any:
        """The scheduler config of the instance with the shortest context (``max_model_len``): what fits in every
        instance."""
        engines = [e for es in self.engines.values() for e in es]
        return min((e.scheduler_config for e in engines), key=lambda c: c.max_model_len)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request on the instance the router picks. Raises ``ValueError`` for bad input (nothing is
        queued then) or an id in use."""
        params = params or SamplingParams()
        if request_id in self.coordinator.requests:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        _, token_ids = tokenize_prompt(self.tokenizer, self.model_path, self.model_config.vocab_size, request_id,
                                       prompt)
        arrival = self._source.clock() if arrival_time is None else arrival_time
        self.coordinator.arrive(request_id, len(token_ids), arrival, (prompt, token_ids, params))

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request wherever it is (waiting or mid-prefill on a prefill instance, waiting for its K/V or
        decoding on a decode instance) and free its blocks on every instance. Raises ``ValueError`` for an unknown
        id."""
        where = self.coordinator.where(request_id)
        if where is None:
            raise ValueError(f"request_id={request_id!r} is unknown or already finished")
        output = where.engine.abort_request(request_id)
        if where.connector is not None:
            where.connector.unmark(request_id)
        self.coordinator.finish(request_id)
        self.store.pop(request_id)
        return output

    def has_unfinished_requests(self) -> bool:
        return any(e.has_unfinished_requests() for e in self._all())

    def get_num_unfinished_requests(self) -> int:
        return len(self.coordinator.requests)

    def reset_prefix_cache(self) -> int:
        return sum(e.reset_prefix_cache() for e in self._all())

    # ------------------------------------------------------------------ one round

    def step(self) -> list[RequestOutput]:
        """One step of every instance with work: decode instances and replicas, then prefill instances, whose
        finished prompts are handed to decode instances for the next round (as in the simulator, where a prompt
        handed over at the end of a prefill step reaches the decode instance's next step). A decode step that only
        loaded K/V ran no forward pass, so that instance steps once more. Returns the outputs of decode instances,
        replicas and prefill-heavy instances; the one token of a request prefilled only is not an output (the
        decode instance samples the first token again)."""
        outputs: list[RequestOutput] = []
        for role in (DECODE, COLOCATED):
            for engine in self.engines[role]:
                if not engine.has_unfinished_requests():
                    continue
                before = engine.metrics.num_iterations
                found = engine.step()
                if engine.metrics.num_iterations == before and engine.scheduler.running:
                    found += engine.step()  # the step only loaded K/V
                for out in found:
                    if out.finished:
                        self.coordinator.finish(out.request_id)  # releases K/V never loaded (a full prefix hit)
                outputs += found
        for inst in self.coordinator.instances[PREFILL]:
            if inst.engine.has_unfinished_requests():
                outputs += self._prefill_step(inst)
        return outputs

    def _prefill_step(self, inst: EngineInstance) -> list[RequestOutput]:
        """One step of a prefill (prefill-heavy) instance: its requests prefilled only are handed over once done;
        the outputs of those it serves whole (a hybrid's) are returned."""
        outputs = []
        for out in inst.engine.step():
            record = self.coordinator.requests.get(out.request_id)
            if record is not None and record.prefill_only and record.where is inst:
                if out.finished:  # its K/V is saved in the store: the coordinator hands it over
                    self.coordinator.hand_over(out.request_id)
                continue
            if out.finished:
                self.coordinator.finish(out.request_id)
            outputs.append(out)
        return outputs

    # ------------------------------------------------------------------ helpers

    def _all(self) -> list[LLMEngine]:
        return [e for role in (PREFILL, DECODE, COLOCATED) for e in self.engines[role]]

    def stats(self) -> Stats:
        """``deployment_stats`` of every instance."""
        return deployment_stats([(role, e.stats()) for role in (PREFILL, DECODE, COLOCATED)
                                 for e in self.engines[role]], self.layout.hybrid is not None)

    def shutdown(self) -> None:
        for engine in self._all():
            engine.shutdown()
