"""``EngineConfig``: the engine's knobs, in a module that imports no torch.

The settings tree (``services/config/settings.py``) is read by every process, the gateway and
``tandem up``'s own process included; those never run the engine and must not pay
``import torch`` (about 3 CPU s) to parse their settings. ``services.engine.engine``
re-exports this class.
"""
from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from .model_files import default_model_path

# admission orders the scheduler implements (scheduler.py); the settings' QueuePolicy names the same
QueuePolicyName = Literal["fcfs", "srpt"]
QUEUE_POLICIES: tuple[str, ...] = get_args(QueuePolicyName)


class EngineConfig(BaseModel):
    """Engine knobs; validated, a bad value raises ``ValueError`` naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(default_factory=lambda: str(default_model_path()))  # .gguf or HF dir
    dtype: str = "float32"  # float32 | bfloat16 | auto
    quantization: str = "none"  # none | auto | q4_0 | q4_1 | q8_0 | f32 (engine.quantized)
    device: str = "cpu"
    block_size: int = Field(default=16, gt=0)  # tokens per KV block
    num_kv_blocks: int | None = Field(default=None, gt=0)  # overrides kv_cache_memory_gib
    # None: 1 GiB on CPU; on a GPU what gpu_memory_utilization leaves (kv_sizing.py)
    kv_cache_memory_gib: float | None = Field(default=None, gt=0)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)  # this worker's GPU share
    # the KV cache's element type (engine.resolve_kv_cache_dtype): auto is float16 where the
    # fused C forward pass runs Q4_0/Q4_1/Q8_0 linears on the CPU, else the model's dtype
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    max_model_len: int | None = Field(default=None, gt=1)  # default: the model's context
    scheduling_policy: Literal["continuous", "static"] = "continuous"
    enable_prefix_caching: bool = True
    # tokens one prompt chunk may take per step while others wait (scheduler.py); 0: no cap;
    # None: the role's default (a prefill worker caps, see services/runtime/serve.py; otherwise none)
    long_prefill_token_threshold: int | None = Field(default=None, ge=0)
    # threads of a step: "all" (torch's thread count, every step) or "auto" (timed while
    # serving per step size, one thread or all: see step_threads.py)
    step_threads: Literal["auto", "all"] = "all"
    # admission order of waiting requests (scheduler.py): "fcfs", or "srpt" (least work left
    # first, aged so that none starves)
    queue_policy: QueuePolicyName = "fcfs"
    # a step that carries running streams computes only as many prompt tokens as fit this
    # many milliseconds by the measured step cost (step_cost.py); None or 0: no time budget
    max_step_ms: float | None = Field(default=None, ge=0)
    # CUDA: run every step eagerly instead of replaying CUDA graphs (decode, prefill and
    # mixed steps; cuda_graphs.py)
    enforce_eager: bool = False
    # launch a decode step before the previous one's tokens reach the host (engine.py's
    # _launch_ahead, vLLM's async scheduling); None: where the KV cache is on a GPU
    async_scheduling: bool | None = None
