"""The OpenAI-compatible HTTP surface, driven through the official ``openai`` client
(raw HTTP only where the client cannot express a case) against a spawned engine and
two frontends on the tiny random Llama:

- ``base``: the open frontend every test uses;
- ``locked``: a second frontend on the same engine with ``--api-key`` and a small
  ``--max-body-bytes``.

The last tests run the Starlette app in-process against a scripted engine client, to
pin what the HTTP layer does when the engine fails or disappears mid-request.

Greedy requests set ``ignore_eos`` so their length is exact; seeded and greedy
requests are compared across calls, across stream / non-stream and across batches.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.procs import ProcessGroup, free_port, http_json, stats, wait_for, wait_healthy

API_KEY = "sk-test-key"
LOCKED_BODY_LIMIT = 4096
LOCKED_WORK_LIMIT = 1000  # the locked frontend's --max-request-work
PROMPT = "The quick brown fox"
EOS = 2  # the tiny Llama's eos_token_id (SmolLM2's <|im_end|>)


@dataclass
class Stack:
    base: str  # open frontend
    locked: str  # --api-key, small --max-body-bytes
    model: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    run = Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp"))  # short: ipc paths are limited to ~100 bytes
    group = ProcessGroup(tmp_path_factory.mktemp("openai"))
    group.engine(tiny_model_dir, run, max_batch_size=8)
    port, locked_port = free_port(), free_port()
    group.frontend(tiny_model_dir, run, port)
    group.frontend(tiny_model_dir, run, locked_port, api_key=API_KEY, max_body_bytes=LOCKED_BODY_LIMIT,
                   max_request_work=LOCKED_WORK_LIMIT)
    base, locked = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{locked_port}"
    try:
        wait_healthy(base, 120)
        wait_healthy(locked, 60)
        model = http_json(f"{base}/v1/models")[1]["data"][0]["id"]
        yield Stack(base, locked, model)
    except TimeoutError:
        raise AssertionError("stack did not start:\n" + "\n".join(p.output()[-3000:] for p in group.procs))
    finally:
        group.close()
        shutil.rmtree(run, ignore_errors=True)


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base}/v1", api_key="unused", max_retries=0, timeout=60)


def at_baseline(base: str) -> bool:
    s = stats(base)
    return (s["num_active"] == 0 and s["num_pending"] == 0 and s["num_prefilling"] == 0
            and s["active_kv_reserved"] == 0 and s["blocks"]["num_used_blocks"] == 0
            and s["num_waiting"] == 0)


def greedy(client: OpenAI, model: str, prompt=PROMPT, max_tokens: int = 12, extra: dict | None = None, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, **(extra or {})}, **kw)


def token_ids(logprobs) -> list[int]:
    """Ids from ``return_tokens_as_token_ids`` logprob tokens ("token_id:<id>")."""
    return [int(t.split(":", 1)[1]) for t in logprobs.tokens]


def collect(stream) -> dict:
    """Everything a completions / chat stream said, per choice index."""
    out = {"text": {}, "finish": {}, "lps": {}, "usage": None, "chunks": 0}
    for chunk in stream:
        out["chunks"] += 1
        if chunk.usage is not None:
            assert not chunk.choices  # the usage chunk carries no choices
            assert out["usage"] is None, "usage sent twice"
            out["usage"] = chunk.usage
        for ch in chunk.choices:
            i = ch.index
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            out["text"][i] = out["text"].get(i, "") + piece
            if ch.logprobs is not None:
                lps = out["lps"].setdefault(i, [])
                if hasattr(ch.logprobs, "tokens"):
                    lps.extend(zip(ch.logprobs.tokens, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs,
                                   ch.logprobs.text_offset))
                else:
                    lps.extend(ch.logprobs.content or [])
            if ch.finish_reason is not None:
                assert i not in out["finish"], f"choice {i} finished twice"
                out["finish"][i] = ch.finish_reason
            else:
                assert i not in out["finish"], f"choice {i} sent a chunk after its finish"
    return out


def counts(usage) -> tuple[int, int, int]:
    """Usage without ``prompt_tokens_details``: the prefix-cache hit differs between calls."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def raw_stream_lines(url: str, body: dict, headers: dict | None = None) -> list[str]:
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]


