"""The persistent batch builds the same model inputs as a request-by-request construction, step
after step, while block tables grow, requests are preempted (tables replaced), tokens arrive from
elsewhere (a remote prefill's first token), rows are freed and reused."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from services.engine.input_batch import InputBatch
from services.engine.request import Request
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import SchedulerOutput


def reference_inputs(out: SchedulerOutput, block_size: int) -> dict:
    """The step's inputs, built one request at a time from Python lists (decode rows first)."""
    reqs = out.scheduled
    n_sched = [out.num_scheduled_tokens[r.request_id] for r in reqs]
    order = sorted(range(len(reqs)), key=lambda i: n_sched[i] != 1)
    ids, positions, slots, seq_lens, tables, qsl, logits_idx, sampled = [], [], [], [], [], [0], [], []
    for row, i in enumerate(order):
        r, n = reqs[i], n_sched[i]
        start = r.num_computed_tokens
        for pos in range(start, start + n):
            ids.append(r.all_token_ids[pos])
            positions.append(pos)
            slots.append(r.block_table[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(start + n)
        tables.append(r.block_table)
        qsl.append(len(ids))
        if start + n == r.num_tokens:
            sampled.append(row)
            logits_idx.append(len(ids) - 1)
    width = -(-max(seq_lens) // block_size)
    return {"input_ids": ids, "positions": positions, "slot_mapping": slots,
            "seq_lens": seq_lens, "block_tables": [t[:width] + [0] * (width - len(t[:width]))
                                                   for t in tables],
            "query_start_loc": qsl, "order": order, "logits_indices": logits_idx,
            "sampled_rows": sampled, "num_decode_seqs": sum(n == 1 for n in n_sched)}


def assert_same(got, want: dict) -> None:
    a = got.attn
    assert got.input_ids.tolist() == want["input_ids"]
    assert got.positions.tolist() == want["positions"]
    assert a.slot_mapping.tolist() == want["slot_mapping"]
    assert a.seq_lens.tolist() == want["seq_lens"]
    assert a.block_tables.tolist() == want["block_tables"]
    assert a.query_start_loc == want["query_start_loc"]
    assert a.num_decode_seqs == want["num_decode_seqs"]
    assert got.order == want["order"] and got.sampled_rows == want["sampled_rows"]
    assert got.logits_indices.tolist() == want["logits_indices"]


@pytest.mark.parametrize("block_size,seed", [(16, 0), (4, 1), (1, 2), (5, 3)])
def test_prepare_equals_a_request_by_request_construction_over_many_steps(block_size, seed):
    rng = random.Random(seed)
    ib = InputBatch(max_model_len=400, block_size=block_size, vocab_size=1000, capacity=2)
    free_blocks = list(range(1000))
    rng.shuffle(free_blocks)
    live: list[Request] = []
    serial = 0
    for step in range(60):
        finished: set[str] = set()
        # arrivals, finishes and preemptions, as a scheduler would make them
        while len(live) < 6 or rng.random() < 0.2:
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 50))]
            live.append(Request(f"r{serial}", prompt, SamplingParams(temperature=0, max_tokens=300)))
            serial += 1
        if rng.random() < 0.2:
            done = live.pop(rng.randrange(len(live)))
            finished.add(done.request_id)
            free_blocks.extend(done.block_table)
        preempted = []
        if rng.random() < 0.15:
            victim = rng.choice(live)
            free_blocks.extend(victim.block_table)
            victim.block_table = []  # as BlockManager.free does: a new list
            victim.num_computed_tokens = 0
            preempted.append(victim)
        if rng.random() < 0.1:  # a token from elsewhere (a remote prefill's first token)
            r = rng.choice(live)
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(rng.randrange(1000))
        out = SchedulerOutput(preempted=preempted, finished_req_ids=finished)
        for r in live:
            if r in preempted or rng.random() < 0.2:
                continue  # not scheduled this step
            left = r.num_tokens - r.num_computed_tokens
            n = left if left <= 1 else rng.randrange(1, left + 1)
            need = -(-(r.num_computed_tokens + n) // block_size) - len(r.block_table)
            r.block_table.extend(free_blocks.pop() for _ in range(max(need, 0)))
            out.scheduled.append(r)
            out.num_scheduled_tokens[r.request_id] = n
        if not out.scheduled:
            ib.remove(finished)
            continue
        inputs = ib.prepare(out)
        assert_same(inputs, reference_inputs(out, block_size))
        # the model "samples": the runner records the tokens, the scheduler appends them
        rows = inputs.rows[inputs.sampled_rows]
        tokens = [rng.randrange(1000) for _ in inputs.sampled_rows]
        ib.record_sampled(rows, tokens)
        for r in out.scheduled:
            r.num_computed_tokens += out.num_scheduled_tokens[r.request_id]
        for row, token in zip(inputs.sampled_rows, tokens):
            out.scheduled[inputs.order[row]].output_token_ids.append(token)
        for r in list(live):
            if r.num_tokens >= 390:
                live.remove(r)
                ib.remove([r.request_id])
    assert len(ib.row_of) <= len(live) + 1
    assert set(ib.row_of) <= {r.request_id for r in live} | {"none"}


def test_rows_are_reused_and_the_arrays_grow_past_their_capacity():
    ib = InputBatch(max_model_len=64, block_size=4, vocab_size=100, capacity=2)
    reqs = [Request(f"r{i}", [i + 1] * 3, SamplingParams(seed=i, stop_token_ids=tuple(range(i))))
            for i in range(5)]
    rows = [ib.add(r) for r in reqs]
    assert sorted(rows) == list(range(5)) and ib.stop_ids[rows[4]].tolist() == [0, 1, 2, 3]
    assert ib.token_ids[rows[4], :3].tolist() == [5, 5, 5] and int(ib.seed[rows[3]]) == 3
    ib.remove(["r1", "r3", "unknown"])
    again = ib.add(Request("r9", [7], SamplingParams()))
    assert again in (rows[1], rows[3]) and ib.token_ids[again, 0] == 7
    assert ib.num_tokens[again] == 1 and (ib.stop_ids[again] == -1).all()


def test_unseeded_requests_get_distinct_random_seeds():
    ib = InputBatch(max_model_len=64, block_size=4, vocab_size=100)
    rows = [ib.add(Request(f"r{i}", [1], SamplingParams())) for i in range(8)]
    assert len({int(ib.seed[r]) for r in rows}) == 8


def test_prepare_works_on_a_decode_only_batch_of_one():
    ib = InputBatch(max_model_len=64, block_size=4, vocab_size=100)
    r = Request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0))
    r.block_table, r.num_computed_tokens = [3, 8], 4
    got = ib.prepare(SchedulerOutput([r], {"a": 1}))
    assert got.input_ids.tolist() == [9] and got.attn.slot_mapping.tolist() == [8 * 4 + 0]
    assert got.attn.block_tables.tolist() == [[3, 8]] and got.sampled_rows == [0]
    assert np.array_equal(got.rows, [ib.row_of["a"]])


