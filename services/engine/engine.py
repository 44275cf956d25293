"""The engine core: one worker's model, KV cache, scheduler and step loop.

A step reads as the algorithm: ``scheduler.schedule()`` -> ``runner.execute()`` ->
``scheduler.update_from_output()``. Roles: a ``prefill`` worker adds requests with
``hold_kv=True`` (compute the prompt, sample the first token, keep the KV until it has been
sent); a ``decode`` worker ``reserve()``s blocks for a prompt whose KV another worker writes,
then ``finish_remote_prefill()`` admits it; ``unified`` does both in one process.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from .block_manager import BlockManager
from .config import KVCacheLayout, ModelConfig
from .metrics import STEP_PHASES, EngineMetrics
from .model_files import default_model_path
from .model_runner import ModelRunner
from .quantized import build_model, resident_weight_bytes
from .request import Request, RequestStatus
from .sampler import TokenLogprobs
from .sampling_params import SamplingParams
from .scheduler import RequestOutput, Scheduler, SchedulerConfig, SchedulerOutput

log = logging.getLogger(__name__)


class EngineConfig(BaseModel):
    """Engine knobs; validated, a bad value raises ``ValueError`` naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(default_factory=lambda: str(default_model_path()))  # .gguf or HF dir
    dtype: str = "float32"  # float32 | bfloat16 | auto
    quantization: str = "none"  # none | auto | q4_0 | q4_1 | q8_0 (see engine.quantized)
    device: str = "cpu"
    block_size: int = Field(default=16, gt=0)  # tokens per KV block
    num_kv_blocks: int | None = Field(default=None, gt=0)  # overrides kv_cache_memory_gib
    kv_cache_memory_gib: float = Field(default=1.0, gt=0)
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    max_model_len: int | None = Field(default=None, gt=1)  # default: the model's context
    scheduling_policy: Literal["continuous", "static"] = "continuous"
    enable_prefix_caching: bool = True