# ---------------------------------------------------------------------- endpoints


def test_models_health_version_tokenize_detokenize(stack, client):
    models = client.models.list().data
    assert [m.id for m in models] == [stack.model]
    assert httpx.get(f"{stack.base}/health").json()["status"] == "ok"
    version = httpx.get(f"{stack.base}/version").json()
    assert version["version"] and version["transport"] == "shm"  # the frontend reaches its engine through the run directory
    # One runtime record, read by /version and /scheduler/stats alike.
    runtime = version["runtime"]
    assert runtime["device"] == "cpu" and runtime["torch_threads"] == 1 and runtime["backend"] == "paged"
    assert runtime["dtype"] == "float32" and runtime["prefill_mode"] == "chunked"
    assert httpx.get(f"{stack.base}/scheduler/stats").json()["runtime"] == runtime

    status, tok, _ = http_json(f"{stack.base}/tokenize", {"prompt": "Hello, world! 日本"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 2048
    status, detok, _ = http_json(f"{stack.base}/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == "Hello, world! 日本"

    messages = [{"role": "user", "content": "hi there"}]
    status, chat_tok, _ = http_json(f"{stack.base}/tokenize", {"messages": messages})
    assert status == 200
    reply = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens == chat_tok["count"]


def test_completion_prompt_forms(stack, client):
    """Text, list of texts, token ids and lists of token ids; one choice per prompt,
    in order, and a prompt given as ids answers as the same prompt given as text."""
    ids = http_json(f"{stack.base}/tokenize", {"prompt": PROMPT})[1]["tokens"]
    other_ids = http_json(f"{stack.base}/tokenize", {"prompt": "Once upon a time"})[1]["tokens"]
    as_text = greedy(client, stack.model, PROMPT, 6)
    as_ids = greedy(client, stack.model, ids, 6)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == as_text.usage.prompt_tokens == len(ids)

    many = greedy(client, stack.model, [PROMPT, "Once upon a time"], 6)
    many_ids = greedy(client, stack.model, [ids, other_ids], 6)
    for r in (many, many_ids):
        assert [c.index for c in r.choices] == [0, 1]
        assert r.choices[0].text == as_text.choices[0].text
        assert r.usage.prompt_tokens == len(ids) + len(other_ids)
        assert r.usage.completion_tokens == 12 and r.usage.total_tokens == 12 + len(ids) + len(other_ids)
    assert many.choices[1].text == many_ids.choices[1].text


def test_unknown_model_route_and_method_are_openai_errors(stack, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-nope", prompt="x", max_tokens=1)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)):
        resp = httpx.request(method, f"{stack.base}{path}")
        assert resp.status_code == status
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------- stream vs non-stream


def test_completion_stream_matches_non_stream_with_logprobs_and_usage(stack, client):
    kw = dict(max_tokens=12, logprobs=3)
    full = greedy(client, stack.model, **kw)
    choice = full.choices[0]
    lp = choice.logprobs
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 12
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    for i, (tok, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        assert 1 <= len(top) <= 3 and value <= 0
        assert value == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the sampled token is the top one
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])

    streamed = collect(greedy(client, stack.model, stream=True, stream_options={"include_usage": True}, **kw))
    assert streamed["text"] == {0: choice.text} and streamed["finish"] == {0: "length"}
    assert streamed["chunks"] > 2  # token by token, not one lump
    assert counts(streamed["usage"]) == counts(full.usage)
    got = streamed["lps"][0]
    assert [t for t, *_ in got] == lp.tokens
    assert [o for *_, o in got] == lp.text_offset  # offsets continue across chunks
    assert [v for _, v, *_ in got] == pytest.approx(lp.token_logprobs, abs=1e-4)
    for (_, _, top, _), want in zip(got, lp.top_logprobs):
        assert top.keys() == want.keys()

    # Without include_usage there is no usage chunk; the stream still ends with [DONE].
    lines = raw_stream_lines(f"{stack.base}/v1/completions",
                             {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True})
    assert lines[-1] == "[DONE]" and all("usage" not in json.loads(x) for x in lines[:-1])


def test_chat_stream_matches_non_stream_with_logprobs(stack, client):
    kw = dict(model=stack.model, messages=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
              temperature=0, max_completion_tokens=10, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    content = choice.logprobs.content
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 10 == len(content)
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    # `bytes` are each token's own bytes: together they are exactly the text.
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    streamed = collect(iter(chunks))
    assert streamed["text"] == {0: choice.message.content} and streamed["finish"] == {0: "length"}
    assert [e.token for e in streamed["lps"][0]] == [e.token for e in content]
    # float32 kernels on the CPU may differ in the last digits between calls: close, not equal
    assert [e.logprob for e in streamed["lps"][0]] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert counts(streamed["usage"]) == counts(full.usage)


def test_max_completion_tokens_wins_over_max_tokens(stack, client):
    reply = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "count"}], temperature=0,
        max_tokens=7, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    reply = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "count"}], temperature=0,
        max_tokens=5, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5


