"""Batched per-row sampling for one decode step.

One :class:`Sampler` call turns the model's last-position logits ``[batch, vocab]``
into one token id per row, each row following its own :class:`SamplingParams`.
Per-request state that outlives a step (seeded generator, output-token counts for the
penalties) lives in one :class:`RowSamplingState` per request.

Stages, in order, applied per row (vectorised over the rows that need them; a stage
no row in the batch needs is skipped entirely, so an all-greedy batch costs one
``argmax`` and an all-default one a softmax plus an inverse-CDF draw)::

    1. logit_bias          logits[t] += bias[t]
    2. min_tokens          while num_output_tokens < min_tokens: eos ∪ stop ids → -inf
    3. repetition_penalty  CTRL (Keskar et al. 2019, §4.1), ids in prompt ∪ output:
                           logit > 0 → logit / p, else logit · p
    4. presence/frequency  OpenAI: logit -= frequency · count + presence · (count > 0),
                           counts over output tokens only
    5. greedy rows         (temperature < 1e-5) → argmax
    6. other rows          / temperature → top_k → top_p → min_p → sample
                           (top_k keeps ties with the k-th logit; top_p keeps the
                           smallest most-likely set with mass ≥ top_p, never empty;
                           min_p drops p < min_p · p_max)

Logprobs are the model's *raw* logprobs: ``log_softmax`` of the logits as passed in,
before any stage above (vLLM's default "raw logprobs"). A row with a structured-output
constraint (``RowSamplingState.grammar``) first has every token its grammar forbids set
to ``-inf`` (stage 0, one masked fill for all such rows, :mod:`engine_proc.grammar`): its
logprobs are those of the *constrained* distribution, the raw logits renormalised over
the allowed tokens. A batch without such a row skips stage 0 entirely.

Reproducibility: a seeded row is sampled with its own ``torch.Generator`` through
``torch.multinomial`` on its row alone, and every stage is row-wise, so a seeded
request's tokens depend only on its logits, params and seed — never on which other
rows share the batch or where it sits in it. Unseeded rows share the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine_proc.grammar import apply_bitmask, fill_bitmask
from shared.protocol import SamplingParams, TokenLogprob

_SEED_MASK = (1 << 64) - 1  # torch.Generator.manual_seed takes a uint64


class RowSamplingState:
    """Sampling state of one request, kept across its decode steps.

    Args:
        params: the request's sampling parameters (assumed already validated).
        prompt_token_ids: prompt ids; used by the repetition penalty.
        eos_token_ids: the model's EOS ids; masked while ``min_tokens`` is not reached.
            ``ignore_eos`` does not change this: it only affects the engine's stop check.
        device: where the per-row tensors (generator, counts, masks) live; must be the
            device of the logits passed to :class:`Sampler`.

    The caller calls :meth:`append` with every token it accepts for this request; the
    sampler never appends. Token ids outside ``[0, vocab)`` in the prompt,
    ``logit_bias``, ``eos_token_ids`` or ``stop_token_ids`` are ignored (validate them
    at admission if a client error is wanted).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: list[int],
        device: torch.device | str,
    ) -> None:
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.output_token_ids: list[int] = []
        self.grammar = None  # engine_proc.grammar.RowGrammar of a constrained row, set by the scheduler
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(params.seed & _SEED_MASK)

        # Stage flags, computed once so the per-step scan over the batch is cheap.
        self.greedy = params.greedy
        self.has_bias = bool(params.logit_bias)
        self.has_repetition_penalty = params.repetition_penalty != 1.0
        self.has_presence_frequency = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self.has_top_k = params.top_k is not None
        self.has_top_p = params.top_p < 1.0
        self.has_min_p = params.min_p > 0.0

        self._min_tokens_id_list = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        # Lazily built device tensors; the vocab size is only known at the first step.
        self._counts: Tensor | None = None  # [vocab] int32, output-token counts
        self._num_counted = 0  # output_token_ids[:_num_counted] are folded into _counts
        self._prompt_mask: Tensor | None = None  # [vocab] bool
        self._bias: tuple[Tensor, Tensor] | None = None  # ([n] int64 ids, [n] float32)
        self._min_tokens_ids: Tensor | None = None  # [m] int64

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append(self, token_id: int) -> None:
        """Record one accepted output token. O(1): counts are folded in lazily."""
        self.output_token_ids.append(token_id)

    @property
    def min_tokens_active(self) -> bool:
        """True while EOS and stop token ids must be masked (stage 2)."""
        return len(self.output_token_ids) < self.params.min_tokens and bool(self._min_tokens_id_list)

    def output_counts(self, vocab_size: int) -> Tensor:
        """Occurrences of each token id in the output so far: ``[vocab]`` int32.

        Maintained incrementally: each call folds in only the tokens appended since the
        previous call (one ``index_add_``).
        """
        if self._counts is None or self._counts.numel() != vocab_size:
            self._counts = torch.zeros(vocab_size, dtype=torch.int32, device=self.device)
            self._num_counted = 0
        new = self.output_token_ids[self._num_counted :]
        if new:
            ids = torch.tensor(new, dtype=torch.int64, device=self.device)
            self._counts.index_add_(0, ids, torch.ones(len(new), dtype=torch.int32, device=self.device))
            self._num_counted = len(self.output_token_ids)
        return self._counts

    def prompt_mask(self, vocab_size: int) -> Tensor:
        """Which token ids occur in the prompt: ``[vocab]`` bool (built once)."""
        if self._prompt_mask is None or self._prompt_mask.numel() != vocab_size:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            ids = [t for t in set(self.prompt_token_ids) if 0 <= t < vocab_size]
            if ids:
                mask[torch.tensor(ids, dtype=torch.int64, device=self.device)] = True
            self._prompt_mask = mask
        return self._prompt_mask

    def bias_tensors(self, vocab_size: int) -> tuple[Tensor, Tensor]:
        """``logit_bias`` as ``([n] int64 token ids, [n] float32 biases)`` (built once)."""
        if self._bias is None:
            items = [(int(t), float(b)) for t, b in (self.params.logit_bias or {}).items()]
            items = [(t, b) for t, b in items if 0 <= t < vocab_size]
            ids = torch.tensor([t for t, _ in items], dtype=torch.int64, device=self.device)
            vals = torch.tensor([b for _, b in items], dtype=torch.float32, device=self.device)
            self._bias = (ids, vals)
        return self._bias

    def min_tokens_ids(self, vocab_size: int) -> Tensor:
        """EOS ∪ stop token ids that stage 2 masks: ``[m]`` int64 (built once)."""
        if self._min_tokens_ids is None:
            ids = [t for t in self._min_tokens_id_list if 0 <= t < vocab_size]
            self._min_tokens_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self._min_tokens_ids


