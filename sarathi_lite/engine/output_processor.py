"""``OutputProcessor``: the engine's per-request output side: detokenize each step's tokens, match stop strings,
keep logprobs, and build the ``RequestOutput`` deltas. It holds what the scheduler does not need."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sarathi_lite.engine.detokenizer import IncrementalDetokenizer
from sarathi_lite.engine.outputs import RequestOutput
from sarathi_lite.engine.sampler import History
from sarathi_lite.engine.sampling_params import SamplingParams
from sarathi_lite.metrics import RequestMetrics
from sarathi_lite.scheduler import Request


@dataclass(slots=True)
class RequestState:
    """The engine's side of a request."""

    request: Request
    prompt: str | None
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    logprobs: list[Any] | None = field(default=None)
    # EOS and stop tokens the sampler must not pick while fewer than ``min_tokens`` tokens are out
    banned: tuple[int, ...] = ()


class OutputProcessor:
    """The live requests' output state, keyed by request id.

    tokenizer: a Hugging Face tokenizer or ``None`` (then texts are ``""``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}

    def add(self, request: Request, prompt: str | None, params: SamplingParams, metrics: RequestMetrics) -> None:
        banned = tuple(sorted(request.stop_token_ids)) if params.min_tokens else ()
        self._states[request.request_id] = RequestState(
            request, prompt, params, metrics, IncrementalDetokenizer(self.tokenizer, request.output_token_ids, params),
            [] if params.logprobs is not None else None, banned)

    def get(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._states.values())

    def __len__(self) -> int:
        return len(self._states)

    def remove(self, request_id: str) -> RequestState | None:
        return self._states.pop(request_id, None)

    def sampling(self, request_ids: list[str]) -> tuple[dict[str, SamplingParams], dict[str, tuple[int, ...]],
                                                        dict[str, History]]:
        """The sampling parameters of ``request_ids`` (the rows of a batch that sample), the token ids each
        must not sample in that row (``min_tokens`` not yet reached, counting tokens still being sampled by
        batches in flight), and the ``(prompt, output)`` token lists of those with a penalty (the lists
        themselves, not copies: the sampler reads them once, on the request's first sampled row)."""
        params, banned, history = {}, {}, {}
        for rid in request_ids:
            state = self._states[rid]
            params[rid] = state.params
            req = state.request
            if state.params.penalized:
                history[rid] = (req.prompt_token_ids, req.output_token_ids)
            if state.banned and len(req.output_token_ids) + max(req.num_pending_samples - 1, 0) \
                    < state.params.min_tokens:
                banned[rid] = state.banned
        return params, banned, history

    def process(self, tokens: Mapping[str, int], logprobs: Mapping[str, Any],
                stop: Callable[[Request], None]) -> list[RequestOutput]:
        """The outputs of one step's sampled ``tokens`` (the scheduler has appended them). A request whose text
        just matched a stop string is ended by ``stop(request)`` (which frees it and sets its ``finish_reason``)
        before its output is built. Finished requests are removed."""
        outputs = []
        for rid, token in tokens.items():
            state = self._states.get(rid)
            if state is None:
                continue
            new_logprobs = None
            if state.logprobs is not None:
                new_logprobs = [logprobs.get(rid)]
                state.logprobs.append(new_logprobs[0])
            req = state.request
            text = state.detokenizer.update(req.finish_reason is not None)
            if state.detokenizer.stop_reason is not None and req.finish_reason is None:
                stop(req)
            outputs.append(self.output(state, [token], text, new_logprobs))
            if req.finish_reason is not None:
                del self._states[rid]
        return outputs

    def output(self, state: RequestState, new_token_ids: list[int], new_text: str,
               new_logprobs: list[Any] | None = None) -> RequestOutput:
        """A ``RequestOutput`` delta; when the request has finished, also its whole output."""
        req = state.request
        out = RequestOutput(req.request_id, state.prompt, req.prompt_token_ids, new_token_ids, new_text,
                            len(req.output_token_ids), req.finish_reason, state.metrics, new_logprobs,
                            state.detokenizer.stop_reason)
        if req.finish_reason is not None:
            out.token_ids = req.output_token_ids
            out.text = state.detokenizer.text
            out.logprobs = state.logprobs
        return out