def test_echo(stack, client):
    plain = greedy(client, stack.model, max_tokens=5).choices[0].text
    echoed = greedy(client, stack.model, max_tokens=5, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    streamed = collect(greedy(client, stack.model, max_tokens=5, echo=True, stream=True))
    assert streamed["text"] == {0: PROMPT + plain}
    ids = http_json(f"{stack.base}/tokenize", {"prompt": PROMPT})[1]["tokens"]
    assert greedy(client, stack.model, ids, 5, echo=True).choices[0].text == PROMPT + plain


# ---------------------------------------------------------------------- sampling parameters


def test_greedy_equivalents(stack, client):
    """temperature 0, top_k 1, a tiny top_p and min_p 1 all pick the argmax; so does
    a temperature below 1e-5 (vLLM's rule; in float32 it would divide by zero)."""
    want = greedy(client, stack.model, max_tokens=10).choices[0].text
    for tiny in (1e-6, 1e-40, 5e-324):
        r = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=10, temperature=tiny, seed=5,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want, tiny
    for extra in ({"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}):
        r = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=10, temperature=1.0,
                                      top_p=extra.pop("top_p", None),
                                      extra_body={"ignore_eos": True, **extra})
        assert r.choices[0].text == want, extra


def _biased_run(client, model, bias: dict[int, float], max_tokens: int, **kw):
    r = greedy(client, model, max_tokens=max_tokens, logit_bias={str(k): v for k, v in bias.items()},
               logprobs=20, extra={"return_tokens_as_token_ids": True, **kw.pop("extra", {})}, **kw)
    lp = r.choices[0].logprobs
    tops = [{int(t.split(":", 1)[1]): v for t, v in top.items()} for top in lp.top_logprobs]
    return token_ids(lp), lp.token_logprobs, tops


def test_logit_bias(stack, client):
    ids, _, tops = _biased_run(client, stack.model, {}, 4)
    forced = 1000
    assert _biased_run(client, stack.model, {forced: 100}, 4)[0] == [forced] * 4
    banned = _biased_run(client, stack.model, {ids[0]: -100}, 1)[0]
    runner_up = sorted(tops[0], key=tops[0].get)[-2]
    assert banned == [runner_up]


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"frequency_penalty": 1.0, "presence_penalty": 1.0}])
def test_presence_and_frequency_penalties_follow_openai_formula(stack, client, penalty):
    """Token A is biased to lead by one logit at step 0. Greedy then repeats A until
    ``bias - frequency·count - presence·(count > 0)`` no longer keeps it on top; the
    raw logprobs of an unpenalised run say exactly when that is and which token wins."""
    first, _, tops = _biased_run(client, stack.model, {}, 1)
    a = sorted(tops[0], key=tops[0].get)[-5]  # the 5th most likely token: not the argmax
    bias = tops[0][first[0]] - tops[0][a] + 1.0
    steps = 8
    forced, forced_lps, forced_tops = _biased_run(client, stack.model, {a: 100.0}, steps)
    assert forced == [a] * steps
    fp, pp = penalty.get("frequency_penalty", 0.0), penalty.get("presence_penalty", 0.0)
    want = []
    for i in range(steps):  # output so far: A * i; raw logprobs of this context from the forced run
        score_a = forced_lps[i] + bias - fp * i - pp * (i > 0)
        best_other = max((t for t in forced_tops[i] if t != a), key=forced_tops[i].get)
        if forced_tops[i][best_other] > score_a:
            want.append(best_other)
            break
        want.append(a)
    assert want[-1] != a, "the penalty never displaced A; the test is not testing anything"
    got = _biased_run(client, stack.model, {a: bias}, len(want), **penalty)[0]
    assert got == want