@dataclass(frozen=True)
class SamplerOutput:
    """One step's result: ``token_ids[i]`` and ``logprobs[i]`` belong to ``rows[i]``.

    ``logprobs[i]`` is ``None`` unless ``rows[i].params.logprobs`` is set.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Stateless batched sampler; all per-request state is in :class:`RowSamplingState`.

    ``argmax``: ``[B, vocab]`` float32 → ``[B]`` int64 for greedy rows (the backend's
    kernel; ``torch.argmax`` by default, which on a CPU reads a batch-64 row set at a
    fraction of memory speed).
    """

    def __init__(self, argmax=None):
        self._argmax = argmax or (lambda x: x.argmax(dim=-1))

    def __call__(self, logits: Tensor, rows: list[RowSamplingState]) -> SamplerOutput:
        """Pick one token per row.

        Args:
            logits: ``[batch, vocab]`` last-position logits, float32 (other float
                dtypes are upcast). Never modified: stages work on a copy.
            rows: ``batch`` states, ``rows[i]`` for ``logits[i]``, on ``logits.device``.

        Returns:
            :class:`SamplerOutput` with ``batch`` token ids, and for each row asking
            for logprobs the *raw* logprob (``log_softmax(logits)``, before every
            stage) of the sampled token plus the ``params.logprobs`` most likely raw
            alternatives, sorted by descending logprob.

        Only advances seeded rows' generators; call ``RowSamplingState.append`` with
        the tokens the engine accepts.
        """
        batch = logits.shape[0]
        if len(rows) != batch:
            raise ValueError(f"{len(rows)} rows for logits of batch {batch}")
        if batch == 0:
            return SamplerOutput([], [])
        raw = logits if logits.dtype == torch.float32 else logits.float()
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:  # stage 0: the grammar's mask, on a copy
            raw = raw.clone() if raw is logits else raw
            apply_bitmask(raw, constrained, fill_bitmask([rows[i].grammar for i in constrained], raw.shape[1]))
        work = self.process_logits(raw, rows)
        greedy_rows = [i for i, r in enumerate(rows) if r.greedy]
        sampled_rows = [i for i, r in enumerate(rows) if not r.greedy]

        if not sampled_rows:
            tokens = self._argmax(work)
        else:
            tokens = torch.empty(batch, dtype=torch.int64, device=work.device)
            if greedy_rows:
                g = _index(greedy_rows, work.device)
                tokens[g] = self._argmax(work[g])
            s = _index(sampled_rows, work.device)
            tokens[s] = _sample(work[s] if greedy_rows else work, [rows[i] for i in sampled_rows])

        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(raw, rows, tokens, token_list))

    def process_logits(self, logits: Tensor, rows: list[RowSamplingState]) -> Tensor:
        """Stages 1–4 (logit_bias, min_tokens, repetition, presence/frequency).

        Args:
            logits: ``[batch, vocab]`` float32, ``rows[i]`` for ``logits[i]``.

        Returns:
            ``[batch, vocab]``: ``logits`` itself when no row needs any of these stages,
            else a new tensor; ``logits`` is never modified.
        """
        bias_rows = [i for i, r in enumerate(rows) if r.has_bias]
        min_tok_rows = [i for i, r in enumerate(rows) if r.min_tokens_active]
        rep_rows = [i for i, r in enumerate(rows) if r.has_repetition_penalty]
        pf_rows = [i for i, r in enumerate(rows) if r.has_presence_frequency]
        if not (bias_rows or min_tok_rows or rep_rows or pf_rows):
            return logits
        work = logits.clone()
        if bias_rows:
            _apply_logit_bias(work, rows, bias_rows)
        if min_tok_rows:
            _apply_min_tokens(work, rows, min_tok_rows)
        if rep_rows:
            _apply_repetition_penalty(work, rows, rep_rows)
        if pf_rows:
            _apply_presence_frequency(work, rows, pf_rows)
        return work


