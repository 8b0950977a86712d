"""``LLM``: the offline API. Give it prompts, get outputs in input order, with per-request metrics."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sarathi_lite.engine.disagg import DisaggregatedEngine
from sarathi_lite.engine.instances import ProcessEngine
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.sampling_params import SamplingParams, check_text
from sarathi_lite.metrics import Stats

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """``LLM(model, scheduler="sarathi", chunk_size=512, ...)``: every ``LLMEngine`` option is accepted.

    >>> llm = LLM()                                            # the embedded SmolLM2-135M-Instruct
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=16))[0]
    >>> out.text, out.token_ids, out.finish_reason, out.metrics.ttft
    """

    def __init__(self, model: str | Path | None = None, disaggregation: Any = None, processes: bool = True,
                 **engine_options: Any) -> None:
        # disaggregation (issue 25): "2" colocated replicas, "1P1D", or a routing.Layout; None: one engine.
        # processes: each instance in its own process (ProcessEngine: own weights, K/V over gloo), or all in
        # this one sharing the weights (DisaggregatedEngine). Options of either (prefill_options=, num_threads=,
        # ...) pass through.
        if disaggregation is None:
            self.engine = LLMEngine(model, **engine_options)
        elif processes:
            self.engine = ProcessEngine(model, instances=disaggregation, **engine_options)
        else:
            self.engine = DisaggregatedEngine(model, instances=disaggregation, **engine_options)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] |
                 None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids) and return the outputs in input order.

        params: one ``SamplingParams`` for all prompts, or one per prompt. If a prompt is rejected
        (``ValueError``), none of this call's prompts stays queued; other requests of the engine go on.
        A request whose step fails for an unexpected reason comes back with ``finish_reason="error"`` (and the
        reason in ``error``); the others, and later calls, are unaffected. Only a broken device or worker raises
        (``EngineDeadError``).
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be text, token ids, or a list of either; got {type(prompts).__name__}")
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif not isinstance(params, Sequence):
            raise ValueError(f"params must be SamplingParams or a list of them; got {type(params).__name__}")
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}] must be SamplingParams; got {type(p).__name__}")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of ``{"role", "content"}`` dicts) or a
        list of conversations, then ``generate``."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"the model at {self.engine.model_path} has no chat template")
        if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts (or a list of "
                             f"such lists); got {messages!r:.80}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        for c, conversation in enumerate(conversations):
            _check_conversation(conversation, "messages" if len(conversations) == 1 else f"messages[{c}]")
        prompts = [tok.apply_chat_template(list(c), tokenize=False, add_generation_prompt=True)
                   for c in conversations]
        return self.generate([tok(p, add_special_tokens=False).input_ids for p in prompts], params, use_tqdm)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix; returns the KV blocks dropped (see ``LLMEngine``)."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> Stats:
        """Per-request and per-iteration records of everything this ``LLM`` ran."""
        return self.engine.stats()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        try:
            return self._steps(ids, use_tqdm)
        except BaseException:  # a dead engine, or KeyboardInterrupt: leave none of this call's requests queued
            for rid in ids:
                try:
                    self.engine.abort_request(rid)
                except (ValueError, RuntimeError):  # finished already, or the engine is gone
                    pass
            raise

    def _steps(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while pending:
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    pending.discard(output.request_id)
                    results[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in ids]


def _check_conversation(conversation: Any, name: str) -> None:
    """Raise ``ValueError`` naming the message unless ``conversation`` is a non-empty list of dicts with a
    string ``role`` and string ``content`` (valid Unicode)."""
    if isinstance(conversation, (str, bytes, dict)) or not isinstance(conversation, Sequence) or not conversation:
        raise ValueError(f"{name} must be a non-empty list of {{'role', 'content'}} dicts; got {conversation!r:.80}")
    for i, m in enumerate(conversation):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be a dict with 'role' and 'content'; got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"{where}: {key!r} must be a string; got {m.get(key)!r:.80}")
            check_text(f"{where}.{key}", m[key])