def test_repetition_penalty_displaces_a_repeated_token(stack, client):
    """A is biased to stay just on top for every step of a greedy run; the CTRL
    penalty (on logits, so not predictable from logprobs) must knock it off."""
    first, _, tops = _biased_run(client, stack.model, {}, 1)
    a = sorted(tops[0], key=tops[0].get)[-5]
    steps = 6
    _, forced_lps, forced_tops = _biased_run(client, stack.model, {a: 100.0}, steps)
    bias = 0.5 + max(max(v for t, v in top.items() if t != a) - lp for lp, top in zip(forced_lps, forced_tops))
    plain = _biased_run(client, stack.model, {a: bias}, steps)[0]
    penalised = _biased_run(client, stack.model, {a: bias}, steps, extra={"repetition_penalty": 2.0})[0]
    assert plain == [a] * steps
    assert penalised.count(a) < steps


def test_seeded_sampling_is_reproducible_alone_and_batched(stack, client):
    def seeded(seed: int, prompt: str = PROMPT) -> str:
        return client.completions.create(model=stack.model, prompt=prompt, max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    alone = seeded(1234)
    assert seeded(1234) == alone
    assert seeded(4321) != alone
    noise = {"prompt": "noise " * 20, "max_tokens": 60, "temperature": 1.0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(http_json, f"{stack.base}/v1/completions", {**noise, "prompt": f"{i} noise"})
                   for i in range(3)]
        batched = [pool.submit(seeded, 1234)]
        results = [f.result() for f in streams + batched]
    assert all(r[0] == 200 for r in results[:3])
    assert results[3] == alone


def test_n_choices_complete_distinct_and_reproducible(stack, client):
    kw = dict(model=stack.model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=7,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) == 3 and all(c.finish_reason == "length" for c in first.choices)
    assert first.usage.completion_tokens == 24  # summed over choices
    assert first.usage.prompt_tokens == greedy(client, stack.model, max_tokens=1).usage.prompt_tokens
    assert [c.text for c in client.completions.create(**kw).choices] == texts

    streamed = collect(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert streamed["text"] == dict(enumerate(texts))
    assert streamed["finish"] == {0: "length", 1: "length", 2: "length"}
    assert streamed["usage"].completion_tokens == 24

    # n per prompt: choice i belongs to prompt i // n.
    two = client.completions.create(model=stack.model, prompt=["alpha", "beta"], max_tokens=3, n=2, echo=True,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert [c.text.startswith(w) for c, w in zip(two.choices, ["alpha", "alpha", "beta", "beta"])] == [True] * 4

    chat = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, n=2, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    assert chat.usage.completion_tokens == 12


# ---------------------------------------------------------------------- stops


def test_stop_strings_cut_text_in_stream_and_non_stream(stack, client):
    full = greedy(client, stack.model, max_tokens=24).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full.find(stop)
    for include in (False, True):
        want = full[:cut + len(stop)] if include else full[:cut]
        extra = {"include_stop_str_in_output": include}
        r = greedy(client, stack.model, max_tokens=24, stop=[stop, "never-in-output"], extra=extra)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        assert r.choices[0].model_extra["stop_reason"] == stop
        s = collect(greedy(client, stack.model, max_tokens=24, stop=stop, stream=True, extra=extra))
        assert s["text"] == {0: want} and s["finish"] == {0: "stop"}
    chat = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    text = chat.choices[0].message.content
    stop = text[4:7]
    stopped = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "x"}],
                                             max_tokens=16, temperature=0, stop=stop,
                                             extra_body={"ignore_eos": True})
    assert stopped.choices[0].message.content == text[:text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_stop_string_frees_the_engine_row_at_once(stack, client):
    text = greedy(client, stack.model, max_tokens=8).choices[0].text
    before = stats(stack.base)
    r = greedy(client, stack.model, max_tokens=1500, stop=text[2:5])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 12
    wait_for(lambda: at_baseline(stack.base), 5, 0.05, "baseline after a stop string")
    after = stats(stack.base)
    assert after["num_aborted"] == before["num_aborted"] + 1
    assert after["num_generated_tokens"] - before["num_generated_tokens"] < 100  # not run to 1500


def test_stop_token_ids_eos_and_min_tokens(stack, client):
    ids = _biased_run(client, stack.model, {}, 8)[0]
    k = next(i for i in range(2, 8) if ids[i] not in ids[:i])
    texts = [greedy(client, stack.model, max_tokens=m).choices[0].text for m in (k, k + 1)]

    r = greedy(client, stack.model, max_tokens=8, extra={"stop_token_ids": [ids[k]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
    assert r.choices[0].text == texts[0]  # the stop token's text is not output...
    assert r.choices[0].model_extra["stop_reason"] == ids[k]
    r = greedy(client, stack.model, max_tokens=8,
               extra={"stop_token_ids": [ids[k]], "include_stop_str_in_output": True})
    assert r.choices[0].text == texts[1]  # ...unless asked for
    r = greedy(client, stack.model, max_tokens=8, extra={"stop_token_ids": [ids[k]], "min_tokens": k + 2})
    assert r.usage.completion_tokens > k + 1  # masked until min_tokens

    # EOS made certain: stop at once; min_tokens masks it; ignore_eos runs to the length.
    eos_bias = {str(EOS): 100}
    opts = dict(model=stack.model, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=eos_bias)
    r = client.completions.create(**opts)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens, r.choices[0].text) == ("stop", 1, "")
    assert r.choices[0].model_extra["stop_reason"] is None  # EOS, not a stop token id
    r = client.completions.create(**opts, extra_body={"min_tokens": 5})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 6)
    r = client.completions.create(**opts, extra_body={"ignore_eos": True})
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 10)

    # A stop string is not looked for before min_tokens.
    full = greedy(client, stack.model, max_tokens=10).choices[0].text
    r = greedy(client, stack.model, max_tokens=10, stop=full[:2], extra={"min_tokens": 10})
    assert r.choices[0].text == full and r.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------- validation


def test_client_mistakes_are_400_with_a_clear_message_and_leave_no_trace(stack, client):
    wait_for(lambda: at_baseline(stack.base), 10, what="baseline")
    before = stats(stack.base)
    long_prompt = [100] * 2048
    chat = dict(model=stack.model, messages=[{"role": "user", "content": "hi"}])
    cases = [
        (lambda: client.completions.create(model=stack.model, prompt="x", temperature=3), "temperature"),
        (lambda: client.completions.create(model=stack.model, prompt="x", top_p=0), "top_p"),
        (lambda: client.completions.create(model=stack.model, prompt="x", n=0), "n"),
        (lambda: client.completions.create(model=stack.model, prompt="x", n=17), "n"),
        (lambda: client.completions.create(model=stack.model, prompt="x", logprobs=21), "logprobs"),
        (lambda: client.completions.create(model=stack.model, prompt="x", max_tokens=0), "max_tokens"),
        (lambda: client.completions.create(model=stack.model, prompt="x", max_tokens=5000), "max_tokens"),
        (lambda: client.completions.create(model=stack.model, prompt=long_prompt, max_tokens=1), "prompt"),
        (lambda: client.completions.create(model=stack.model, prompt=[10**9]), "prompt"),
        (lambda: client.completions.create(model=stack.model, prompt="x", logit_bias={"99999999": 1}),
         "logit_bias"),
        (lambda: client.completions.create(model=stack.model, prompt="x", logit_bias={"x": 1}), "logit_bias"),
        (lambda: client.completions.create(model=stack.model, prompt="x",
                                           extra_body={"stop_token_ids": [10**7]}), "stop_token_ids"),
        (lambda: client.completions.create(model=stack.model, prompt="x", best_of=2), "best_of"),
        (lambda: client.completions.create(model=stack.model, prompt="x", suffix="y"), "suffix"),
        (lambda: client.completions.create(model=stack.model, prompt="x", extra_body={"prompt_logprobs": 21}),
         "prompt_logprobs"),
        (lambda: client.completions.create(model=stack.model, prompt="x", stream_options={"include_usage": True}),
         "stream_options"),
        (lambda: client.completions.create(model=stack.model, prompt="x", max_tokens=4,
                                           extra_body={"min_tokens": 5}), "min_tokens"),
        (lambda: client.completions.create(model=stack.model, prompt="x", seed=2**64), "seed"),
        (lambda: client.completions.create(model=stack.model, prompt="x", extra_body={"top_k": -2}), "top_k"),
        (lambda: client.completions.create(model=stack.model, prompt="x", stop=[""]), "stop"),
        (lambda: client.completions.create(model=stack.model, prompt="x", extra_body={"temperature": "hot"}),
         "temperature"),
        (lambda: client.chat.completions.create(**chat, top_logprobs=2), "top_logprobs"),
        (lambda: client.chat.completions.create(**chat, max_completion_tokens=5000), "max_completion_tokens"),
        (lambda: client.chat.completions.create(model=stack.model, messages=[{"role": "user",
                                                                              "content": "hello " * 2100}]),
         "messages"),
        (lambda: client.chat.completions.create(**chat, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}), "response_format"),
        (lambda: client.chat.completions.create(model=stack.model, messages=[]), "messages"),
        (lambda: client.chat.completions.create(model=stack.model, messages=[{"role": "wizard", "content": "x"}]),
         "messages"),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        body = err.value.body
        assert set(body) == {"message", "type", "param", "code"}, body
        assert body["type"] == "invalid_request_error" and body["message"], body
        assert body["param"] == param, body
    assert err.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=stack.model, prompt="x", max_tokens=5000)
    assert err.value.code == "context_length_exceeded" and "2048" in err.value.message

    after = stats(stack.base)
    for key in ("num_finished", "num_aborted", "num_rejected", "num_generated_tokens"):
        assert after[key] == before[key], key
    assert at_baseline(stack.base)