# ---------------------------------------------------------------- stages 1–4 (in place)


def _index(ids: list[int], device: torch.device) -> Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _apply_logit_bias(logits: Tensor, rows: list[RowSamplingState], which: list[int]) -> None:
    vocab = logits.shape[1]
    pairs = [rows[i].bias_tensors(vocab) for i in which]
    lengths = _index([ids.numel() for ids, _ in pairs], logits.device)
    row_ids = torch.repeat_interleave(_index(which, logits.device), lengths)
    tok_ids = torch.cat([ids for ids, _ in pairs])
    vals = torch.cat([v for _, v in pairs])
    logits.index_put_((row_ids, tok_ids), vals, accumulate=True)


def _apply_min_tokens(logits: Tensor, rows: list[RowSamplingState], which: list[int]) -> None:
    vocab = logits.shape[1]
    ids = [rows[i].min_tokens_ids(vocab) for i in which]
    lengths = _index([t.numel() for t in ids], logits.device)
    row_ids = torch.repeat_interleave(_index(which, logits.device), lengths)
    logits.index_put_((row_ids, torch.cat(ids)), torch.tensor(float("-inf"), device=logits.device))


def _apply_repetition_penalty(logits: Tensor, rows: list[RowSamplingState], which: list[int]) -> None:
    vocab = logits.shape[1]
    idx = _index(which, logits.device)
    seen = torch.stack([rows[i].prompt_mask(vocab) | (rows[i].output_counts(vocab) > 0) for i in which])
    penalty = torch.tensor(
        [rows[i].params.repetition_penalty for i in which], dtype=logits.dtype, device=logits.device
    ).unsqueeze(1)
    sub = logits[idx]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[idx] = torch.where(seen, penalised, sub)


def _apply_presence_frequency(logits: Tensor, rows: list[RowSamplingState], which: list[int]) -> None:
    vocab = logits.shape[1]
    idx = _index(which, logits.device)
    counts = torch.stack([rows[i].output_counts(vocab) for i in which]).to(logits.dtype)
    freq = torch.tensor([rows[i].params.frequency_penalty for i in which], device=logits.device)
    pres = torch.tensor([rows[i].params.presence_penalty for i in which], device=logits.device)
    logits[idx] = logits[idx] - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(logits.dtype)


# ---------------------------------------------------------------- stage 6


