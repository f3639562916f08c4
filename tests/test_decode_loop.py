"""A decode-only pass's layers in one C call (``engine_proc/backends/decode_loop.py``):
the same logits, bit for bit, as the runner's loop of kernel calls from Python, on the
tiny Llama's packed low-bit weights; used for decode-only passes on the low-bit path and
for nothing else."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_request, make_scheduler, run_until_idle, tokens_of
from tests.test_lowbit import needs_c, tiny_gguf  # noqa: F401 - the fixture, shared

PROMPTS = [[5, 17, 99, 1234, 7], [300, 301, 302], list(range(40, 75))]


def _packed_scheduler(tiny_gguf, tiny_model_dir, dtype, use_loop: bool):  # noqa: F811 - the fixture's value
    from engine_proc import gguf_weights, lowbit_model

    model, path = tiny_gguf
    weights = gguf_weights.read(path, model.config)
    packed = lowbit_model.model_from_packed(tiny_model_dir, weights, dtype)
    setattr(packed, lowbit_model.LOW_BIT_ATTR, weights)
    sched = make_scheduler(packed, prefill_mode="chunked", prefill_chunk_size=8)
    runner = sched.backend.runner
    runner.plan.quantized_below = 1 << 30  # every pass on the packed weights
    assert runner.decode_loop is not None, "the C decode loop was not built for a packed model on the C kernels"
    calls = []
    if use_loop:
        run = runner.decode_loop.run
        runner.decode_loop.run = lambda *a: calls.append(a[0].shape[0]) or run(*a)
    else:
        runner.decode_loop = None
    return sched, calls


def _generate(sched):
    reqs = [make_request(p, max_tokens=12, ignore_eos=True) for p in PROMPTS]
    outs = run_until_idle(sched, {0: reqs[:2], 3: reqs[2:]})
    return [(tokens_of(outs[r.request_id]), torch.stack(sched.backend.logits[r.request_id])) for r in reqs]


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_loop_gives_the_python_loops_logits_bit_for_bit(tiny_gguf, tiny_model_dir, dtype):  # noqa: F811
    with_loop, calls = _packed_scheduler(tiny_gguf, tiny_model_dir, dtype, use_loop=True)
    without, _ = _packed_scheduler(tiny_gguf, tiny_model_dir, dtype, use_loop=False)
    got, want = _generate(with_loop), _generate(without)
    # decode passes of 1, 2 and 3 rows went through it (the third request joins later)
    assert calls and {1, 2, 3} & set(calls) and max(calls) == 3, calls
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want):
        assert tokens == want_tokens
        assert torch.equal(logits, want_logits)


@needs_c
def test_passes_the_plan_gives_to_the_dense_weights_take_the_python_loop(tiny_gguf, tiny_model_dir):  # noqa: F811
    sched, calls = _packed_scheduler(tiny_gguf, tiny_model_dir, torch.float32, use_loop=True)
    sched.backend.runner.plan.quantized_below = 2  # one-row passes low-bit, the rest dense
    got = _generate(sched)
    assert all(len(tokens) == 12 for tokens, _ in got)
    assert calls and set(calls) == {1}, calls