def test_explicit_null_means_not_set(stack, client):
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                               "frequency_penalty", "repetition_penalty", "logit_bias", "stop", "stop_token_ids",
                               "ignore_eos", "min_tokens", "n", "stream", "stream_options", "logprobs", "echo",
                               "user", "best_of", "suffix", "include_stop_str_in_output")}
    status, body, _ = http_json(f"{stack.base}/v1/completions", {"prompt": PROMPT, "max_tokens": None, **nulls})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] <= 16 and len(body["choices"]) == 1  # default max_tokens 16
    status, body, _ = http_json(f"{stack.base}/v1/chat/completions", {
        "messages": [{"role": "user", "content": None}], "max_tokens": 2, "max_completion_tokens": None,
        "top_logprobs": None, **{k: v for k, v in nulls.items() if k not in ("echo", "best_of", "suffix")}})
    assert status == 200, body


def test_bad_bodies_are_400_never_500(stack):
    url = f"{stack.base}/v1/completions"
    for raw in (b"{not json", b"[1, 2]", b"", b"\xff\xfe", b'{"prompt": "\\ud800"}', b"[" * 50_000,
                b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": "x", "temperature": NaN}'):
        resp = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=10)
        assert resp.status_code == 400, (raw[:40], resp.text)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert at_baseline(stack.base)