def _sample(logits: Tensor, rows: list[RowSamplingState]) -> Tensor:
    """Sample ``[n]`` token ids from ``[n, vocab]`` penalised logits of non-greedy rows."""
    n, vocab = logits.shape
    device = logits.device
    temps = [r.params.temperature for r in rows]
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, dtype=logits.dtype, device=device).unsqueeze(1)

    if any(r.has_top_k and r.params.top_k < vocab for r in rows):
        logits = _apply_top_k(logits, rows)
    if any(r.has_top_p for r in rows):
        logits = _apply_top_p(logits, rows)
    if any(r.has_min_p for r in rows):
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=probs.dtype, device=device)
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    probs = torch.softmax(logits, dim=-1)

    seeded = [j for j, r in enumerate(rows) if r.generator is not None]
    if not seeded:
        return _inverse_cdf(probs)
    tokens = torch.empty(n, dtype=torch.int64, device=device)
    for j in seeded:
        tokens[j] = torch.multinomial(probs[j], 1, generator=rows[j].generator)[0]
    if len(seeded) < n:
        unseeded = _index([j for j, r in enumerate(rows) if r.generator is None], device)
        tokens[unseeded] = _inverse_cdf(probs[unseeded])
    return tokens


def _apply_top_k(logits: Tensor, rows: list[RowSamplingState]) -> Tensor:
    """top_k: mask to -inf every logit below the row's k-th largest.

    Tokens tied with the k-th largest logit are all kept. Costs one ``topk`` of the
    largest k in the batch, not a full sort. Rows without top_k are untouched.
    """
    vocab = logits.shape[1]
    device = logits.device
    limited = [r.has_top_k and r.params.top_k < vocab for r in rows]
    ks = [r.params.top_k if lim else 1 for r, lim in zip(rows, limited)]
    top_values = logits.topk(max(ks), dim=-1).values  # [n, max_k], descending
    kth = top_values.gather(1, _index([k - 1 for k in ks], device).unsqueeze(1))
    unlimited = ~torch.tensor(limited, dtype=torch.bool, device=device).unsqueeze(1)
    kth = kth.masked_fill(unlimited, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: Tensor, rows: list[RowSamplingState]) -> Tensor:
    """top_p (nucleus, Holtzman et al. 2020): mask to -inf all but the smallest set of
    most likely tokens whose probability mass is ≥ top_p.

    In descending order a token is dropped when the mass strictly before it is already
    ≥ top_p; the most likely token is always kept. Applied after top_k, so the mass is
    that of the renormalised top_k distribution. Rows without top_p are untouched.
    """
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=probs.dtype, device=device)
    applies = torch.tensor([r.has_top_p for r in rows], dtype=torch.bool, device=device)
    drop_sorted = (mass_before >= top_p.unsqueeze(1)) & applies.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _inverse_cdf(probs: Tensor) -> Tensor:
    """Sample one id per row of ``[n, vocab]`` probs with the global RNG, without a sync.

    Inverse-transform sampling: the first id whose cumulative probability exceeds
    ``u · total`` with ``u ~ U[0, 1)``; an id of zero probability adds nothing to the
    cumulative sum, so it is never the first to exceed it. About 10× cheaper on CPU than
    an exponential race or ``torch.multinomial`` (one cumsum, no transcendental per id).
    """
    cdf = probs.cumsum(dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max_(probs.shape[1] - 1)


# ---------------------------------------------------------------- logprobs


def _logprobs(
    raw: Tensor, rows: list[RowSamplingState], tokens: Tensor, token_list: list[int]
) -> list[TokenLogprob | None]:
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if not want:
        return out
    idx = _index(want, raw.device)
    lp = torch.log_softmax(raw[idx], dim=-1)
    sampled = lp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
    max_k = min(max(rows[i].params.logprobs for i in want), raw.shape[1])
    top_vals: list[list[float]] = [[] for _ in want]
    top_ids: list[list[int]] = [[] for _ in want]
    if max_k > 0:
        values, ids = lp.topk(max_k, dim=-1)
        top_vals, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(want):
        k = rows[i].params.logprobs
        if rows[i].grammar is not None:  # alternatives the grammar forbids (-inf) are not alternatives
            k = min(k, sum(1 for v in top_vals[j][:k] if v != float("-inf")))
        out[i] = TokenLogprob(
            token_id=token_list[i],
            logprob=sampled[j],
            top_token_ids=top_ids[j][:k],
            top_logprobs=top_vals[j][:k],
        )
    return out
