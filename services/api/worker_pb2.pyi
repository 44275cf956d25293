from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVFailurePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_FAILURE_POLICY_UNSPECIFIED: _ClassVar[KVFailurePolicy]
    KV_FAILURE_POLICY_RECOMPUTE: _ClassVar[KVFailurePolicy]
    KV_FAILURE_POLICY_FAIL: _ClassVar[KVFailurePolicy]
KV_FAILURE_POLICY_UNSPECIFIED: KVFailurePolicy
KV_FAILURE_POLICY_RECOMPUTE: KVFailurePolicy
KV_FAILURE_POLICY_FAIL: KVFailurePolicy

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "num_prior_output_tokens", "structured_output", "logit_bias", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    num_prior_output_tokens: int
    structured_output: StructuredOutput
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., num_prior_output_tokens: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("format", "spec")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    format: str
    spec: str
    def __init__(self, format: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class SampledLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "local_prefill", "kv_failure_policy", "follower_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    local_prefill: bool
    kv_failure_policy: KVFailurePolicy
    follower_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., kv_failure_policy: _Optional[_Union[KVFailurePolicy, str]] = ..., follower_id: _Optional[str] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("follower_id",)
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    follower_id: str
    def __init__(self, follower_id: _Optional[str] = ...) -> None: ...

class FollowResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DecodeResponse]
    def __init__(self, updates: _Optional[_Iterable[_Union[DecodeResponse, _Mapping]]] = ...) -> None: ...

class KVReservation(_message.Message):
    __slots__ = ("worker_id", "transport", "transport_metadata", "block_ids", "lease_s", "write_token", "num_cached_blocks", "num_skipped_blocks", "num_partial_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    WRITE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTIAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    transport: str
    transport_metadata: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_s: float
    write_token: bytes
    num_cached_blocks: int
    num_skipped_blocks: int
    num_partial_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., transport: _Optional[str] = ..., transport_metadata: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., lease_s: _Optional[float] = ..., write_token: _Optional[bytes] = ..., num_cached_blocks: _Optional[int] = ..., num_skipped_blocks: _Optional[int] = ..., num_partial_blocks: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("reservation", "token_ids", "finish_reason", "num_output_tokens", "logprobs", "kv_recomputed", "num_cached_tokens", "prompt_logprobs", "request_id")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    reservation: KVReservation
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    num_output_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[SampledLogprobs]
    kv_recomputed: str
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[SampledLogprobs]
    request_id: str
    def __init__(self, reservation: _Optional[_Union[KVReservation, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., num_output_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[SampledLogprobs, _Mapping]]] = ..., kv_recomputed: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[SampledLogprobs, _Mapping]]] = ..., request_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "destination")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    destination: KVReservation
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., destination: _Optional[_Union[KVReservation, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("worker_id", "first_token_id", "queue_time_s", "compute_time_s", "transfer_time_s", "num_cached_tokens", "prompt_logprobs")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIME_S_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    first_token_id: int
    queue_time_s: float
    compute_time_s: float
    transfer_time_s: float
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[SampledLogprobs]
    def __init__(self, worker_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., queue_time_s: _Optional[float] = ..., compute_time_s: _Optional[float] = ..., transfer_time_s: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[SampledLogprobs, _Mapping]]] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id", "reservation_unused")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_UNUSED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_unused: bool
    def __init__(self, request_id: _Optional[str] = ..., reservation_unused: _Optional[bool] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "role", "free_kv_blocks", "total_kv_blocks", "num_running", "num_waiting", "requests", "max_num_queued", "max_used_kv_blocks", "closed_reservations", "num_prefill_tokens", "block_size", "prefill_seconds_per_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    free_kv_blocks: int
    total_kv_blocks: int
    num_running: int
    num_waiting: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestLoad]
    max_num_queued: int
    max_used_kv_blocks: int
    closed_reservations: _containers.RepeatedCompositeFieldContainer[ClosedReservation]
    num_prefill_tokens: int
    block_size: int
    prefill_seconds_per_token: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestLoad, _Mapping]]] = ..., max_num_queued: _Optional[int] = ..., max_used_kv_blocks: _Optional[int] = ..., closed_reservations: _Optional[_Iterable[_Union[ClosedReservation, _Mapping]]] = ..., num_prefill_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., prefill_seconds_per_token: _Optional[float] = ...) -> None: ...

class RequestLoad(_message.Message):
    __slots__ = ("request_id", "stage", "num_prompt_tokens", "num_computed_tokens", "num_kv_blocks", "num_preemptions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stage: str
    num_prompt_tokens: int
    num_computed_tokens: int
    num_kv_blocks: int
    num_preemptions: int
    def __init__(self, request_id: _Optional[str] = ..., stage: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ...) -> None: ...

class ClosedReservation(_message.Message):
    __slots__ = ("request_id", "outcome", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outcome: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
