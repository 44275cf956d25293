"""The engine core: one worker's model, KV cache, scheduler and step loop.

A step reads as the algorithm: ``scheduler.schedule()`` -> ``runner.execute()`` ->
``scheduler.update_from_output()``, each phase timed from outside (``EngineMetrics.timed``). Roles: a
``prefill`` worker adds requests with ``hold_kv=True`` (compute the prompt, sample the first
token, keep the KV until it has been sent); a ``decode`` worker ``reserve()``s blocks for a
prompt whose KV another worker writes, then ``finish_remote_prefill()`` admits it; ``unified``
does both in one process.

Async scheduling (on by default where the model runs on a GPU; vLLM's ``--async-scheduling``):
a decode-only step whose every row samples alone (greedy or random, without penalties,
structured output or logprobs, which read the tokens so far) is launched without waiting for its
tokens, and before they are read the next step of the same requests (and of any admitted since
that only decode: a remote prefill's) is launched, its input tokens taken from the first step's
samples on the device (``_launch_ahead``). The host then updates the scheduler and streams the
first step's tokens while the device computes the next: a step costs the larger of the GPU's
time and the host's, not their sum. Tokens are the same
as without it: the step ahead computes what the next ``schedule()`` would have (a request that
stops on a stop token computes one token more, which is dropped).

Fault containment: when ``runner.execute`` raises, nothing of the scheduler's state has advanced
yet (``update_from_output`` has not run), so the step's requests are run again one by one. A
request that raises alone is failed (aborted, its blocks freed, an output with ``error``); the
others' tokens are used as if the batch had succeeded (re-running a request rewrites its KV
slots with the same values). When no request succeeds alone (two or more in the step, or
``MAX_STEPS_LOST_ALL`` such steps in a row), or anything outside ``execute`` raises, the failure
is the engine's: ``EngineDeadError`` (or the exception) propagates; do not step it again.
"""
from __future__ import annotations

import logging
import time
import uuid

import torch

from services.errors import InvalidArgument

from . import kv_sizing
from .block_manager import BlockManager
from .config import KVCacheLayout, ModelConfig
from .cuda_graphs import CUDAGraphRunner
from .engine_config import EngineConfig  # noqa: F401 - re-exported: callers name it from here
from .faults import EngineFaults
from .grammars import Matchers
from .host_memory import zeroed_kv_cache
from .kv_events import KVEventLog
from .metrics import EngineMetrics
from .model_runner import ModelRunner, PendingStep, StepResult
from .outputs import EngineDeadError, RequestOutput
from .policy import create_scheduler
from .quantized import Precision, build_model, resident_weight_bytes
from .request import Request, RequestStatus, request_id_of
from .sampler import TokenLogprobs
from .sampling_params import SamplingParams
from .scheduler import SchedulerConfig, SchedulerOutput
from .step_cost import PromptCostModel, StepCostModel
from .step_threads import StepThreads
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_STEPS_LOST_ALL = 3  # single-request steps in a row that fail: the engine's fault, not theirs


def _async_scheduling(config: EngineConfig, on_gpu: bool, faults: EngineFaults | None) -> bool:
    """Whether steps may be launched ahead (``LLMEngine._launch_ahead``): by default where the
    model runs on a GPU (a CPU computes a step in the calling thread: nothing to overlap); never
    for static batching's padding rows nor under fault injection's per-step hooks."""
    wanted = on_gpu if config.async_scheduling is None else config.async_scheduling
    return wanted and config.scheduling_policy == "continuous" and faults is None


