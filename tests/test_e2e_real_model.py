"""End to end on the real SmolLM2-135M-Instruct: `tickserve serve` (supervisor, engine,
frontend processes) driven by the official openai client, and batched greedy decode
of the real model checked against transformers."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from tests.helpers import assert_matches_reference, make_request, make_scheduler, run_until_idle, tokens_of
from tests.procs import ProcessGroup, free_port, stats, wait_healthy

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory, smol_dir):
    group = ProcessGroup(tmp_path_factory.mktemp("serve"))
    port = free_port()
    # the dense weights (bfloat16 from the float32 directory smol_dir writes): this module checks
    # the model's answers, and on the GGUF's Q4_1 weights a greedy answer depends on which side of
    # the engine's measured low-bit/dense crossover a prompt pass falls (llama.cpp's server on the
    # same file answers "L'Étoile, la Marseillaise…" to the question below). The default low-bit
    # engines are served end to end by test_structured_e2e.py and test_startup_and_logs.py.
    group.spawn(["-m", "shared.cli", "serve", "--port", str(port), "--device", "cpu", "--quantization", "none",
                 "--max-batch-size", "16", "--log-level", "warning"], "serve")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 180)
        yield base
    finally:
        group.close()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120)


def test_streamed_chat_arrives_token_by_token(client):
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", stream=True, max_tokens=24, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    text = "".join(deltas)
    assert len(deltas) > 3 and finish in ("stop", "length")
    assert "Paris" in text


def test_eight_concurrent_streams_share_the_decode_batch(client, server):
    seen_batch = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen_batch.append(stats(server)["batch_size"])
            done.wait(0.05)

    def one(i: int) -> tuple[int, str]:
        stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Story number {i}:",
                                           max_tokens=40, stream=True, extra_body={"ignore_eos": True})
        chunks = [c.choices[0].text for c in stream if c.choices]
        return len(chunks), "".join(chunks)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
    finally:
        done.set()
        watcher.join(10)
    assert all(n >= 2 and text for n, text in results)
    assert max(seen_batch) > 1, seen_batch
    final = stats(server)
    assert final["active_kv_reserved"] == 0 and final["num_active"] == 0


def test_real_model_batched_greedy_matches_transformers(smol_dir):
    """Greedy tokens of the real model, batched with requests of other lengths that
    join and leave, equal teacher-forced transformers logits (float32) at every step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village",
             "1, 2, 3, 4,", "The chemical symbol for gold is", "Translate to French: cheese",
             "A haiku about autumn:", "Water boils at"]
    reqs = [make_request(tok.encode(t), max_tokens=m, ignore_eos=True)
            for t, m in zip(texts, [10, 4, 12, 6, 8, 3, 12, 5])]
    sched = make_scheduler(model, prefill_mode="chunked", prefill_chunk_size=4)
    outs = run_until_idle(sched, {0: reqs[:4], 3: reqs[4:6], 6: reqs[6:]})
    with torch.inference_mode():
        alone = model.generate(torch.tensor([reqs[0].prompt_token_ids]), max_new_tokens=10, do_sample=False,
                               attention_mask=torch.ones(1, reqs[0].prompt_len, dtype=torch.long))
    assert tokens_of(outs[reqs[0].request_id]) == alone[0, reqs[0].prompt_len:].tolist()
    for req in reqs:
        assert_matches_reference(model, req.prompt_token_ids, tokens_of(outs[req.request_id]),
                                 sched.backend.logits[req.request_id])
