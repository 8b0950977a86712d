"""``LLM``: the offline API. Give it prompts, get outputs in input order, with per-request metrics."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.metrics import Stats

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """``LLM(model, scheduler="sarathi", chunk_size=512, ...)``: every ``LLMEngine`` option is accepted.

    >>> llm = LLM()                                            # the embedded SmolLM2-135M-Instruct
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=16))[0]
    >>> out.text, out.token_ids, out.finish_reason, out.metrics.ttft
    """

    def __init__(self, model: str | Path | None = None, disaggregation: Any = None, **engine_options: Any) -> None:
        # disaggregation (issue 25): "2" colocated replicas, "1P1D", or a routing.Layout; None: one engine
        if disaggregation is None:
            self.engine = LLMEngine(model, **engine_options)
        else:
            from sarathi_lite.engine.disagg import DisaggregatedEngine

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
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
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
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
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
