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
from dataclasses import dataclass

import numpy as np
import torch

from kernels.decode_ops import argmax_rows

from .cuda_graphs import CUDAGraphRunner
from .grammars import Matchers
from .input_batch import InputBatch, ModelInputs, PromptLogprobsPlan, Stage, to_device
from .model import LlamaForCausalLM
from .sampler import SamplerOutput, TokenLogprobs, logprobs_of, sample
from .scheduler import SchedulerOutput
from .step_threads import StepThreads

__all__ = ["ModelInputs", "ModelRunner"]


PROMPT_LOGPROBS_SLICE = 256  # prompt positions whose logits exist at once


def _untimed(phase: str, fn: Callable, *args):
    return fn(*args)


def copy_done_event() -> torch.cuda.Event:
    """The event a launched step records after queueing its tokens' copy to the host. Blocking
    (``cudaEventBlockingSync``): the thread that waits on it sleeps until the copy lands
    instead of spinning in the driver, so the step's one wait costs no CPU time that the
    serving threads or a neighbouring process could use. vLLM made its async-scheduling events
    blocking for the same reason (vllm-project/vllm#47081). NOTE: ``torch.Event(blocking=True)``
    ignores the flag on CUDA; ``torch.cuda.Event`` honours it."""
    return torch.cuda.Event(blocking=True)


@dataclass
class PendingStep:
    """A launched step whose sampled tokens are on their way to the host (``ModelRunner.launch``:
    a decode-only step whose every row samples alone)."""

    out: SchedulerOutput
    inputs: ModelInputs
    tokens: torch.Tensor  # [num_seqs] int64 on the model's device, in out.scheduled order
    host: torch.Tensor  # [num_seqs] int64, pinned: filled by an asynchronous copy of tokens
    copied: torch.cuda.Event | None  # recorded after that copy (None on a CPU: host is tokens)

    def wait(self) -> None:
        """Block until the step has run on the device (its K/V writes included)."""
        if self.copied is not None:
            self.copied.synchronize()


