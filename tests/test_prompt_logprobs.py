"""Prompt logprobs, scored in the prefill pass, equal the teacher-forced logprobs of one
plain forward of the model, whatever the prefill mode, chunking, packing or backend; rows
asking for them skip the prefix cache; ``max_tokens`` 0 scores the prompt and stops."""

from __future__ import annotations

import pytest
import torch

from shared.protocol import FinishReason, SamplingParams
from tests.helpers import make_request, make_scheduler, run_until_idle, tokens_of

PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889, 450, 1095, 310, 278,
          5765, 338, 263, 1243, 29892, 322, 372, 338, 3755]  # 25 tokens: chunks split blocks unevenly


@torch.inference_mode()
def teacher_forced(model, prompt: list[int]) -> torch.Tensor:
    """``[len(prompt) - 1, vocab]``: log_softmax of one plain forward, rows scoring tokens 1.."""
    logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_reference(model, prompt: list[int], scored, k: int, atol: float = 1e-4) -> None:
    ref = teacher_forced(model, prompt)
    assert [lp.token_id for lp in scored] == prompt[1:]
    own = torch.tensor([lp.logprob for lp in scored])
    expected = ref.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    assert (own - expected).abs().max().item() < atol
    top = ref.topk(k, dim=-1)
    for i, lp in enumerate(scored):
        assert len(lp.top_token_ids) == k
        assert torch.allclose(torch.tensor(lp.top_logprobs), top.values[i], atol=atol)
        # ids can swap only between near-equal alternatives
        for j, t in enumerate(lp.top_token_ids):
            assert abs(ref[i, t].item() - top.values[i, j].item()) < atol


def prompt_lps(outputs) -> list:
    carrying = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1, "prompt logprobs are sent once"
    return carrying[0]


@pytest.mark.parametrize("backend,mode,chunk", [
    ("paged", "monolithic", 0), ("paged", "chunked", 4), ("paged", "chunked", 7), ("paged", "mixed_batch", 6),
    ("hf", "monolithic", 0), ("hf", "chunked", 5)])
