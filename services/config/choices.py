"""The closed choices of the settings tree (``services/config/settings.py``): each an enum whose values
are what a flag, environment variable or config file may say."""
from __future__ import annotations

from enum import Enum


class Device(str, Enum):
    """Torch device of a worker's model and KV cache."""
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    """Model and KV cache dtype (float32: the exact oracle mode; bfloat16 on GPUs and on CPUs
    that compute it natively; auto: the fastest the machine supports)."""
    float32 = "float32"
    bfloat16 = "bfloat16"
    auto = "auto"


class Quantization(str, Enum):
    """Linear layers: dense (none), or run on a GGUF weight format as stored (auto: the file's;
    f32 is the file's float rows run by the same kernels, not a quantization)."""
    none = "none"
    auto = "auto"
    q4_0 = "q4_0"
    q4_1 = "q4_1"
    q8_0 = "q8_0"
    f32 = "f32"


class KVTransportKind(str, Enum):
    """KV transfer backend: a pure-Python TCP path, or NIXL over UCX."""
    tcp = "tcp"
    nixl = "nixl"


class KVFailurePolicy(str, Enum):
    """When a prompt's KV transfer fails: the decode worker recomputes it, or the request fails."""
    recompute = "recompute"
    fail = "fail"


class Routing(str, Enum):
    """How the gateway picks workers: in random order, by load alone, or by cost (the prompt
    blocks a worker would compute, weighted, plus its load: KV-aware)."""
    random = "random"
    load = "load"
    kv = "kv"


class QueuePolicy(str, Enum):
    """Admission order of a worker's waiting requests: arrival, or least work left first with
    aging (shortest remaining processing time; no request starves)."""
    fcfs = "fcfs"
    srpt = "srpt"


class Layout(str, Enum):
    """Workers `tandem up` starts: auto (chosen for the machine's cores, logged), prefill and
    decode workers with KV transfer (disaggregated), or workers that do both (unified)."""
    auto = "auto"
    disaggregated = "disaggregated"
    unified = "unified"


class LogLevel(str, Enum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"

    @classmethod
    def _missing_(cls, value: object) -> LogLevel | None:  # accept "info", "debug", ...
        return cls.__members__.get(str(value).upper())


class LogFormat(str, Enum):
    """Log lines: text for a terminal, json (one object per line) for a log collector."""
    text = "text"
    json = "json"
