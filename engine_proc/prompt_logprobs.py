"""Prompt logprobs: the log-probability the model gives each prompt token given the tokens
before it, computed from the logits of the prefill pass itself (no second forward).

A prefill chunk covering prompt positions ``[start, end)`` yields logits ``[end - start,
vocab]``; the logits at position ``i`` score prompt token ``i + 1``. So a chunk scores
tokens ``start + 1 .. end`` (the last chunk's last row scores no prompt token: it is the
first sampled token's distribution). Token 0 has no context and gets no logprob.

Rows that ask for prompt logprobs do not reuse the prefix cache: a cached block holds KV,
not the logits its tokens were scored with, so their whole prompt is computed (and their
full blocks are still committed for other rows to reuse).

Logprobs are raw: ``log_softmax`` of the model's float32 logits, as the sampler's.
"""

from __future__ import annotations

import torch

from shared.protocol import SamplingParams, TokenLogprob


def wants_prompt_logprobs(params: SamplingParams) -> bool:
    return params.prompt_logprobs is not None


def score_chunk(logits: torch.Tensor, prompt_token_ids: list[int], start: int, k: int) -> list[TokenLogprob]:
    """Logprobs of prompt tokens ``start + 1 .. start + n`` (those that exist) from the
    chunk's logits ``[n, vocab]`` at positions ``start .. start + n - 1``, each with its
    ``k`` most likely alternatives (descending).
    """
    targets = prompt_token_ids[start + 1: start + 1 + logits.shape[0]]
    if not targets:
        return []
    lp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)  # [m, vocab]
    ids = torch.tensor(targets, device=lp.device)
    own = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    top_vals: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if k > 0:
        values, indices = lp.topk(min(k, lp.shape[1]), dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    return [TokenLogprob(token_id=t, logprob=v, top_token_ids=ti, top_logprobs=tv)
            for t, v, ti, tv in zip(targets, own, top_ids, top_vals)]
