"""The kernel boundary checks every pass's arguments (finding 5 of issue 21: block ids,
lengths, slots, positions, dtypes and contiguity were checked three modules away, if at
all, and a slip read or wrote out of bounds silently). Each bad argument is caught; a
violation fails only the rows at fault, and the engine serves on."""

from __future__ import annotations

import pytest
import torch

from engine_proc.backends.kernel_batch import BatchRejected, KernelLimits, check_batch
from engine_proc.request import RequestStatus
from shared.protocol import FinishReason
from tests.helpers import make_request, make_scheduler, run_until_idle, tokens_of

LIMITS = KernelLimits(num_blocks=10, block_size=4, rope_positions=64, device=torch.device("cpu"))


def _good():
    """Two decode rows: "a" at 6 tokens (blocks 3, 7), "b" at 3 tokens (block 5, null padding)."""
    return dict(row_ids=["a", "b"], block_tables=torch.tensor([[3, 7], [5, 10]], dtype=torch.int32),
                seq_lens=[6, 3], slots=torch.tensor([7 * 4 + 1, 5 * 4 + 2]), positions=torch.tensor([5, 2]),
                kernel_lens=torch.tensor([6, 3], dtype=torch.int32))


def _bad(**changes):
    return {**_good(), **changes}


CASES = {
    "block id past the pool": (_bad(block_tables=torch.tensor([[3, 11], [5, 10]], dtype=torch.int32)), ["a"]),
    "negative block id": (_bad(block_tables=torch.tensor([[3, 7], [-1, 10]], dtype=torch.int32)), ["b"]),
    "null block inside a row": (_bad(block_tables=torch.tensor([[3, 10], [5, 10]], dtype=torch.int32)), ["a"]),
    "length past the table": (_bad(seq_lens=[9, 3], kernel_lens=torch.tensor([9, 3], dtype=torch.int32)), ["a"]),
    "zero length": (_bad(seq_lens=[6, 0], kernel_lens=torch.tensor([6, 0], dtype=torch.int32)), ["b"]),
    "kernel lengths disagree": (_bad(kernel_lens=torch.tensor([6, 4], dtype=torch.int32)), ["a", "b"]),
    "slot past the pool": (_bad(slots=torch.tensor([29, 40])), ["b"]),
    "negative slot": (_bad(slots=torch.tensor([-3, 22])), ["a"]),
    "position past the RoPE table": (_bad(positions=torch.tensor([64, 2])), ["a"]),
    "int64 block table": (_bad(block_tables=torch.tensor([[3, 7], [5, 10]])), ["a", "b"]),
    "int32 slots": (_bad(slots=torch.tensor([29, 22], dtype=torch.int32)), ["a", "b"]),
    "float positions": (_bad(positions=torch.tensor([5.0, 2.0])), ["a", "b"]),
    "non-contiguous table": (_bad(block_tables=torch.tensor([[3, 5], [7, 10]], dtype=torch.int32).t()), ["a", "b"]),
    "table rows ≠ rows": (_bad(block_tables=torch.tensor([[3, 7]], dtype=torch.int32)), ["a", "b"]),
    "slots ≠ positions": (_bad(slots=torch.tensor([29])), ["a", "b"]),
}


def test_a_good_batch_passes():
    check_batch(LIMITS, **_good())


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_argument_is_caught_and_names_its_rows(case):
    args, rows = CASES[case]
    with pytest.raises(BatchRejected) as caught:
        check_batch(LIMITS, **args)
    assert caught.value.rows == rows


def test_a_prefill_slot_is_traced_to_its_row():
    """Prefill tokens of rows one after another: the token at fault names its row."""
    tables = torch.tensor([[1, 2], [3, 10], [4, 10]], dtype=torch.int32)
    slots = torch.tensor([4, 5, 6, 7, 8, 12, 13, 16, 99])  # the last token (row "c") is outside
    with pytest.raises(BatchRejected) as caught:
        check_batch(LIMITS, ["a", "b", "c"], tables, [5, 2, 2], slots, torch.tensor([0, 1, 2, 3, 4, 0, 1, 0, 1]),
                    token_offsets=[0, 5, 7])
    assert caught.value.rows == ["c"] and "99 of 40" in str(caught.value)


def test_a_row_with_a_bad_table_fails_alone_and_the_engine_serves_on(tiny_llama):
    sched = make_scheduler(tiny_llama, backend="paged", kv_block_size=16, max_batch_size=4, record=False)
    good, bad = (make_request([5 + i, 6, 7, 8], max_tokens=6, ignore_eos=True) for i in range(2))
    sched.add_request(good)
    sched.add_request(bad)
    sched.step()  # both prefilled and promoted
    assert [r.request_id for r in sched._active] == [good.request_id, bad.request_id]
    sched.backend._rows[bad.request_id].block_ids[0] = 10 ** 6  # a slip upstream: a block past the pool
    outs = run_until_idle(sched)
    assert outs[bad.request_id][-1].finish_reason is FinishReason.ERROR
    assert outs[good.request_id][-1].finish_reason is FinishReason.LENGTH and len(good.output_token_ids) == 6
    assert good.status is RequestStatus.FINISHED_LENGTH and "block id outside the pool" in bad.error
    assert sched.active_kv_reserved == 0 and sched.block_pool.num_used_blocks == 0
    follow = make_request([9, 9, 9], max_tokens=3, ignore_eos=True)
    assert len(tokens_of(run_until_idle(sched, {0: [follow]})[follow.request_id])) == 3


def test_a_bad_prefill_chunk_fails_only_its_row(tiny_llama):
    sched = make_scheduler(tiny_llama, backend="paged", kv_block_size=16, max_batch_size=4, record=False,
                           prefill_mode="chunked", prefill_chunk_size=64)
    long = [7] * 40
    good, bad = make_request(long, max_tokens=3, ignore_eos=True), make_request([8] * 40, max_tokens=3,
                                                                               ignore_eos=True)
    sched.add_request(good)
    sched.add_request(bad)
    sched._admit_pending()
    table = sched.block_pool.block_table(bad.request_id)
    pool_table = sched.block_pool.block_table

    def corrupt(row_id):  # the pool hands the backend a table past its blocks
        out = pool_table(row_id)
        return [b + 10 ** 6 for b in out] if row_id == bad.request_id else out

    sched.block_pool.block_table = corrupt
    outs = run_until_idle(sched)
    assert table and outs[bad.request_id][-1].finish_reason is FinishReason.ERROR
    assert "outside the pool" in outs[bad.request_id][-1].error
    assert len(tokens_of(outs[good.request_id])) == 3