# ---------------------------------------------------------------------- api key and body size


def test_api_key_is_required_except_for_health(stack):
    locked = OpenAI(base_url=f"{stack.locked}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    reply = locked.completions.create(model=stack.model, prompt="x", max_tokens=2)
    assert reply.usage.completion_tokens <= 2
    with pytest.raises(openai.AuthenticationError) as err:
        OpenAI(base_url=f"{stack.locked}/v1", api_key="wrong", max_retries=0).models.list()
    assert err.value.code == "invalid_api_key" and err.value.type == "authentication_error"
    for headers in ({}, {"authorization": API_KEY}, {"authorization": f"Basic {API_KEY}"}):
        resp = httpx.post(f"{stack.locked}/tokenize", json={"prompt": "x"}, headers=headers)
        assert resp.status_code == 401 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(f"{stack.locked}/tokenize", json={"prompt": "x"},
                      headers={"authorization": f"bearer {API_KEY}"}).status_code == 200
    assert httpx.get(f"{stack.locked}/health").status_code == 200


def test_body_size_limit_is_413(stack):
    auth = {"authorization": f"Bearer {API_KEY}"}
    big = {"prompt": "x" * LOCKED_BODY_LIMIT, "max_tokens": 1}
    resp = httpx.post(f"{stack.locked}/v1/completions", json=big, headers=auth)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while the body streams in
        yield b'{"prompt": "'
        for _ in range(LOCKED_BODY_LIMIT // 512 + 1):
            yield b"y" * 512
        yield b'", "max_tokens": 1}'

    resp = httpx.post(f"{stack.locked}/v1/completions", content=chunks(),
                      headers={**auth, "content-type": "application/json"})
    assert resp.status_code == 413 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
    small = httpx.post(f"{stack.locked}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=auth)
    assert small.status_code == 200


def test_a_request_s_whole_work_is_bounded(stack):
    """Finding 4: 8 prompts × n 8 × 1,000 tokens with echo, logprobs 20 and prompt_logprobs 20
    (a 16 KB body, each parameter within its own limit) returned 137 MB; now a 400 naming
    the limit, before anything reaches the engine."""
    body = {"prompt": ["a " * 1000] * 8, "n": 8, "max_tokens": 1, "echo": True, "logprobs": 20,
            "prompt_logprobs": 20}
    assert 15_000 < len(json.dumps(body)) < 17_000
    resp = httpx.post(f"{stack.base}/v1/completions", json=body, timeout=30)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["code"] == "request_work_exceeded", resp.text
    assert "262,144" in error["message"] and "--max-request-work" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert at_baseline(stack.base)
    # at the limit exactly (4 × (10 + 15) × (1 + 9) = 1,000): served; one token more: refused
    auth = {"authorization": f"Bearer {API_KEY}"}
    edge = {"prompt": [5] * 10, "n": 4, "max_tokens": 15, "logprobs": 9, "ignore_eos": True}
    ok = httpx.post(f"{stack.locked}/v1/completions", json=edge, headers=auth, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4, ok.text
    over = httpx.post(f"{stack.locked}/v1/completions", json={**edge, "max_tokens": 16}, headers=auth, timeout=30)
    assert over.status_code == 400 and "1,040 token entries" in over.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 16, "max_tokens": 60, "logprobs": True,
            "top_logprobs": 5}
    refused = httpx.post(f"{stack.locked}/v1/chat/completions", json=chat, headers=auth, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_work_exceeded"


# ---------------------------------------------------------------------- engine failure, in-process


class ScriptedEngine:
    """Stands in for :class:`EngineSet`: every submit is accepted and streams
    ``script`` (token-id lists), then fails with ``error`` as a dead engine does; the
    engine counts as down from the moment that error is delivered."""

    frontend_id = "fe-test"

    def __init__(self, script: list[list[int]], error: str):
        from shared import protocol as p

        self.p = p
        self.script, self.error = script, error
        self.up = True
        self.dies = True  # the engine is down once the error is delivered
        self.welcome = p.Welcome("eng", 2048, [EOS], 8, 0.25)
        self.engine_id = "eng"
        self.aborted: list[str] = []
        self._n = 0

    is_up = property(lambda self: self.up)
    num_in_flight = 0

    def start(self, loop): pass


    def close(self): pass

    def new_request_id(self) -> str:
        self._n += 1
        return f"r{self._n}"

    async def submit(self, rid, ids, params, session_id=None, priority=0, key=b"", via=None):
        from frontend.engine_client import EngineUnavailable, RequestStream

        if not self.up:
            raise EngineUnavailable("the engine is not available")
        engine = self

        class DyingStream(RequestStream):
            async def __aiter__(self):
                async for out in RequestStream.__aiter__(self):
                    if out.error and engine.dies:
                        engine.up = False
                    yield out

        stream = DyingStream(rid)
        for tokens in self.script:
            stream.queue.put_nowait(self.p.RequestOutput(rid, tokens))
        stream.queue.put_nowait(self.p.RequestOutput(rid, [], self.p.FinishReason.ERROR, error=self.error))
        return stream, self

    def abort(self, rids):
        self.aborted.extend(rids)

    async def stats(self):
        from frontend.engine_client import EngineUnavailable

        raise EngineUnavailable("the engine is not available")


@pytest.fixture
def scripted(smol_tokenizer):
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from shared.config import FrontendConfig

    engine = ScriptedEngine([[1000], [1001, 1002]], "engine unavailable: no heartbeat from the engine")
    app = create_app(FrontendConfig(), smol_tokenizer, "m", client=engine)
    with TestClient(app) as http:
        yield engine, http


def test_engine_death_mid_stream_ends_with_error_event_then_done(scripted):
    engine, http = scripted
    body = {"prompt": "x", "max_tokens": 10, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        datas = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    events = [json.loads(d) for d in datas[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) != ""  # tokens before the failure
    assert events[-1]["error"]["code"] == "engine_unavailable"
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert http.get("/health").status_code == 503


def test_engine_death_while_waiting_is_503_and_stays_503(scripted):
    engine, http = scripted
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 5})):  # the second finds no engine
        resp = http.post(path, json=body)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["type"] == "service_unavailable" and resp.headers["retry-after"]
    assert http.get("/health").status_code == 503
    assert http.get("/scheduler/stats").status_code == 503


def test_n_choices_share_an_engine_failure(scripted):
    engine, http = scripted
    resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "n": 3})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_unavailable"
    assert engine.aborted == []  # the engine is gone: no abort sends that would block the event loop


def test_n_choices_share_a_row_failure_while_the_engine_lives(smol_tokenizer):
    """A row the engine failed (it stays up): the other choices are aborted."""
    from starlette.testclient import TestClient

    from frontend.app import create_app
    from shared.config import FrontendConfig

    engine = ScriptedEngine([[1000]], "prefill failed: boom")
    engine.dies = False
    with TestClient(create_app(FrontendConfig(), smol_tokenizer, "m", client=engine)) as http:
        resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "n": 3})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_error"
        assert len(engine.aborted) == 2 and set(engine.aborted) < {"r1", "r2", "r3"}
        assert http.get("/health").status_code == 200

