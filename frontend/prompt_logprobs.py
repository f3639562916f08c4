"""Prompt logprobs on ``/v1/completions``: what evaluation harnesses send to score text.

Two request shapes ask for them:

- OpenAI's legacy ``echo: true`` with ``logprobs: k`` (lm-evaluation-harness's
  ``local-completions`` model sends ``echo: true, logprobs: 1`` with ``max_tokens`` 0 or 1
  for loglikelihood tasks): the choice's ``logprobs`` then covers the prompt tokens first
  (the first with ``null``: it has no context), then the generated ones;
- vLLM's ``prompt_logprobs: k`` sampling parameter: the choice gets a ``prompt_logprobs``
  list, ``null`` first, then per prompt token a map ``token id → {logprob, rank?,
  decoded_token}`` holding the prompt token and its ``k`` most likely alternatives
  (``rank`` is given where the token is among them).

``max_tokens: 0`` is valid with either: the prompt is scored and nothing is generated
(``finish_reason`` "length"). The engine scores the prompt in the prefill pass; such
requests do not use the prefix cache (see ``engine_proc/prompt_logprobs.py``).
"""

from __future__ import annotations

from typing import Callable

from shared.protocol import TokenLogprob


def engine_prompt_logprobs(echo: bool, logprobs: int | None, prompt_logprobs: int | None,
                           max_tokens: int | None) -> int | None:
    """The engine's ``SamplingParams.prompt_logprobs`` for a completions request (k
    alternatives), or ``None`` when the prompt need not be scored."""
    wanted = []
    if prompt_logprobs is not None:
        wanted.append(prompt_logprobs)
    if echo and (logprobs is not None or max_tokens == 0):
        wanted.append(logprobs or 0)
    return max(wanted) if wanted else None


def legacy_prompt_part(prompt_ids: list[int], scored: list[TokenLogprob] | None, k: int,
                       token_str: Callable[[int], str]) -> dict:
    """OpenAI's legacy ``logprobs`` lists for the echoed prompt tokens (``text_offset``
    from 0); the generated part is appended after them by the caller."""
    scored = scored or []
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for i, tid in enumerate(prompt_ids):
        s = token_str(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        lp = scored[i - 1] if 0 < i <= len(scored) else None
        token_lps.append(lp.logprob if lp else None)
        tops.append({token_str(t): v for t, v in zip(lp.top_token_ids[:k], lp.top_logprobs[:k])} if lp else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(scored: list[TokenLogprob] | None, k: int, decode: Callable[[int], str]) -> list:
    """vLLM's ``prompt_logprobs`` field: ``[None, {id: {...}}, ...]`` (ids as strings, as JSON)."""
    out: list = [None]
    for lp in scored or []:
        entry = {}
        for rank, (t, v) in enumerate(zip(lp.top_token_ids[:k], lp.top_logprobs[:k]), start=1):
            entry[str(t)] = {"logprob": v, "rank": rank, "decoded_token": decode(t)}
        if str(lp.token_id) not in entry:
            entry = {str(lp.token_id): {"logprob": lp.logprob, "decoded_token": decode(lp.token_id)}, **entry}
        out.append(entry)
    return out
