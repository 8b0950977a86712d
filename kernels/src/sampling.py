"""Token sampling (greedy, temperature, top-k, top-p; per-request seeds), logit processing (penalties, logit
bias) and log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._flashinfer import load_flashinfer, use_flashinfer


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row.

    logits: float [B, V]. temperature: float [B]; 0 means greedy (argmax; the row's generator is not used).
    top_p: float [B] in (0, 1]; 1 turns it off. top_k: int [B]; ``k <= 0`` or ``k >= V`` turns it off (ties
    with the k-th largest logit are kept).
    generators: B entries; a row with its own ``torch.Generator`` (on logits' device) draws from it alone, so
    its tokens depend only on its seed and its own logits, never on the rest of the batch; rows without one
    share a draw from torch's default generator. Top-k is applied first, then top-p on the renormalised rest.
    Returns int64 [B].

    FlashInfer's ``sampling.top_k_top_p_sampling_from_logits`` draws the rows without a generator when logits
    are on CUDA, flashinfer imports and its ``sampling`` kernels are prebuilt or compilable.
    """
    tokens = logits.argmax(dim=-1)
    sampled = (temperature > 0).nonzero().flatten()
    if len(sampled) == 0:
        return tokens
    vocab = logits.shape[-1]
    scaled = logits.index_select(0, sampled).float() / temperature.index_select(0, sampled).float()[:, None]
    k = top_k.index_select(0, sampled)
    k = torch.where((k <= 0) | (k >= vocab), vocab, k)
    p = top_p.index_select(0, sampled).float()
    gens = [generators[row] for row in sampled.tolist()]
    if any(g is None for g in gens) and use_flashinfer(scaled, module="sampling", dtypes=(torch.float32,)):
        free = torch.tensor([i for i, g in enumerate(gens) if g is None], device=logits.device)
        drawn = load_flashinfer().sampling.top_k_top_p_sampling_from_logits(
            scaled[free], k[free].to(torch.int32), p[free])
        tokens[sampled[free]] = drawn.long()
        own = [i for i, g in enumerate(gens) if g is not None]
        if not own:
            return tokens
        idx = torch.tensor(own, device=logits.device)
        scaled, k, p, sampled, gens = scaled[idx], k[idx], p[idx], sampled[idx], [gens[i] for i in own]
    tokens[sampled] = _exponential_race(_filtered_probs(scaled, k, p), gens)
    return tokens


def _filtered_probs(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scaled`` [S, V] (float32) after top-k (int [S], V = off) and top-p (float [S], 1 = off);
    tokens filtered out get probability exactly 0."""
    vocab = scaled.shape[-1]
    if bool((top_k < vocab).any()):
        kth = scaled.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if bool((top_p < 1).any()):
        srt, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = srt.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= top_p[:, None]  # keeps the smallest prefix whose mass reaches top_p
        drop[:, 0] = False  # and always the most likely token, even for a top_p that is 0 in float32
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
    return scaled.softmax(dim=-1)


def _exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one index per row of ``probs`` [S, V] as ``argmax(probs / E)``, E ~ Exponential(1) i.i.d. (the same
    distribution as a categorical draw). Rows with a generator draw their own E; the others share one draw."""
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        noise[shared] = torch.empty(len(shared), probs.shape[-1], device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, output_rows: torch.Tensor, output_ids: torch.Tensor,
                    prompt_rows: torch.Tensor, prompt_ids: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM's definitions) on ``logits`` [R, V] float32, in place.

    The token history comes flat: ``output_ids`` int64 [N] (every output token of every row, repeats
    included) with ``output_rows`` int64 [N] their row; ``prompt_ids`` / ``prompt_rows`` int64 [M] likewise for
    the prompts (repeats allowed). repetition, frequency, presence: float32 [R].
    A token seen in the row's prompt or output has its logit divided by ``repetition`` when positive, multiplied
    by it otherwise; then ``frequency * count`` and ``presence * (count > 0)`` are subtracted, ``count`` being
    its occurrences in the output. Returns ``logits``."""
    rows, vocab = logits.shape
    counts = torch.zeros(rows, vocab, dtype=torch.float32, device=logits.device)
    counts.index_put_((output_rows, output_ids), torch.ones_like(output_ids, dtype=torch.float32), accumulate=True)
    seen = counts > 0
    in_output = seen.float()
    seen[prompt_rows, prompt_ids] = True
    r = repetition[:, None]
    penalized = torch.where(logits > 0, logits / r, logits * r)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency[:, None] * counts
    logits -= presence[:, None] * in_output
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
                     ) -> torch.Tensor:
    """Add ``bias`` float32 [N] to ``logits[rows, token_ids]`` (int64 [N] each; pairs distinct) in place;
    returns ``logits``."""
    logits.index_put_((rows, token_ids), bias, accumulate=True)
    return logits


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities (log_softmax in float32) of the chosen tokens and of each row's ``num_top`` best.

    logits: [B, V]; token_ids: int64 [B]. Returns ``(chosen [B] float32, top_ids [B, num_top] int64,
    top_logprobs [B, num_top] float32)``, the top ones in descending order.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.long()[:, None]).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_ids, top_logprobs