def resolve_kv_cache_dtype(kv_cache_dtype: str, precision: Precision, device: str,
                           fused_forward: bool) -> torch.dtype:
    """The KV cache's torch dtype for the ``kv_cache_dtype`` setting.

    ``float16`` runs where the fused C forward pass does (``QuantizedForward``: a GGUF format's
    linears in the CPU kernels, float32 activations), which writes each K/V value rounded to
    nearest even once and reads it widened exactly: half the KV bytes, twice the blocks in the
    same memory, a faster attention, and a request's tokens still the same bits in any batch.
    llama.cpp's default cache type is the same (``f16``); the quality it costs on the built-in
    model is measured by ``scripts.bench_quality`` (docs/benchmarks.md). ``auto`` picks
    ``float16`` there when the linears are a quantized block format (Q4_0, Q4_1, Q8_0: the
    weights' rounding is far larger than the cache's), and the model's dtype
    (``precision.dtype``) everywhere else: F32 rows and the float32 oracle (``quantization
    none``) keep a float32 cache. A dtype equal to the model's is always accepted.

    Raises ``ValueError`` naming ``kv_cache_dtype`` for any other combination: the torch module
    path and the GPU kernels read the cache in the model's dtype only.
    """
    fused_cpu = fused_forward and torch.device(device).type == "cpu"
    if kv_cache_dtype == "auto":
        quantized = precision.quantization not in ("none", "f32")
        return torch.float16 if fused_cpu and quantized else getattr(torch, precision.dtype)
    if kv_cache_dtype == precision.dtype or (kv_cache_dtype == "float16" and fused_cpu):
        return getattr(torch, kv_cache_dtype)
    raise ValueError(
        f"kv_cache_dtype: {kv_cache_dtype} runs only where the model computes in it, or (float16) "
        f"in the fused CPU forward pass of a GGUF format (--quantization auto); this worker runs "
        f"{precision.quantization} weights in {precision.dtype} on {device}")