class LLMEngine:
    """Synchronous engine: callers own the thread that calls ``step()``."""

    def __init__(self, config: EngineConfig | None = None, *, weights=None) -> None:
        self.config = config = config or EngineConfig()
        t0 = time.perf_counter()
        model, self.precision = build_model(config.model, config.dtype, config.quantization,
                                            config.device, weights)
        self.model_config: ModelConfig = (model_config := model.config)
        self.weight_bytes = resident_weight_bytes(model)
        dtype = getattr(torch, self.precision.dtype)
        self.layout = KVCacheLayout.of(model_config, config.block_size, dtype)
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(config.kv_cache_memory_gib)
        kv_shape = (self.layout.num_layers, 2, num_blocks, config.block_size,
                    self.layout.num_kv_heads, self.layout.head_dim)
        self.kv_cache = torch.zeros(kv_shape, dtype=dtype, device=config.device)
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            config.scheduling_policy, config.enable_prefix_caching),
            self.block_manager,
        )
        self.runner = ModelRunner(model, self.kv_cache, config.block_size)
        self.metrics = EngineMetrics()
        log.info("engine ready in %.1fs: %d KV blocks of %d tokens, max_model_len %d",
                 time.perf_counter() - t0, num_blocks, config.block_size, self.max_model_len)

    def warm_up(self) -> float:
        """Run one throwaway request (an 8-token prefill, then a decode step) so the first real
        request does not pay the model's first-call costs, then reset the metrics and counters.
        With ``block_size`` >= 3 it fills no KV block, so nothing enters the prefix cache.
        Call before serving (it steps the engine). Returns the seconds it took."""
        t0 = time.perf_counter()
        s = self.scheduler
        counters = (s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits)
        prompt = list(range(1, 9))[:max(1, self.block_manager.block_size - 2)]
        self.add_request(self.make_request(f"warm-up-{uuid.uuid4().hex}", prompt,
                                           SamplingParams(temperature=0, max_tokens=2)))
        while self.has_work():
            self.step()
        s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits = counters
        self.metrics = EngineMetrics()
        return time.perf_counter() - t0

    def _blocks_for_memory(self, gib: float) -> int:
        per_block = self.layout.block_bytes * 2 * self.layout.num_layers
        return max(1, int(gib * 2**30) // per_block)

    # -- requests ----------------------------------------------------------------------------
    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        *, hold_kv: bool = False,
    ) -> Request:
        """Validate and build a request. Raises ``ValueError`` naming the offending field."""
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens leave no room for output "
                             f"within the context length of {self.max_model_len} tokens")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt_token_ids: ids must be in [0, {vocab})")
        if self.block_manager.blocks_needed(len(prompt_token_ids) + 1) > self.block_manager.num_blocks:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens exceed this worker's KV cache")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        return Request(request_id, list(prompt_token_ids), params,
                       eos_token_id=self.model_config.eos_token_id, hold_kv_on_finish=hold_kv)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def reserve(self, request: Request) -> bool:
        """Decode role: reserve blocks for the prompt's KV; False when too few are free."""
        return self.scheduler.reserve(request)

    def finish_remote_prefill(self, request_id: str, first_token_id: int,
                              logprobs: TokenLogprobs | None = None) -> RequestOutput | None:
        """Decode role: the prompt's KV has landed; admit the request with its first token
        (and its logprobs, computed by the prefill worker)."""
        request = self.scheduler.requests.get(request_id)
        output = self.scheduler.finish_remote_prefill(request_id, first_token_id)
        if output is None:
            return None
        if logprobs is not None:
            output.logprobs = [logprobs]
        if output.finish_reason:
            self.runner.remove_request(request_id)
        else:
            self.runner.skip_first_draw(request)
        return output

    def prefill_locally(self, request_id: str) -> bool:
        """Decode role: a reservation's KV will not arrive (failed or timed-out transfer), and no
        write into its blocks is in flight any more; compute the prompt here instead, in the
        blocks already reserved (``num_computed_tokens`` stays 0, so the scheduler schedules the
        whole prompt and samples the first token). False unless the request is waiting for KV."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_KV:
            return False
        request.status = RequestStatus.WAITING
        self.scheduler.add_request(request)
        return True

    def abort(self, request_id: str) -> bool:
        self.runner.remove_request(request_id)
        return self.scheduler.abort(request_id)

    def release(self, request_id: str) -> None:
        """Prefill role: free a finished request's blocks once its KV has been sent."""
        self.scheduler.release(request_id)

    # -- stepping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model once, sample, update. Finished requests are
        evicted and their blocks freed (unless held) before this returns."""
        m = self.metrics
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        t1 = time.perf_counter()
        inputs = self.runner.prepare_inputs(out)
        t2 = time.perf_counter()
        logits = self.runner.forward(inputs)
        t3 = time.perf_counter()
        sampled, logprobs = self.runner.sample(out, inputs, logits)
        t4 = time.perf_counter()
        outputs = self.scheduler.update_from_output(out, sampled)
        by_id = {r.request_id: lp for r, lp in zip(out.scheduled, logprobs) if lp is not None}
        for o in outputs:
            if o.request_id in by_id:
                o.logprobs = [by_id[o.request_id]]
            if o.finish_reason:
                self.runner.remove_request(o.request_id)
        t5 = time.perf_counter()
        for phase, dt in zip(STEP_PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            m.phase_s[phase] += dt
        self._count(out, len(outputs))
        return outputs

    def _count(self, out: SchedulerOutput, num_generated: int) -> None:
        m = self.metrics
        m.num_steps += 1
        m.num_batched_tokens += out.total_num_scheduled_tokens
        m.num_scheduled_seqs += len(out.scheduled)
        m.num_generated_tokens += num_generated
        bs = self.block_manager.block_size
        m.kv_allocated_slots += sum(len(r.block_table) for r in out.scheduled) * bs
        # a static batch's padding rows hold slots whose KV no request uses
        m.kv_used_slots += sum(min(r.num_computed_tokens, len(r.block_table) * bs)
                               for r in out.scheduled if not r.is_padding)
        m.kv_used_blocks += self.block_manager.num_used_blocks
        m.num_preemptions = self.scheduler.num_preemptions
        m.prefix_cache_queries = self.scheduler.prefix_cache_queries  # cumulative, tokens
        m.prefix_cache_hits = self.scheduler.prefix_cache_hits

    def load(self) -> dict[str, int]:
        """Load figures for the worker registry."""
        return {
            "free_kv_blocks": self.block_manager.num_free_blocks,
            "total_kv_blocks": self.block_manager.num_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": self.scheduler.num_waiting,
        }