@dataclass
class StepResult:
    """What ``ModelRunner.execute`` returns, aligned with ``SchedulerOutput.scheduled``."""

    sampled: list[int | None]  # the sampled token (None: a prompt chunk that is not the last)
    logprobs: list[TokenLogprobs | None]  # where the request asked for logprobs
    prompt_logprobs: dict[int, list[TokenLogprobs]]  # index -> this step's prompt logprobs
    # whether each sampled token may end its request (InputBatch.record_sampled; False:
    # certainly not, so the scheduler skips its stop test); None: test every token
    stop_checks: list[bool] | None = None


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
        self.graphs: CUDAGraphRunner | None = None  # steps from CUDA graphs (the engine sets it)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the model; returns logits ``[num_sampled, vocab]`` float32 on the model's device
        (possibly 0 rows), and the hidden states ``[m, hidden]`` the step's prompt logprobs
        are computed from (None: nobody asked). A decode step from a CUDA graph's buffers gets
        the graph's logits (``CUDAGraphRunner.logits``, which the next decode step overwrites:
        use them in this step's stream order)."""
        ran = self.graphs.run(inputs) if self.graphs is not None else None
        hidden, logits = ran if ran is not None else (None, None)
        if hidden is None:  # not a step that a graph holds: eager
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attn)
        plan = inputs.prompt_logprobs
        # every token samples (a decode step): the indices are 0..n-1, gathering costs the host
        # more than any other call of the step, and a decode graph ran the LM head already
        every = len(inputs.sampled_rows) == hidden.shape[0]
        if logits is None or not every:
            logits = self.model.compute_logits(hidden if every else hidden[inputs.logits_indices])
        return logits, hidden[plan.indices] if plan is not None else None

    @torch.inference_mode()
    def sample(self, out: SchedulerOutput, inputs: ModelInputs,
               forwarded: tuple[torch.Tensor, torch.Tensor | None]) -> StepResult:
        """A token id per ``out.scheduled`` entry (None: a prompt chunk that is not the last),
        its logprobs where the request asked for them, and the step's prompt logprobs."""
        logits, prompt_hidden = forwarded
        n = len(out.scheduled)
        sampled: list[int | None] = [None] * n
        logprobs: list[TokenLogprobs | None] = [None] * n
        prompt = ({} if prompt_hidden is None
                  else self._prompt_logprobs(inputs.prompt_logprobs, prompt_hidden))
        if not inputs.sampled_rows:
            return StepResult(sampled, logprobs, prompt)
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
        stop_checks = [False] * n
        for i, token_id, check in zip(positions, token_ids, batch.record_sampled(rows, token_ids)):
            sampled[i], stop_checks[i] = token_id, check
        if ids_host is not None:  # one row per request that asked, in batch order
            asked = np.flatnonzero(batch.num_logprobs[rows] >= 0).tolist()
            for j, k in enumerate(asked):
                logprobs[positions[k]] = TokenLogprobs.from_rows(
                    token_ids[k], ids_host[j], lps_host[j], int(batch.num_logprobs[rows[k]]))
        return StepResult(sampled, logprobs, prompt, stop_checks)

    def _prompt_logprobs(self, plan: PromptLogprobsPlan, hidden: torch.Tensor,
                         ) -> dict[int, list[TokenLogprobs]]:
        """Each asking request's prompt logprobs of this step (index in ``out.scheduled`` ->
        one per target, in position order), ``PROMPT_LOGPROBS_SLICE`` rows of logits at a time
        (a 2,048-token chunk's would be 400 MB at once)."""
        parts = []
        for lo in range(0, hidden.shape[0], PROMPT_LOGPROBS_SLICE):
            logits = self.model.compute_logits(hidden[lo:lo + PROMPT_LOGPROBS_SLICE])
            targets = plan.targets[lo:lo + PROMPT_LOGPROBS_SLICE]
            rows = torch.arange(logits.shape[0], device=logits.device)
            parts.append(SamplerOutput(targets, *logprobs_of(logits, rows, targets, plan.num_top)))
        chosen, top_ids, lps = SamplerOutput(*(torch.cat(x) for x in zip(
            *((p.token_ids, p.logprobs, p.top_ids, p.top_logprobs) for p in parts)))).to_host()
        self.num_host_reads += 1
        result, k = {}, 0
        for index, count, num_top in plan.owners:
            result[index] = [TokenLogprobs.from_rows(chosen[k + i], top_ids[k + i], lps[k + i],
                                                     num_top) for i in range(count)]
            k += count
        return result

    def _to_host_list(self, t: torch.Tensor) -> list[int]:
        self.num_host_reads += 1
        return t.tolist()

    def execute(self, out: SchedulerOutput, timed: Callable = _untimed) -> StepResult:
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
            forwarded = timed("forward", self.forward, inputs)
            result = timed("sample", self.sample, out, inputs, forwarded)
        finally:
            if threads != every:
                torch.set_num_threads(every)
        self.step_threads.record(num_tokens, threads, time.perf_counter() - started)
        return result

    # -- async scheduling (engine.py): a step launched before the previous one's tokens are read
    def launch(self, out: SchedulerOutput, timed: Callable = _untimed) -> PendingStep | StepResult:
        """Prepare and run ``out`` without waiting for its tokens when it is a decode-only step
        whose every row samples alone (``InputBatch.samples_alone``: ``PendingStep``;
        ``collect`` reads them); any other step runs whole (``execute``'s ``StepResult``)."""
        inputs = timed("prepare_inputs", self.prepare_inputs, out)
        n = inputs.input_ids.shape[0]
        if not (inputs.attn.num_decode_seqs == n == len(inputs.sampled_rows)
                and inputs.prompt_logprobs is None
                and self.input_batch.samples_alone(inputs.rows)):
            forwarded = timed("forward", self.forward, inputs)
            return timed("sample", self.sample, out, inputs, forwarded)
        return self._launch(out, inputs, 0, timed)

    def launch_ahead(self, out: SchedulerOutput, previous: PendingStep, keep: list[int],
                     timed: Callable = _untimed) -> PendingStep | None:
        """Launch ``out``: first the next token of ``previous``'s requests at indices ``keep``,
        whose input tokens are ``previous``'s samples on the device (the scheduler's and this
        batch's counters of them are one token behind), then requests admitted since, whose
        tokens are all known. None (nothing launched) when an admitted request does not sample
        alone."""
        ids = previous.tokens
        if len(keep) < len(previous.out.scheduled):  # the index goes without a host sync too
            ids = ids[to_device({"keep": np.asarray(keep, np.int64)}, ids.device)["keep"]]
        inputs = timed("prepare_inputs", self.input_batch.prepare, out, ids, self._stage())
        if len(keep) < len(out.scheduled) and not self.input_batch.samples_alone(inputs.rows):
            return None
        ahead = (np.arange(len(out.scheduled)) < len(keep)).astype(np.int64)
        return self._launch(out, inputs, ahead, timed)

    def _launch(self, out: SchedulerOutput, inputs: ModelInputs, ahead: int | np.ndarray,
                timed: Callable) -> PendingStep:
        """Forward and sample on the device, and queue the tokens' copy to the host; ``ahead``:
        tokens of each row (or of all) sampled and not yet recorded."""
        logits, _ = timed("forward", self.forward, inputs)
        return timed("sample", self._sample_launched, out, inputs, logits, ahead)

    def _sample_launched(self, out: SchedulerOutput, inputs: ModelInputs, logits: torch.Tensor,
                         ahead: int | np.ndarray) -> PendingStep:
        batch, rows = self.input_batch, inputs.rows  # in out.scheduled order: decode-only
        tokens = (argmax_rows(logits) if batch.plain_greedy(rows, ahead)
                  else sample(logits, batch.sampling(rows, ahead)).token_ids)
        if not tokens.is_cuda:
            return PendingStep(out, inputs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = copy_done_event()
        copied.record()
        return PendingStep(out, inputs, tokens, host, copied)

    def collect(self, step: PendingStep, timed: Callable = _untimed) -> StepResult:
        """Wait for a launched step's tokens (the step's one host synchronisation) and record
        them in the batch; what ``execute`` returns for the step."""
        def read() -> list[int]:
            step.wait()
            return self._to_host_list(step.host)

        token_ids = timed("sample", read)
        stop_checks = self.input_batch.record_sampled(step.inputs.rows, token_ids)
        return StepResult(token_ids, [None] * len(token_ids), {}, stop_checks)

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        """The step's model inputs on the model's device (``InputBatch.prepare``; a decode
        step that a CUDA graph holds, in the graph's buffers: ``CUDAGraphRunner.stage``)."""
        return self.input_batch.prepare(out, None, self._stage())

    def _stage(self) -> Stage | None:
        return self.graphs.stage if self.graphs is not None else None