def test_prompt_logprobs_equal_teacher_forced(tiny_llama, backend, mode, chunk):
    sched = make_scheduler(tiny_llama, backend=backend, prefill_mode=mode, prefill_chunk_size=chunk)
    req = make_request(PROMPT, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    outputs = run_until_idle(sched, {0: [req]})[req.request_id]
    check_against_reference(tiny_llama, PROMPT, prompt_lps(outputs), k=2)
    assert len(tokens_of(outputs)) == 3 and outputs[-1].finish_reason is FinishReason.LENGTH


def test_packed_rows_each_get_their_own_prompt_logprobs(tiny_llama):
    sched = make_scheduler(tiny_llama, prefill_mode="chunked", prefill_chunk_size=64)
    other = [1, 22, 333, 4444, 55, 6, 777, 88, 9]
    a = make_request(PROMPT, max_tokens=2, prompt_logprobs=0, ignore_eos=True)
    b = make_request(other, max_tokens=2, ignore_eos=True)  # no prompt logprobs, same pass
    c = make_request(other, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    out = run_until_idle(sched, {0: [a, b, c]})
    check_against_reference(tiny_llama, PROMPT, prompt_lps(out[a.request_id]), k=0)
    check_against_reference(tiny_llama, other, prompt_lps(out[c.request_id]), k=1)
    assert all(o.prompt_logprobs is None for o in out[b.request_id])
    assert tokens_of(out[b.request_id]) == tokens_of(out[c.request_id])  # sampling unaffected


@pytest.mark.parametrize("mode,chunk", [("monolithic", 0), ("chunked", 8)])
def test_rows_scoring_their_prompt_skip_the_prefix_cache(tiny_llama, mode, chunk):
    sched = make_scheduler(tiny_llama, prefill_mode=mode, prefill_chunk_size=chunk, kv_block_size=4)
    warm = make_request(PROMPT, max_tokens=2, ignore_eos=True)
    run_until_idle(sched, {0: [warm]})
    again = make_request(PROMPT, max_tokens=2, ignore_eos=True)
    assert run_until_idle(sched, {0: [again]})[again.request_id][0].num_cached_tokens == 24  # cache is warm
    scored = make_request(PROMPT, max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    outputs = run_until_idle(sched, {0: [scored]})[scored.request_id]
    assert outputs[0].num_cached_tokens == 0
    check_against_reference(tiny_llama, PROMPT, prompt_lps(outputs), k=1)


def test_max_tokens_zero_scores_the_prompt_and_stops(tiny_llama):
    sched = make_scheduler(tiny_llama, prefill_mode="chunked", prefill_chunk_size=6)
    req = make_request(PROMPT, max_tokens=0, prompt_logprobs=0)
    outputs = run_until_idle(sched, {0: [req]})[req.request_id]
    assert tokens_of(outputs) == [] and outputs[-1].finish_reason is FinishReason.LENGTH
    check_against_reference(tiny_llama, PROMPT, prompt_lps(outputs), k=0)
    assert sched.active_kv_reserved == 0 and sched.block_pool.num_free_blocks == sched.block_pool.num_blocks


def test_max_tokens_zero_needs_prompt_logprobs():
    assert "max_tokens" in SamplingParams(max_tokens=0).validate()
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).validate() is None
    assert "prompt_logprobs" in SamplingParams(prompt_logprobs=21).validate()
    assert "prompt_logprobs" in SamplingParams(prompt_logprobs=1.5).validate()


# ---------------------------------------------------------------------- over HTTP, the openai client

import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from openai import OpenAI  # noqa: E402

from tests.procs import ProcessGroup, free_port, http_json, wait_healthy  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog because it was late."


@pytest.fixture(scope="module")
def http(tmp_path_factory, tiny_model_dir):
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))  # short: ipc paths are limited to ~100 bytes
    group = ProcessGroup(tmp_path_factory.mktemp("plp"))
    group.engine(tiny_model_dir, run, max_batch_size=4, prefill_chunk_size=8, kv_block_size=4)
    port = free_port()
    group.frontend(tiny_model_dir, run, port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 120)
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60), base, tiny_model_dir.name
    except TimeoutError:
        raise AssertionError("stack did not start:\n" + "\n".join(p.output()[-3000:] for p in group.procs))
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_from_disk(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def test_echo_logprobs_max_tokens_zero_as_evaluation_harnesses_send(http, tiny_from_disk, smol_tokenizer):
    client, _, model = http
    ids = smol_tokenizer.encode(TEXT)
    reply = client.completions.create(model=model, prompt=TEXT, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = reply.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    lps = choice.logprobs
    assert len(lps.tokens) == len(ids) and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    ref = teacher_forced(tiny_from_disk, ids)
    expected = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(lps.token_logprobs[1:]), expected, atol=1e-4)
    best = ref.max(dim=-1).values
    for i, top in enumerate(lps.top_logprobs[1:]):
        assert len(top) == 1 and abs(next(iter(top.values())) - best[i].item()) < 1e-4
    assert lps.text_offset[0] == 0 and lps.text_offset == sorted(lps.text_offset)


def test_echo_logprobs_with_one_generated_token_and_streamed(http, tiny_from_disk, smol_tokenizer):
    client, _, model = http
    ids = smol_tokenizer.encode(TEXT)
    reply = client.completions.create(model=model, prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0,
                                      extra_body={"ignore_eos": True})
    lps = reply.choices[0].logprobs
    assert len(lps.token_logprobs) == len(ids) + 1  # the prompt's tokens, then the generated one
    expected = teacher_forced(tiny_from_disk, ids).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(lps.token_logprobs[1:-1]), expected, atol=1e-4)
    stream = client.completions.create(model=model, prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    streamed = [lp for chunk in stream for c in chunk.choices if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed == lps.token_logprobs


def test_warm_prefix_cache_does_not_change_prompt_logprobs(http):
    client, base, model = http
    for _ in range(2):  # the second run's prompt is in the prefix cache
        client.completions.create(model=model, prompt=TEXT, max_tokens=2, temperature=0)
    cold = client.completions.create(model=model, prompt=TEXT + " Again.", echo=True, logprobs=0, max_tokens=0)
    warm = client.completions.create(model=model, prompt=TEXT + " Again.", echo=True, logprobs=0, max_tokens=0)
    assert warm.usage.prompt_tokens_details.cached_tokens == 0  # scored rows skip the cache
    assert warm.choices[0].logprobs.token_logprobs == cold.choices[0].logprobs.token_logprobs


def test_vllm_prompt_logprobs_parameter(http, tiny_from_disk, smol_tokenizer):
    client, base, model = http
    ids = smol_tokenizer.encode(TEXT)
    status, body, _ = http_json(f"{base}/v1/completions", {"prompt": TEXT, "max_tokens": 0, "prompt_logprobs": 3})
    assert status == 200, body
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    ref = teacher_forced(tiny_from_disk, ids)
    for i, entry in enumerate(plp[1:]):
        own = entry[str(ids[i + 1])]["logprob"]
        assert abs(own - ref[i, ids[i + 1]].item()) < 1e-4
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if "rank" in v)
        assert [r for r, _ in ranked] == [1, 2, 3]
    assert body["choices"][0]["logprobs"] is None and body["usage"]["completion_tokens"] == 0


def test_max_tokens_zero_without_echo_is_a_400(http):
    _, base, _ = http
    status, body, _ = http_json(f"{base}/v1/completions", {"prompt": TEXT, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
