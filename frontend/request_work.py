"""One bound on the work a single request may ask for.

Each parameter of a request has its own limit (``n`` ≤ 16, ``logprobs`` ≤ 20, the body
≤ 4 MiB, prompt + ``max_tokens`` within the context), but their product is what the
server pays for: a 16 KB body of 8 prompts × ``n`` 8 × 1,000 tokens with ``echo``,
``logprobs`` 20 and ``prompt_logprobs`` 20 asked for 2.6 million token entries, a 137 MB
response, and took the frontend from 0.41 to 1.59 GB. So the product is bounded too::

    work = Σ over prompts  n · (prompt_tokens + max_tokens) · (1 + logprobs + prompt_logprobs)

in *token entries*: every prompt or output token a choice carries, each with its chosen
token and its ``logprobs`` (and ``prompt_logprobs``) alternatives. It is an upper bound of
what the response holds (of the engine's work as well: every choice prefills and decodes
its own row). Above ``--max-request-work`` the request is refused with HTTP 400 before
anything reaches the engine. The default (``shared/config.py``), 262,144, holds a full
2,048-token context with 20 + 20 alternatives per token (86,000 entries) three times over.
"""

from __future__ import annotations

from collections.abc import Sequence

def request_work(prompt_lens: Sequence[int], max_tokens: Sequence[int], n: int, logprobs: int | None,
                 prompt_logprobs: int | None = None) -> int:
    """Token entries a request may produce (the formula above). ``prompt_lens`` and
    ``max_tokens``: per prompt, tokens; ``logprobs`` / ``prompt_logprobs``: alternatives per
    token, ``None`` for none."""
    per_token = 1 + (logprobs or 0) + (prompt_logprobs or 0)
    return sum(n * (p + m) * per_token for p, m in zip(prompt_lens, max_tokens))


def work_problem(prompt_lens: Sequence[int], max_tokens: Sequence[int], n: int, logprobs: int | None,
                 prompt_logprobs: int | None, limit: int) -> str | None:
    """Why a request's work exceeds ``limit``, in one sentence naming the limit, or ``None``."""
    work = request_work(prompt_lens, max_tokens, n, logprobs, prompt_logprobs)
    if work <= limit:
        return None
    longest = max(p + m for p, m in zip(prompt_lens, max_tokens))
    extras = "".join(f" + {k} {name}" for k, name in ((logprobs, "logprobs"), (prompt_logprobs, "prompt_logprobs"))
                     if k)
    return (f"this request asks for up to {work:,} token entries ({len(prompt_lens)} prompt(s) × n {n} × up to "
            f"{longest:,} tokens × (1{extras})), above this server's limit of {limit:,} (--max-request-work); "
            "send fewer prompts, a smaller n, max_tokens or logprobs, or split the request")
