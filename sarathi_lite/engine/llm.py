"""``LLM``: the offline API. Give it prompts, get outputs in input order, with per-request metrics."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sarathi_lite.engine.disagg_engine import DisaggregatedEngine
from sarathi_lite.engine.instances import ProcessEngine
from sarathi_lite.engine.interface import Engine
from sarathi_lite.engine.llm_engine import LLMEngine
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.parallel_sampling import child_ids, child_params, pick
from sarathi_lite.engine.prompts import chat_messages, check_context
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
                 data_parallel_size: int | None = None, **engine_options: Any) -> None:
        # disaggregation (issue 25): "2" colocated replicas, "1P1D", or a routing.Layout; None: one engine.
        # data_parallel_size=N: N colocated replicas, as serve's --data-parallel-size (disaggregation=str(N)).
        # processes: each instance in its own process (ProcessEngine: own weights, K/V over gloo), or all in
        # this one sharing the weights (DisaggregatedEngine). Options of either (prefill_options=, num_threads=,
        # ...) pass through.
        disaggregation = replicas_layout(data_parallel_size, disaggregation)
        self.engine: Engine
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

        params: one ``SamplingParams`` for all prompts, or one per prompt. A prompt that is empty, or that
        does not fit in the context with its ``max_tokens``, or any other bad input raises ``ValueError`` naming
        the prompt (``prompts[2]: ...``; the same rule as the server's, ``prompts.check_context``); none of
        this call's prompts stays queued then, and other requests of the engine go on. With ``n`` > 1 (or
        ``best_of``) each prompt's output is its first completion and ``outputs`` holds all ``n``
        (``parallel_sampling``: the completions after the first share the prompt's KV through the prefix
        cache). A request whose step fails for an unexpected reason comes back with ``finish_reason="error"``
        (and the reason in ``error``); the others, and later calls, are unaffected. Only a broken device or
        worker raises (``EngineDeadError``).
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
        groups = [_Group(f"gen-{next(self._ids)}", prompt, p) for prompt, p in zip(prompts, params)]
        added: list[str] = []
        try:
            for i, g in enumerate(groups):
                where = f"prompts[{i}]"
                g.token_ids = self._token_ids(g.prompt, where)
                check_context(len(g.token_ids), g.params.max_tokens, self._max_model_len(), where)
                try:
                    self.engine.add_request(g.ids[0], g.prompt, g.children[0])
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
                added.append(g.ids[0])
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(groups, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of ``{"role", "content"}`` dicts,
        ``content`` a string or a list of ``{"type": "text", "text"}`` parts; roles as ``prompts.ROLES``) or a
        list of conversations, then ``generate``. The server's chat route checks messages with the same
        function (``prompts.chat_messages``)."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"the model at {self.engine.model_path} has no chat template")
        if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts (or a list of "
                             f"such lists); got {messages!r:.80}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        where = ["messages" if len(conversations) == 1 else f"messages[{i}]" for i in range(len(conversations))]
        return self.generate([self.chat_token_ids(c, w) for c, w in zip(conversations, where)], params, use_tqdm)

    def chat_token_ids(self, conversation: Sequence[Message], where: str = "messages") -> list[int]:
        """The prompt token ids of one conversation under the model's chat template, ending where the assistant
        answers (what ``chat`` generates from). Raises ``ValueError`` naming ``where`` for bad messages."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"the model at {self.engine.model_path} has no chat template")
        text = tok.apply_chat_template(chat_messages(conversation, where), tokenize=False,
                                       add_generation_prompt=True)
        return tok(text, add_special_tokens=False).input_ids

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix; returns the KV blocks dropped (see ``LLMEngine``)."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> Stats:
        """Per-request and per-iteration records of everything this ``LLM`` ran."""
        return self.engine.stats()

    def _token_ids(self, prompt: Any, where: str) -> list[int]:
        """The token ids of ``prompt`` (text is tokenized as the engine does), to check its fit."""
        if isinstance(prompt, str):
            tok = self.tokenizer
            if tok is None:
                raise ValueError(f"{where}: text prompts need a tokenizer in {self.engine.model_path}")
            check_text(f"{where}: prompt", prompt)
            return tok(prompt).input_ids
        if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
            raise ValueError(f"{where}: prompt must be text or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)

    def _max_model_len(self) -> int:
        return self.engine.scheduler_config.max_model_len

    def _run(self, groups: list[_Group], use_tqdm: bool) -> list[RequestOutput]:
        try:
            return self._steps(groups, use_tqdm)
        except BaseException:  # a dead engine, or KeyboardInterrupt: leave none of this call's requests queued
            for g in groups:
                for rid in g.ids[:g.num_added]:
                    try:
                        self.engine.abort_request(rid)
                    except (ValueError, RuntimeError):  # finished already, or the engine is gone
                        pass
            raise

    def _steps(self, groups: list[_Group], use_tqdm: bool) -> list[RequestOutput]:
        by_id = {rid: g for g in groups for rid in g.ids}
        pending = set(by_id)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(pending), desc="generate", unit="req")
        while pending:
            for output in self.engine.step():
                rid = output.request_id
                g = by_id.get(rid)
                if g is None:
                    continue
                if g.num_added == 1 and rid == g.ids[0] and len(g.ids) > 1:
                    g.add_siblings(self.engine)  # the prompt is prefilled: the others take its KV blocks
                if output.finished and rid in pending:
                    pending.discard(rid)
                    results[rid] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        outs = []
        for g in groups:
            done = [results[rid] for rid in g.ids]
            for out in done[1:]:
                out.prompt = done[0].prompt
            chosen = pick(done, g.params)
            chosen[0].outputs = chosen if len(g.ids) > 1 else None
            outs.append(chosen[0])
        return outs


def replicas_layout(data_parallel_size: int | None, disaggregation: Any = None) -> Any:
    """The instance layout of ``data_parallel_size`` replicas (``"N"``; ``None``, one engine, for 1), or
    ``disaggregation`` when no size is given. Raises ``ValueError`` for a size below 1 or both given."""
    if data_parallel_size is None:
        return disaggregation
    if disaggregation is not None:
        raise ValueError("give disaggregation= or data_parallel_size=, not both")
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size!r} must be an integer >= 1")
    return str(data_parallel_size) if data_parallel_size > 1 else None


class _Group:
    """The completions of one prompt in ``LLM.generate``: the first is added at once, the others once it has
    been prefilled."""

    def __init__(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        self.prompt = prompt
        self.params = params
        self.ids = child_ids(request_id, params)
        self.children = child_params(params)
        self.token_ids: list[int] = []
        self.num_added = 1

    def add_siblings(self, engine: Engine) -> None:
        for rid, p in zip(self.ids[1:], self.children[1:]):
            engine.add_request(rid, self.token_ids, p)
            self.num_added += 1