def test_pack_and_unpack_round_trip_every_dtype_and_shape():
    from services.engine.input_batch import pack, unpack

    arrays = {"i64": np.arange(5, dtype=np.int64), "f32": np.linspace(0, 1, 7, dtype=np.float32),
              "i32": np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32), "empty": np.zeros(0, np.int64),
              "u64": np.array([2**63 + 5], dtype=np.uint64), "b": np.array([True, False, True]),
              "strided": np.arange(20, dtype=np.int64).reshape(4, 5)[:, 1:3]}
    host, layout = pack(arrays, pin=False)
    assert host.dtype == torch.uint8 and all(off % 8 == 0 for off, _, _ in layout.values())
    got = unpack(host.clone(), layout)  # what arrives on the device is a copy of the buffer
    for k, a in arrays.items():
        assert got[k].shape == a.shape and got[k].numpy().tolist() == a.tolist(), k


@pytest.mark.parametrize("seed", range(4))
def test_a_token_cleared_by_record_sampled_never_stops_its_request(seed):
    """``record_sampled``'s stop checks let the scheduler skip ``Request.check_stop``: a False
    must mean the request goes on (EOS, stop ids, min_tokens, max_tokens, max_model_len), and
    a request that stops must have been flagged."""
    rng = random.Random(seed)
    max_model_len, vocab = 40, 12
    ib = InputBatch(max_model_len=max_model_len, block_size=4, vocab_size=vocab, capacity=2)
    live = []
    for i in range(24):
        params = SamplingParams(
            temperature=0, max_tokens=rng.randrange(1, 30), ignore_eos=rng.random() < 0.3,
            stop_token_ids=tuple(rng.sample(range(vocab), rng.randrange(3))))
        params = params.model_copy(update={"min_tokens": rng.randrange(params.max_tokens + 1)})
        r = Request(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))], params,
                    eos_token_id=rng.choice([None, 0, 1]))
        ib.add(r)
        live.append(r)
    flagged = stopped = 0
    while live:
        rows = np.array([ib.row_of[r.request_id] for r in live], np.int64)
        tokens = [rng.randrange(vocab) for _ in live]
        checks = ib.record_sampled(rows, tokens)
        for r, token, check in zip(list(live), tokens, checks):
            r.output_token_ids.append(token)
            status = r.check_stop(max_model_len)
            assert check or status is None, (r.request_id, token, r.sampling_params)
            flagged += check
            if status is not None:
                stopped += 1
                live.remove(r)
                ib.remove([r.request_id])
    assert stopped == 24 and flagged >= stopped


def test_steps_ahead_keeps_running_requests_whose_next_token_is_not_their_last_by_length():
    """``steps_ahead`` (async scheduling) against the rule written per request: running, one
    more output below ``max_tokens`` and the token after it within ``max_model_len``."""
    from services.engine.request import RequestStatus

    rng = random.Random(7)
    max_model_len = 30
    ib = InputBatch(max_model_len=max_model_len, block_size=4, vocab_size=50, capacity=2)
    reqs = []
    for i in range(40):
        r = Request(f"r{i}", [1] * rng.randrange(1, 20),
                    SamplingParams(temperature=0, max_tokens=rng.randrange(1, 15)))
        r.output_token_ids = [2] * rng.randrange(0, r.sampling_params.max_tokens)
        if len(r.all_token_ids) >= max_model_len:
            continue
        r.status = rng.choice([RequestStatus.RUNNING] * 3 + [RequestStatus.FINISHED_STOPPED])
        ib.add(r)
        reqs.append(r)
    rows = np.array([ib.row_of[r.request_id] for r in reqs], np.int64)
    want = [i for i, r in enumerate(reqs) if r.status == RequestStatus.RUNNING
            and len(r.output_token_ids) + 1 < r.sampling_params.max_tokens
            and r.num_tokens < max_model_len - 1]
    assert ib.steps_ahead(rows, reqs) == want and 0 < len(want) < len(reqs)
