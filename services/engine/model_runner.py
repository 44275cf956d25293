"""Turns a ``SchedulerOutput`` into one forward pass over a flattened ragged batch and samples.

Inputs per step (no padding): ``input_ids``/``positions``/``slot_mapping`` ``[num_tokens]``,
``block_tables`` ``[num_seqs, max_blocks]``, ``seq_lens`` ``[num_seqs]``; logits only at the
last token of each sequence whose prompt (or recompute) completes this step.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.decode_ops import argmax_rows

from .attention import AttentionMetadata
from .model import LlamaForCausalLM
from .request import Request
from .sampler import SamplingMetadata, TokenLogprobs, make_generator, plain_greedy, sample
from .scheduler import SchedulerOutput
from .step_threads import StepThreads


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    order: list[int]  # batch row -> index in SchedulerOutput.scheduled
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states to sample from
    sampled_rows: list[int]  # batch rows that sample, aligned with logits_indices


def _untimed(phase: str, fn: Callable, *args):
    return fn(*args)


class ModelRunner:
    """Owns the model and the KV cache tensor; ``execute`` runs one engine step's batch."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 step_threads: StepThreads | None = None) -> None:
        self.model = model
        # threads of each step (step_threads.py); default: torch's, every step
        self.step_threads = step_threads or StepThreads("all", torch.get_num_threads())
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.device = kv_cache.device
        self.generators: dict[str, torch.Generator] = {}

    def remove_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def skip_first_draw(self, request: Request) -> None:
        """Decode role: another worker sampled the first token with this request's seed; burn
        that draw here so seeded output equals a unified run's (one ``[vocab]`` noise row)."""
        if request.sampling_params.greedy:
            return
        gen = self.generators.setdefault(request.request_id, make_generator(request.sampling_params.seed))
        torch.empty(self.model.config.vocab_size).exponential_(generator=gen)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Run the model; returns logits ``[num_sampled, vocab]`` float32 (possibly 0 rows)."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn)
        # NOTE: sampling runs on CPU (per-request CPU generators keep seeded output identical
        # across devices); on CUDA that costs one [num_sampled, vocab] float32 copy per step
        return self.model.compute_logits(hidden[inputs.logits_indices]).cpu()

    @torch.inference_mode()
    def sample(self, out: SchedulerOutput, inputs: ModelInputs, logits: torch.Tensor,
               ) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """A token id per ``out.scheduled`` entry (None: a prompt chunk that is not the last),
        and its logprobs where the request asked for them."""
        n = len(out.scheduled)
        sampled: list[int | None] = [None] * n
        logprobs: list[TokenLogprobs | None] = [None] * n
        if not inputs.sampled_rows:
            return sampled, logprobs
        requests = [out.scheduled[inputs.order[row]] for row in inputs.sampled_rows]
        if all(plain_greedy(r) for r in requests):  # the common case: skip the metadata
            for row, token_id in zip(inputs.sampled_rows, argmax_rows(logits).tolist()):
                sampled[inputs.order[row]] = token_id
            return sampled, logprobs
        for r in requests:
            if r.request_id not in self.generators and not r.sampling_params.greedy:
                self.generators[r.request_id] = make_generator(r.sampling_params.seed)
        result = sample(logits, SamplingMetadata.from_requests(requests, self.generators))
        for k, (row, token_id) in enumerate(zip(inputs.sampled_rows, result.token_ids.tolist())):
            sampled[inputs.order[row]] = token_id
            num_top = requests[k].sampling_params.logprobs
            if num_top is not None:
                logprobs[inputs.order[row]] = TokenLogprobs.from_sampler(result, k, num_top)
        return sampled, logprobs

    def execute(self, out: SchedulerOutput, timed: Callable = _untimed,
                ) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """One step's model work: ``prepare_inputs`` -> ``forward`` -> ``sample``; returns what
        ``sample`` does. ``timed(phase, fn, *args)`` runs each phase (the engine times them).
        ``forward`` and ``sample`` run on ``step_threads.choose(num_tokens)`` threads."""
        inputs = timed("prepare_inputs", self.prepare_inputs, out)
        num_tokens, every = inputs.input_ids.shape[0], self.step_threads.num_threads
        threads = self.step_threads.choose(num_tokens)
        if threads != every:
            torch.set_num_threads(threads)  # the CPU kernels read it per call
        started = time.perf_counter()
        try:
            logits = timed("forward", self.forward, inputs)
            result = timed("sample", self.sample, out, inputs, logits)
        finally:
            if threads != every:
                torch.set_num_threads(every)
        self.step_threads.record(num_tokens, threads, time.perf_counter() - started)
        return result

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        reqs = out.scheduled
        n_sched = [out.num_scheduled_tokens[r.request_id] for r in reqs]
        if all(n == 1 for n in n_sched):
            inputs = self._decode_inputs(reqs)
            return inputs if self.device.type == "cpu" else self._to_device(inputs)
        # single-token queries (decode) first: they take the batched decode attention path
        order = sorted(range(len(reqs)), key=lambda i: n_sched[i] != 1)
        input_ids: list[int] = []
        starts, lens, tables = [], [], []
        sampled_rows, logits_indices = [], []
        for row, i in enumerate(order):
            r, n = reqs[i], n_sched[i]
            start = r.num_computed_tokens
            input_ids.extend(r.token_slice(start, start + n))
            starts.append(start)
            lens.append(n)
            tables.append(r.block_table)
            if start + n == r.num_tokens:
                sampled_rows.append(row)
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
        starts_t = torch.tensor(starts, dtype=torch.int64)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        query_start_loc = [0, *torch.cumsum(lens_t, 0).tolist()]
        seq_idx = torch.repeat_interleave(torch.arange(len(order)), lens_t)
        positions = torch.arange(len(input_ids)) - torch.tensor(query_start_loc[:-1])[seq_idx] + starts_t[seq_idx]
        bs = self.block_size
        slot_mapping = block_tables[seq_idx, positions // bs] * bs + positions % bs
        attn = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=starts_t + lens_t,
            query_start_loc=query_start_loc,
            num_decode_seqs=sum(1 for n in lens if n == 1),
        )
        inputs = ModelInputs(
            torch.tensor(input_ids, dtype=torch.int64), positions, attn, order,
            torch.tensor(logits_indices, dtype=torch.int64), sampled_rows,
        )
        return inputs if self.device.type == "cpu" else self._to_device(inputs)

    def _decode_inputs(self, reqs: list[Request]) -> ModelInputs:
        """``prepare_inputs`` when every request computes one token (a decode step): the same
        tensors, built from Python lists in one pass (no per-token tensor arithmetic)."""
        bs = self.block_size
        input_ids, positions, slots, sampled_rows = [], [], [], []
        for row, r in enumerate(reqs):
            pos = r.num_computed_tokens
            input_ids.append(r.token_slice(pos, pos + 1)[0])
            positions.append(pos)
            slots.append(r.block_table[pos // bs] * bs + pos % bs)
            if pos + 1 == r.num_tokens:
                sampled_rows.append(row)
        max_blocks = max(len(r.block_table) for r in reqs)
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        attn = AttentionMetadata(
            slot_mapping=i64(slots),
            block_tables=i64([r.block_table + [0] * (max_blocks - len(r.block_table)) for r in reqs]),
            seq_lens=i64([p + 1 for p in positions]),
            query_start_loc=list(range(len(reqs) + 1)),
            num_decode_seqs=len(reqs),
        )
        return ModelInputs(i64(input_ids), i64(positions), attn, list(range(len(reqs))),
                           i64(sampled_rows), sampled_rows)

    def _to_device(self, inputs: ModelInputs) -> ModelInputs:
        """Built on CPU, used on the model's device (pinned host memory, asynchronous copies)."""
        move = lambda t: t.pin_memory().to(self.device, non_blocking=True)  # noqa: E731
        a = inputs.attn
        inputs.attn = AttentionMetadata(move(a.slot_mapping), move(a.block_tables), move(a.seq_lens),
                                        a.query_start_loc, a.num_decode_seqs)
        inputs.input_ids, inputs.positions = move(inputs.input_ids), move(inputs.positions)
        inputs.logits_indices = move(inputs.logits_indices)
        return inputs