class LLMEngine:
    """Synchronous engine: callers own the thread that calls ``step()``.

    ``weights``: ``(ModelConfig, state_dict)`` already loaded (else read from ``config.model``).
    ``fault_injection``: TEST ONLY, honour the fault tags of ``faults.py`` in request ids.
    ``kv_events``: record what the prefix cache stores and evicts in ``self.kv_events`` (a
    ``KVEventLog`` someone must drain; None without it).
    """

    def __init__(self, config: EngineConfig | None = None, *, weights=None,
                 fault_injection: bool = False, kv_events: bool = False) -> None:
        self.config = config = config or EngineConfig()
        t0 = time.perf_counter()
        by_utilization = (torch.device(config.device).type == "cuda"
                          and not config.num_kv_blocks and config.kv_cache_memory_gib is None)
        free_at_start = torch.cuda.mem_get_info(config.device)[0] if by_utilization else None
        model, self.precision = build_model(config.model, config.dtype, config.quantization,
                                            config.device, weights)
        self.model_config: ModelConfig = (model_config := model.config)
        self.weight_bytes = resident_weight_bytes(model)
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.precision, config.device,
                                       getattr(model, "fused_forward", None) is not None)
        self.layout = KVCacheLayout.of(model_config, config.block_size, dtype)
        num_blocks = self._num_kv_blocks(model, free_at_start)
        kv_shape = (self.layout.num_layers, 2, num_blocks, config.block_size,
                    self.layout.num_kv_heads, self.layout.head_dim)
        self.kv_cache = zeroed_kv_cache(kv_shape, dtype, config.device)  # zero pages on first touch
        self.kv_events = KVEventLog() if kv_events else None
        self.block_manager = BlockManager(num_blocks, config.block_size, self.kv_events)
        self.scheduler = create_scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            config.scheduling_policy, config.enable_prefix_caching,
                            config.long_prefill_token_threshold or 0, config.queue_policy,
                            sliding_window=model_config.uniform_sliding_window,
                            mixed_sliding_window=model_config.mixed_sliding_window),
            self.block_manager,
        )
        # what a step costs, learned: decode rows and prompt tokens apart (heartbeat, time
        # budget, srpt's queue order), and over all scheduled tokens until that fit knows
        self.prompt_cost = PromptCostModel()
        self.step_cost = StepCostModel()
        threads = StepThreads(config.step_threads if config.device == "cpu" else "all",
                              torch.get_num_threads())  # CPU threads matter on CPU only
        matchers = Matchers(lambda: Tokenizer.load(config.model).backend.to_str(),
                            model_config.vocab_size, model_config.eos_token_id)
        self.runner = ModelRunner(model, self.kv_cache, config.block_size,
                                  self.scheduler.config.max_model_len, threads, matchers)
        if self.kv_cache.is_cuda and not config.enforce_eager:
            self.runner.graphs = CUDAGraphRunner(
                model, self.kv_cache, config.max_num_seqs,
                self.block_manager.blocks_needed(self.scheduler.config.max_model_len),
                max_prefill_tokens=config.max_num_batched_tokens)
        self.metrics = EngineMetrics(max_model_len=self.max_model_len)
        self._faults = EngineFaults() if fault_injection else None
        self._prompt_logprobs: dict[str, list] = {}  # request id -> prompt logprobs so far
        self._steps_lost_all = 0  # failed steps in a row whose every request failed alone
        self.async_scheduling = _async_scheduling(config, self.kv_cache.is_cuda, self._faults)
        self._ahead: tuple[SchedulerOutput, PendingStep] | None = None  # launched, not collected
        log.info("engine ready in %.1fs: %d KV blocks of %d tokens (%s), max_model_len %d",
                 time.perf_counter() - t0, num_blocks, config.block_size, self.layout.dtype,
                 self.max_model_len)

    def _num_kv_blocks(self, model, free_at_start: int | None) -> int:
        """KV blocks of ``self.layout`` for this worker: ``num_kv_blocks`` when set; on a GPU
        without a size, what ``gpu_memory_utilization`` leaves after a profiling step
        (``free_at_start``: the device's free bytes before the model loaded; ``kv_sizing``);
        else ``kv_cache_memory_gib`` (1 GiB by default)."""
        config = self.config
        per_block = self.layout.block_bytes * 2 * self.layout.num_layers  # bytes, K and V
        if config.num_kv_blocks:
            return config.num_kv_blocks
        if free_at_start is None:
            return kv_sizing.blocks_for_memory(
                config.kv_cache_memory_gib or kv_sizing.CPU_DEFAULT_GIB, per_block)
        step_tokens = min(config.max_num_batched_tokens, self.max_model_len)
        memory = kv_sizing.measure_gpu(model, config.block_size, step_tokens,
                                       config.max_num_seqs, free_at_start)
        log.info("KV cache sized by gpu_memory_utilization %.2f: %s", config.gpu_memory_utilization,
                 memory)
        return kv_sizing.gpu_kv_cache_bytes(memory, config.gpu_memory_utilization) // per_block

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
        self.metrics = EngineMetrics(max_model_len=self.max_model_len)
        self.step_cost = StepCostModel()  # first calls cost more than serving steps do
        self.prompt_cost = PromptCostModel()
        return time.perf_counter() - t0

    # -- requests ----------------------------------------------------------------------------
    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        *, hold_kv: bool = False,
    ) -> Request:
        """Validate and build a request. Raises ``ValueError`` naming the offending field."""
        if not prompt_token_ids:
            raise InvalidArgument("prompt", "must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidArgument("prompt", f"{len(prompt_token_ids)} tokens leave no room for output "
                                  f"within the context length of {self.max_model_len} tokens")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidArgument("prompt_token_ids", f"ids must be in [0, {vocab})")
        if self.block_manager.blocks_needed(len(prompt_token_ids) + 1) > self.block_manager.num_blocks:
            raise InvalidArgument("prompt", f"{len(prompt_token_ids)} tokens exceed this worker's KV cache")
        if params.num_prior_output_tokens >= len(prompt_token_ids):
            raise InvalidArgument("num_prior_output_tokens", f"{params.num_prior_output_tokens} must be "
                                  f"below the prompt's {len(prompt_token_ids)} tokens")
        if request_id in self.scheduler.requests:
            raise InvalidArgument("request_id", f"{request_id!r} is already in use")
        self.check_params(params)
        cfg = self.model_config
        more_eos = [t for t in cfg.eos_token_ids if t != cfg.eos_token_id]
        if more_eos and not params.ignore_eos:  # stop ids, as vLLM adds generation_config's
            params = params.model_copy(update={"stop_token_ids": tuple(dict.fromkeys(
                [*params.stop_token_ids, *more_eos]))})
        return Request(request_id, list(prompt_token_ids), params,
                       eos_token_id=cfg.eos_token_id, hold_kv_on_finish=hold_kv)

    def check_params(self, params: SamplingParams) -> None:
        """Check what ``SamplingParams`` cannot know alone: token ids within this model's
        vocabulary. Raises ``ValueError`` naming the field."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument("stop_token_ids", f"{bad[:5]} outside the vocabulary [0, {vocab})")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument("logit_bias", f"token ids {bad[:5]} outside the vocabulary [0, {vocab})")

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ``ValueError`` naming a field the model cannot serve."""
        self.check_params(request.sampling_params)
        self.scheduler.add_request(request)

    def reserve(self, request: Request) -> bool:
        """Decode role: reserve blocks for the prompt's KV; False when too few are free.
        Raises ``ValueError`` naming a field the model cannot serve."""
        self.check_params(request.sampling_params)
        if self._ahead is not None:
            # another process writes the reserved blocks (CUDA IPC), unordered with this one's
            # stream, and a block freed since the step ahead was launched may still take one
            # slot of that step's K/V (a request that stopped or was aborted meanwhile)
            self._ahead[1].wait()
        return self.scheduler.reserve(request)

    def finish_remote_prefill(self, request_id: str, first_token_id: int,
                              logprobs: TokenLogprobs | None = None) -> RequestOutput | None:
        """Decode role: the prompt's KV has landed; admit the request with its first token
        (and its logprobs, computed by the prefill worker)."""
        request = self.scheduler.requests.get(request_id)
        output = self.scheduler.finish_remote_prefill(request_id, first_token_id)
        if output is None:
            return None
        self.metrics.requests.on_remote_first_token(request, time.monotonic())
        if logprobs is not None and output.new_token_ids:  # a scored prompt keeps no token
            output.logprobs = [logprobs]
        return output

    def prefill_locally(self, request_id: str) -> bool:
        """Decode role: a reservation's KV will not arrive (failed or timed-out transfer), and no
        write into its blocks is in flight any more; compute the prompt here instead, in the
        blocks already reserved (``num_computed_tokens`` stays 0, so the scheduler schedules the
        whole prompt after the prefix it found cached here, and samples the first token). False
        unless the request is waiting for KV."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_KV:
            return False
        request.status = RequestStatus.WAITING
        # the prefix found in this worker's cache at reservation is pinned and holds its KV
        request.num_computed_tokens = max(request.num_cached_tokens, 0)
        self.scheduler.add_request(request)
        return True

    def abort(self, request_id: str) -> bool:
        """Finish a request in any state and free its blocks. False if unknown."""
        if self._faults is not None:
            self._faults.forget(request_id)
        self._prompt_logprobs.pop(request_id, None)
        request = self.scheduler.requests.get(request_id)
        if not self.scheduler.abort(request_id):
            return False
        if request is not None and request.status == RequestStatus.FINISHED_ABORTED:
            self.metrics.requests.on_finish(request, time.monotonic())
        return True

    def release(self, request_id: str) -> None:
        """Prefill role: free a finished request's blocks once its KV has been sent."""
        self.scheduler.release(request_id)

    # -- stepping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self._ahead is not None or self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model once, sample, update. Finished requests are
        evicted and their blocks freed (unless held) before this returns; requests the step
        failed alone come first, with ``error`` set. Raises ``EngineDeadError`` (or what the
        scheduler raised) when the engine cannot continue; see the module docstring."""
        t0 = time.perf_counter()
        self.scheduler.seconds_per_token = self.seconds_per_prompt_token or None
        if self.config.max_step_ms:
            self._set_step_budget(self.config.max_step_ms / 1000)
        if self._ahead is not None:  # launched by the previous call: collect it
            (out, launched), self._ahead = self._ahead, None
            result, failed = self._collect(out, launched)
        else:
            out = self.metrics.timed("schedule", self.scheduler.schedule)
            if not out.scheduled:
                self.runner.input_batch.remove(out.finished_req_ids)
                return []
            result, failed = self._execute(out)
        if self._faults is not None:
            self._faults.after_execute(out)
        outputs = self.metrics.timed("postprocess", self._update, out, result)
        if self._ahead is not None:
            self._forget_finished()
        self.metrics.record_step(out, self.scheduler, outputs)
        seconds, tokens = time.perf_counter() - t0, list(out.num_scheduled_tokens.values())
        total, rows = sum(tokens), tokens.count(1)  # rows: decode rows (InputBatch's test too)
        self.step_cost.observe(total, seconds)
        self.prompt_cost.observe(rows, total - rows, seconds)
        return failed + outputs

    def _set_step_budget(self, max_step_s: float) -> None:
        """The scheduler's prompt-token budget for a step of at most ``max_step_s`` seconds: by
        the fit of decode rows and prompt tokens apart once it knows, by the fit over all
        scheduled tokens (a row costing one token) until then."""
        budget = self.prompt_cost.token_budget(max_step_s)
        if budget is None:
            budget = self.step_cost.token_budget(max_step_s), 1.0
        self.scheduler.step_token_budget, self.scheduler.decode_row_tokens = budget

    def _forget_finished(self) -> None:
        """Free the batch rows of finished requests while steps run ahead: ``schedule()``, which
        frees them otherwise, does not run while the chain lasts (a decode worker's can last as
        long as its load). A row the step in flight still writes waits for a later call."""
        s = self.scheduler
        if not s.finished_req_ids:  # most steps: nothing finished
            return
        done = s.finished_req_ids - {r.request_id for r in self._ahead[0].scheduled}
        if done:
            self.runner.input_batch.remove(done)
            s.finished_req_ids -= done

    def _run_model(self, out: SchedulerOutput):
        if self._faults is not None:
            self._faults.before_execute(out)
        return self.runner.execute(out, self.metrics.timed)

    def _execute(self, out: SchedulerOutput) -> tuple[StepResult, list[RequestOutput]]:
        """``runner.execute`` (with async scheduling ``runner.launch``, then ``_collect``), or on
        failure each request alone: (its result, the failed)."""
        try:
            if self.async_scheduling:
                result = self.runner.launch(out, self.metrics.timed)
                if isinstance(result, PendingStep):
                    return self._collect(out, result)
            else:
                result = self._run_model(out)
        except Exception as exc:  # noqa: BLE001 - attributed below, or re-raised as the engine's
            return self._execute_alone(out, exc)
        self._steps_lost_all = 0
        return result, []

    def _collect(self, out: SchedulerOutput, launched: PendingStep,
                 ) -> tuple[StepResult, list[RequestOutput]]:
        """Launch the step after ``launched`` when it may run ahead (``_launch_ahead``), then wait
        for ``launched``'s tokens: the device computes the next step while this thread updates
        the scheduler and serves the tokens."""
        self._ahead = self._launch_ahead(out, launched)
        try:
            result = self.runner.collect(launched, self.metrics.timed)
        except Exception as exc:  # noqa: BLE001 - as in _execute; the step ahead is dropped
            self._ahead = None
            return self._execute_alone(out, exc)
        self._steps_lost_all = 0
        return result, []

    def _launch_ahead(self, out: SchedulerOutput, launched: PendingStep,
                      ) -> tuple[SchedulerOutput, PendingStep] | None:
        """Async scheduling (vLLM's ``--async-scheduling``): the next decode step of
        ``launched``'s requests, launched before its tokens are known, its input tokens
        ``launched``'s samples on the device; requests admitted since with their first token
        (a remote prefill's: ``Scheduler.admit_decoding``) join it, their input token from the
        host. Not while a request waits to compute a prompt that the next ``schedule()`` would
        start (it would otherwise wait behind a chain of such steps); while the batch is full
        (``max_num_seqs`` running) and stays full, no waiting request can start, so the chain
        goes on (a server under more load than its batch: every step one at a time otherwise).
        A request whose next token ends it by length is left out (its room goes to a waiting
        one at the next ``schedule()``), and one that ends by a stop token computes one token
        more, which ``update_from_output`` drops (it skips finished requests; a waiting request
        starts a step later). None when no step can go ahead (or blocks for it are short)."""
        s = self.scheduler
        full = len(s.running) >= s.config.max_num_seqs
        if s.waiting and not full and not s.admit_decoding():
            return None
        keep = self.runner.input_batch.steps_ahead(launched.inputs.rows, out.scheduled)
        nxt = out.scheduled if len(keep) == len(out.scheduled) else [out.scheduled[i] for i in keep]
        if s.waiting and len(nxt) < s.config.max_num_seqs:
            return None  # room frees: a waiting request starts at the next schedule()
        extra = set(s.running).difference(out.scheduled)  # in C: usually none
        admitted = [r for r in s.running if r in extra] if extra else []  # in running's order
        if not all(r.only_decodes for r in admitted):
            return None  # a prompt still to compute: the next step is scheduled as usual
        # blocks for the token after the one computing now (the scheduler's counters lag by
        # it), and for the admitted ones' next token (admit_decoding's: no new block)
        bm = self.block_manager
        if not nxt or not (bm.allocate_each(nxt, 2) and bm.allocate_each(admitted, 1)):
            return None
        scheduled = nxt + admitted
        ahead = SchedulerOutput(scheduled, dict.fromkeys(map(request_id_of, scheduled), 1))
        try:
            step = self.runner.launch_ahead(ahead, launched, keep, self.metrics.timed)
            return (ahead, step) if step is not None else None
        except Exception as exc:  # noqa: BLE001 - the step runs the usual way instead
            log.warning("async scheduling: the step ahead failed to launch (%s: %s)",
                        type(exc).__name__, exc)
            return None

    def _execute_alone(self, out: SchedulerOutput, exc: Exception):
        n = len(out.scheduled)
        log.warning("engine step of %d requests failed (%s: %s); running each alone",
                    n, type(exc).__name__, exc)
        result = StepResult([None] * n, [None] * n, {})
        failed: list[RequestOutput] = []
        for i, request in enumerate(out.scheduled):
            alone = SchedulerOutput([request], {request.request_id:
                                                out.num_scheduled_tokens[request.request_id]})
            try:
                one = self._run_model(alone)
                result.sampled[i], result.logprobs[i] = one.sampled[0], one.logprobs[0]
                if 0 in one.prompt_logprobs:
                    result.prompt_logprobs[i] = one.prompt_logprobs[0]
            except Exception as cause:  # noqa: BLE001 - this request's own failure
                if request.is_padding:
                    raise EngineDeadError(f"a static batch's padding row failed: {cause}") from cause
                failed.append(self._fail(request, cause))
        self._steps_lost_all = self._steps_lost_all + 1 if len(failed) == n else 0
        if len(failed) == n and (n > 1 or self._steps_lost_all >= MAX_STEPS_LOST_ALL):
            raise EngineDeadError(f"engine step failed for every request, alone too: "
                                  f"{type(exc).__name__}: {exc}") from exc
        return result, failed

    def _fail(self, request: Request, cause: Exception) -> RequestOutput:
        """Abort ``request`` (blocks freed) because running it raises ``cause``."""
        error = f"{type(cause).__name__}: {cause}"
        log.error("request %s failed in the engine: %s", request.request_id, error, exc_info=cause)
        self.abort(request.request_id)
        return RequestOutput(request.request_id, [], "abort", request.num_prompt_tokens,
                             len(request.output_token_ids), error=error)

    def _update(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        for i, chunk in result.prompt_logprobs.items():  # [None]: the first token has none
            self._prompt_logprobs.setdefault(out.scheduled[i].request_id, [None]).extend(chunk)
        outputs = self.scheduler.update_from_output(out, result.sampled, result.stop_checks)
        if result.logprobs.count(None) == len(result.logprobs) and not self._prompt_logprobs:
            return outputs  # most steps: nobody asked for logprobs
        by_id = {r.request_id: lp for r, lp in zip(out.scheduled, result.logprobs) if lp is not None}
        for o in outputs:
            if o.request_id in by_id:
                o.logprobs = [by_id[o.request_id]]
            if o.request_id in self._prompt_logprobs:  # the request's first output: its prompt is done
                o.prompt_logprobs = self._prompt_logprobs.pop(o.request_id)
        return outputs

    def load(self) -> dict[str, int | float]:
        """Load figures for the worker registry (plain reads: safe from another thread):
        KV blocks, requests running and waiting, uncomputed prompt tokens queued or
        prefilling, the block size, and the measured seconds a prompt token adds to a step
        (``seconds_per_prompt_token``; until prompts of different lengths ran, an overestimate
        on a decode worker)."""
        bm, s = self.block_manager, self.scheduler
        return {"free_kv_blocks": bm.num_free_blocks, "total_kv_blocks": bm.num_blocks,
                "num_running": len(s.running), "num_waiting": s.num_waiting,
                "num_prefill_tokens": s.num_prefill_tokens, "block_size": bm.block_size,
                "prefill_seconds_per_token": self.seconds_per_prompt_token}

    @property
    def seconds_per_prompt_token(self) -> float:
        """Seconds one more prompt token adds to a step (``PromptCostModel``); until prompts of
        different lengths ran, the seconds per scheduled token, decode rows and prompt tokens
        alike; 0.0 while neither is known."""
        return self.prompt_cost.seconds_per_prompt_token or self.step_cost.seconds_per_token

