"""Turns a ``SchedulerOutput`` into one forward pass over a flattened ragged batch and samples.

Inputs per step (no padding): ``input_ids``/``positions``/``slot_mapping`` ``[num_tokens]``,
``block_tables`` ``[num_seqs, max_blocks]``, ``seq_lens`` ``[num_seqs]``; logits only at the
last token of each sequence whose prompt (or recompute) completes this step. They are gathered
from the persistent ``InputBatch`` (``input_batch.py``), so the work per step does not grow
with the batch beyond reading each scheduled request's counters. On a GPU the inputs travel in
one host-to-device copy and the sampled tokens (with their logprobs) come back in one
device-to-host copy: the step's only synchronisation with the host.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from kernels.decode_ops import argmax_rows

from .cuda_graphs import CUDAGraphRunner
from .grammars import Matchers
from .input_batch import InputBatch, ModelInputs
from .model import LlamaForCausalLM
from .sampler import TokenLogprobs, sample
from .scheduler import SchedulerOutput
from .step_threads import StepThreads

__all__ = ["ModelInputs", "ModelRunner"]


def _untimed(phase: str, fn: Callable, *args):
    return fn(*args)


class ModelRunner:
    """Owns the model, the KV cache tensor and the persistent batch; ``execute`` runs one engine
    step's batch. ``max_model_len``: the engine's (tokens a request may hold); ``matchers``:
    structured outputs' grammar matchers (``grammars.Matchers``)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 max_model_len: int, step_threads: StepThreads | None = None,
                 matchers: Matchers | None = None) -> None:
        self.model = model
        # threads of each step (step_threads.py); default: torch's, every step
        self.step_threads = step_threads or StepThreads("all", torch.get_num_threads())
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.device = kv_cache.device
        self.input_batch = InputBatch(max_model_len, block_size, model.config.vocab_size,
                                      kv_cache.device, matchers=matchers)
        self.num_host_reads = 0  # device-to-host copies of sampled tokens (one per step)
        self.graphs: CUDAGraphRunner | None = None  # decode steps from CUDA graphs (engine sets)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Run the model; returns logits ``[num_sampled, vocab]`` float32 on the model's device
        (possibly 0 rows)."""
        hidden = self.graphs.run(inputs) if self.graphs is not None else None
        if hidden is None:  # not a decode step that a graph holds: eager
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn)
        return self.model.compute_logits(hidden[inputs.logits_indices])

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
        batch = self.input_batch
        rows = inputs.rows[inputs.sampled_rows]
        positions = [inputs.order[row] for row in inputs.sampled_rows]  # in out.scheduled
        ids_host = lps_host = None
        if batch.plain_greedy(rows):  # the common case: skip the sampling settings
            token_ids = self._to_host_list(argmax_rows(logits))
        else:
            result = sample(logits, batch.sampling(rows))
            token_ids, ids_host, lps_host = result.to_host()
            self.num_host_reads += 1
        batch.record_sampled(rows, token_ids)
        for i, token_id in zip(positions, token_ids):
            sampled[i] = token_id
        if ids_host is not None:  # one row per request that asked, in batch order
            asked = np.flatnonzero(batch.num_logprobs[rows] >= 0).tolist()
            for j, k in enumerate(asked):
                logprobs[positions[k]] = TokenLogprobs.from_rows(
                    token_ids[k], ids_host[j], lps_host[j], int(batch.num_logprobs[rows[k]]))
        return sampled, logprobs

    def _to_host_list(self, t: torch.Tensor) -> list[int]:
        self.num_host_reads += 1
        return t.tolist()

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
        """The step's model inputs on the model's device (``InputBatch.prepare``)."""
        return self.input_batch.prepare(out)
