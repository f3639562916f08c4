"""Sampler: stages, reproducibility of seeded rows, raw logprobs, distribution.

Fast, CPU only, no model: logits are random with fixed torch seeds or built by hand.
Run with ``.venv/bin/python -m pytest tests/test_sampler.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_proc.sampler import RowSamplingState, Sampler, SamplerOutput
from shared.protocol import SamplingParams

CPU = torch.device("cpu")


def row(prompt: list[int] | None = None, eos: list[int] | None = None, **params) -> RowSamplingState:
    return RowSamplingState(SamplingParams(**params), prompt or [], eos or [], CPU)


def rand_logits(batch: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


# ---------------------------------------------------------------- greedy and truncation


def test_greedy_is_argmax(sampler):
    logits = rand_logits(16, 100)
    out = sampler(logits, [row(temperature=0.0) for _ in range(16)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_stay_argmax_in_a_mixed_batch(sampler):
    logits = rand_logits(8, 50, seed=1)
    rows = [row(temperature=0.0) if i % 2 == 0 else row(temperature=1.0, top_p=0.9) for i in range(8)]
    out = sampler(logits, rows)
    expected = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in range(0, 8, 2)] == expected[0::2]


@pytest.mark.parametrize("seed", [None, 7])
def test_top_k_1_equals_greedy(sampler, seed):
    torch.manual_seed(0)
    logits = rand_logits(16, 100, seed=2, scale=1.0)
    out = sampler(logits, [row(temperature=1.5, top_k=1, seed=seed) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("seed", [None, 7])
def test_tiny_top_p_equals_greedy(sampler, seed):
    torch.manual_seed(0)
    logits = rand_logits(16, 100, seed=3, scale=1.0)
    out = sampler(logits, [row(temperature=1.0, top_p=1e-6, seed=seed) for _ in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_p_always_keeps_the_most_likely_token(sampler):
    # top_p = 0 is rejected by validate(); the sampler still degrades to greedy.
    logits = rand_logits(8, 30, seed=9)
    out = sampler(logits, [row(top_p=0.0, seed=i) for i in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_smallest_set_reaching_the_mass(sampler):
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.8 keeps {0, 1} (0.5 < 0.8, 0.5 + 0.3 ≥ 0.8).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(400, 1)
    torch.manual_seed(0)
    out = sampler(logits, [row(top_p=0.8) for _ in range(400)])
    assert set(out.token_ids) == {0, 1}


def test_top_k_keeps_k_most_likely(sampler):
    logits = torch.tensor([[0.4, 0.1, 0.3, 0.2]]).log().repeat(400, 1)
    torch.manual_seed(0)
    out = sampler(logits, [row(top_k=2) for _ in range(400)])
    assert set(out.token_ids) == {0, 2}


def test_top_k_keeps_ties_with_the_kth_logit(sampler):
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0]]).repeat(300, 1)
    torch.manual_seed(0)
    out = sampler(logits, [row(top_k=2) for _ in range(300)])
    assert set(out.token_ids) == {0, 1, 2}


def test_min_p_drops_tokens_below_fraction_of_max(sampler):
    # p_max = 0.5 → min_p = 0.5 keeps p ≥ 0.25: tokens 0 (0.5) and 1 (0.3).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(400, 1)
    torch.manual_seed(0)
    out = sampler(logits, [row(min_p=0.5) for _ in range(400)])
    assert set(out.token_ids) == {0, 1}
    seeded = sampler(logits[:50], [row(min_p=0.5, seed=i) for i in range(50)])
    assert set(seeded.token_ids) == {0, 1}
    only_max = sampler(logits[:50], [row(min_p=1.0) for _ in range(50)])
    assert set(only_max.token_ids) == {0}


# ---------------------------------------------------------------- logit_bias and min_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_a_token(sampler, temperature):
    logits = rand_logits(4, 100, seed=4)
    out = sampler(logits, [row(temperature=temperature, logit_bias={37: 100.0}) for _ in range(4)])
    assert out.token_ids == [37] * 4


def test_logit_bias_can_ban_the_argmax_and_ignores_out_of_range_ids(sampler):
    logits = rand_logits(1, 20, seed=5)
    best, second = logits[0].topk(2).indices.tolist()
    out = sampler(logits, [row(temperature=0.0, logit_bias={best: float("-inf"), 10_000: 5.0})])
    assert out.token_ids == [second]


def test_min_tokens_blocks_eos_and_stop_ids_then_allows_them(sampler):
    # EOS (3) is the argmax, the stop id (5) second, so the blocked steps choose 1.
    logits = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0, 2.0]])
    state = row(eos=[3], temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True)
    chosen = []
    for _ in range(3):
        token = sampler(logits, [state]).token_ids[0]
        chosen.append(token)
        state.append(token)
    assert chosen == [1, 1, 3]
    assert not state.min_tokens_active


# ---------------------------------------------------------------- penalties


def test_penalties_exact_values(sampler):
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, -2.0]])
    state = row(prompt=[0, 2], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    for t in [1, 1, 3]:
        state.append(t)
    processed = sampler.process_logits(logits, [state])
    # repetition (prompt ∪ output = {0, 1, 2, 3}): 2→1, 1→0.5, -1→-2, 0.5→0.25, -2 stays;
    # then token 1 (count 2): 0.5 - 2·0.25 - 0.5 = -0.5; token 3 (count 1): 0.25 - 0.25 - 0.5.
    torch.testing.assert_close(processed, torch.tensor([[1.0, -0.5, -2.0, -0.5, -2.0]]), rtol=0, atol=0)
    assert logits.tolist() == [[2.0, 1.0, -1.0, 0.5, -2.0]]  # caller's tensor untouched
    assert state.output_counts(5).tolist() == [0, 2, 0, 1, 0]


def test_repetition_penalty_below_one_rewards_seen_tokens(sampler):
    logits = torch.tensor([[1.0, -1.0, 0.9]])
    processed = sampler.process_logits(logits, [row(prompt=[1, 2], repetition_penalty=0.5)])
    torch.testing.assert_close(processed, torch.tensor([[1.0, -0.5, 1.8]]), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("params", "prompt", "expected"),
    [
        (dict(), [], 0),
        (dict(repetition_penalty=1.3), [0], 0),  # 2.0 / 1.3 = 1.54 > 1.5
        (dict(repetition_penalty=1.5), [0], 1),  # 2.0 / 1.5 = 1.33 < 1.5
        (dict(repetition_penalty=1.5), [], 1),  # output token 0 counts too
        (dict(presence_penalty=0.4), [0], 0),  # prompt ids are not penalised
        (dict(presence_penalty=0.6), [], 1),
        (dict(frequency_penalty=0.2), [], 0),  # 2.0 - 0.2 = 1.8
        (dict(frequency_penalty=0.2, presence_penalty=0.35), [], 1),  # 1.45
        (dict(presence_penalty=-1.0), [], 0),  # negative: encourages
    ],
)
def test_penalties_change_greedy_choice_in_expected_direction(sampler, params, prompt, expected):
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    state = row(prompt=prompt, temperature=0.0, **params)
    state.append(0)
    assert sampler(logits, [state]).token_ids == [expected]


def test_frequency_penalty_counts_every_occurrence(sampler):
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    state = row(temperature=0.0, frequency_penalty=0.2)
    picks = []
    for _ in range(4):
        token = sampler(logits, [state]).token_ids[0]
        picks.append(token)
        state.append(token)
    # token 0 at 2.0, 1.8, 1.6, then 1.4 < 1.5 → token 1.
    assert picks == [0, 0, 0, 1]


# ---------------------------------------------------------------- seeded rows


def _random_other_row(g: torch.Generator) -> RowSamplingState:
    choice = int(torch.randint(0, 5, (1,), generator=g))
    seed = int(torch.randint(0, 10_000, (1,), generator=g))
    return [
        row(temperature=0.0),
        row(temperature=1.0),
        row(temperature=0.7, top_k=5, seed=seed),
        row(temperature=1.2, top_p=0.8, min_p=0.05, presence_penalty=0.5, logit_bias={3: 2.0}),
        row(prompt=[1, 2, 3], temperature=0.9, repetition_penalty=1.2, min_tokens=3, eos=[0], seed=seed),
    ][choice]


def test_seeded_row_is_independent_of_the_batch(sampler):
    vocab, steps = 64, 20
    params = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.01, frequency_penalty=0.1, seed=1234)
    step_logits = [rand_logits(1, vocab, seed=100 + s, scale=1.5) for s in range(steps)]

    alone = row(prompt=[5, 6], **params)
    alone_tokens = []
    for s in range(steps):
        token = sampler(step_logits[s], [alone]).token_ids[0]
        alone_tokens.append(token)
        alone.append(token)

    g = torch.Generator().manual_seed(99)
    torch.manual_seed(5)
    target = row(prompt=[5, 6], **params)
    others = [_random_other_row(g) for _ in range(7)]
    batch_tokens = []
    for s in range(steps):
        position = int(torch.randint(0, 8, (1,), generator=g))
        perm = torch.randperm(7, generator=g).tolist()
        rows = [others[i] for i in perm]
        rows.insert(position, target)
        logits = rand_logits(8, vocab, seed=1000 + s, scale=1.5)
        logits[position] = step_logits[s][0]
        out = sampler(logits, rows)
        for r, token in zip(rows, out.token_ids):
            r.append(token)
        batch_tokens.append(out.token_ids[position])

    assert batch_tokens == alone_tokens
    assert len(set(alone_tokens)) > 1  # the test is not trivially greedy


def _seeded_run(sampler: Sampler, seed: int, steps: int = 20) -> list[int]:
    state = row(temperature=1.0, seed=seed)
    logits = torch.zeros(1, 100)  # uniform: any two seeds agree on 20 tokens w.p. 1e-40
    tokens = []
    for _ in range(steps):
        token = sampler(logits, [state]).token_ids[0]
        tokens.append(token)
        state.append(token)
    return tokens


def test_same_seed_repeats_and_different_seeds_differ(sampler):
    assert _seeded_run(sampler, 1) == _seeded_run(sampler, 1)
    assert _seeded_run(sampler, 1) != _seeded_run(sampler, 2)
    assert _seeded_run(sampler, -5) == _seeded_run(sampler, -5)  # negative seeds accepted


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_sorted(sampler):
    logits = rand_logits(4, 50, seed=6)
    rows = [
        row(temperature=0.0, logprobs=5, logit_bias={11: 50.0}),
        row(temperature=0.7, logprobs=0, presence_penalty=1.0),
        row(temperature=1.0),
        row(temperature=1.0, logprobs=3, top_k=2, seed=3),
    ]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[0] == 11  # the bias decides the token, not the logprobs
    assert out.logprobs[2] is None
    for i, k in [(0, 5), (1, 0), (3, 3)]:
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-6)
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == k
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.top_token_ids == raw[i].topk(k).indices.tolist()
        for t, v in zip(lp.top_token_ids, lp.top_logprobs):
            assert v == pytest.approx(raw[i, t].item(), abs=1e-6)


def test_logits_are_not_modified_and_other_dtypes_are_upcast(sampler):
    logits = rand_logits(3, 30, seed=8)
    before = logits.clone()
    rows = [row(logit_bias={1: 3.0}, repetition_penalty=1.5, prompt=[1, 2], min_tokens=1, eos=[0]) for _ in range(3)]
    sampler(logits, rows)
    assert torch.equal(logits, before)
    out = sampler(logits.to(torch.bfloat16), [row(temperature=0.0)] * 3)
    assert out.token_ids == logits.to(torch.bfloat16).float().argmax(-1).tolist()


def test_empty_batch_and_row_count_mismatch(sampler):
    assert sampler(torch.zeros(0, 10), []) == SamplerOutput([], [])
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 10), [row()])


# ---------------------------------------------------------------- distribution


def _chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_DF3_P999 = 16.27  # chi-square 0.999 quantile, 3 degrees of freedom


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_unseeded_sampling_follows_softmax(sampler, temperature):
    base = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    n = 20_000
    torch.manual_seed(1234)
    out = sampler(base.repeat(n, 1), [row(temperature=temperature) for _ in range(n)])
    expected = torch.softmax(base / temperature, dim=-1)
    assert _chi_square(out.token_ids, expected) < CHI2_DF3_P999


def test_seeded_sampling_follows_softmax(sampler):
    base = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    n = 4_000
    out = sampler(base.repeat(n, 1), [row(temperature=1.0, seed=i) for i in range(n)])
    assert _chi_square(out.token_ids, torch.tensor([0.1, 0.2, 0.3, 0.4])) < CHI2_DF3_P999


# ---------------------------------------------------------------- property: masks hold


def _surely_masked(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Token ids the stages must never emit, with margins so rounding cannot flip them."""
    l = logits.double().clone()
    for t, b in (params.logit_bias or {}).items():
        l[t] += b
    l = l / params.temperature
    vocab = l.numel()
    masked = {t for t in range(vocab) if l[t] == float("-inf")}
    greater = (l.unsqueeze(0) > l.unsqueeze(1)).sum(1)  # [t]: ids strictly above t
    finite = l
    if params.top_k is not None:
        masked |= {t for t in range(vocab) if greater[t] >= params.top_k}
        finite = l.masked_fill(torch.tensor([t in masked for t in range(vocab)]), float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(finite, dim=-1)
        above = finite.unsqueeze(0) > finite.unsqueeze(1)  # [t, u]: u strictly above t
        mass_above = (probs.unsqueeze(0) * above).sum(1)
        masked |= {t for t in range(vocab) if greater[t] > 0 and mass_above[t] >= params.top_p + 1e-5}
    if params.min_p > 0.0:
        top = l.max()
        masked |= {t for t in range(vocab) if math.exp(l[t] - top) < params.min_p * (1 - 1e-4)}
    return masked


row_params = st.fixed_dictionaries(
    {
        "temperature": st.floats(0.05, 2.0),
        "top_k": st.none() | st.integers(1, 40),
        "top_p": st.floats(0.01, 1.0),
        "min_p": st.sampled_from([0.0, 0.0, 0.05, 0.3, 0.9, 1.0]),
        "seed": st.none() | st.integers(0, 2**63 - 1),
        "banned": st.lists(st.integers(0, 39), max_size=10),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vocab=st.integers(2, 40),
    specs=st.lists(row_params, min_size=1, max_size=4),
    logits_seed=st.integers(0, 2**31 - 1),
)
def test_masked_tokens_are_never_sampled(vocab, specs, logits_seed):
    sampler = Sampler()
    copies = 8  # each spec fills 8 rows (distinct seeds) to draw more samples per step
    base = rand_logits(len(specs), vocab, seed=logits_seed, scale=2.0)
    rows, masked = [], []
    for i, spec in enumerate(specs):
        banned = {t for t in spec["banned"] if t < vocab}
        if len(banned) == vocab:
            banned.discard(0)
        for j in range(copies):
            params = SamplingParams(
                temperature=spec["temperature"],
                top_k=spec["top_k"],
                top_p=spec["top_p"],
                min_p=spec["min_p"],
                seed=None if spec["seed"] is None else spec["seed"] + j,
                logit_bias={t: float("-inf") for t in banned} or None,
            )
            rows.append(RowSamplingState(params, [], [], CPU))
        masked.append(_surely_masked(base[i], params))
        assert len(masked[-1]) < vocab
    logits = base.repeat_interleave(copies, dim=0)
    torch.manual_seed(logits_seed)
    for _ in range(4):
        out = sampler(logits, rows)
        for r, token in enumerate(out.token_ids):
            assert 0 <= token < vocab
            assert token not in masked[r // copies], (r, token, sorted(masked[r // copies]))


def test_tiny_temperature_is_greedy_not_nan():
    """A temperature that underflows in float32 must not divide logits into NaN."""
    torch.manual_seed(0)
    logits = torch.randn(2, 1000) * 3
    rows = [RowSamplingState(SamplingParams(temperature=1e-40, seed=5), [1, 2, 3], [2], "cpu"),
            RowSamplingState(SamplingParams(temperature=1e-7), [1, 2, 3], [2], "cpu")]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert SamplingParams(repetition_penalty=1e-40).validate() is not None
    assert SamplingParams(logit_bias={1: float("inf")}).validate() is not None
