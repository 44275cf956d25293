"""Request state in Redis: one hash `request:{id}` per request, expiring after it finishes.

The gateway creates the entry (QUEUED) and moves it through PREFILLING → DECODING → one of the
terminal states FINISHED / ABORTED / FAILED. Terminal states are final: a late transition (for
instance a DECODING from a slow worker after the client aborted) is refused, so the record
never goes back to life. Every write is one round-trip and atomic (a small Lua script), and
never creates a partial hash for an unknown request id.
"""

from __future__ import annotations

import time
from enum import StrEnum, auto
from typing import Any

import redis.asyncio as aioredis


class RequestState(StrEnum):
    QUEUED = auto()
    PREFILLING = auto()
    DECODING = auto()
    FINISHED = auto()
    ABORTED = auto()
    FAILED = auto()

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})

# Every field of `request:{id}` and its Python type; timestamps are float unix seconds.
FIELD_TYPES: dict[str, type] = {
    "status": RequestState,
    "model": str,
    "key_id": str,               # short hash of the API key that created it (never the key)
    "prompt_tokens": int,
    "output_tokens": int,
    "prefill_worker": str,       # worker id
    "decode_worker": str,        # worker id
    "arrival_time": float,
    "prefill_start_time": float,
    "prefill_end_time": float,
    "prefill_queue_time": float,   # seconds in the prefill worker's queue (its report)
    "prefill_compute_time": float,  # seconds from first scheduled to first token (its report)
    "kv_transfer_time": float,     # seconds writing the KV to the decode worker (its report)
    "first_token_time": float,
    "finish_time": float,
    "finish_reason": str,
    "error": str,
}

# KEYS[1] = request key. ARGV = mode, ttl_ms (0: none), then field/value pairs, then "--" and
# fields to delete. Modes: "create" (fails if the key exists), "transition" (fails on an unknown
# key; refused if the stored status is terminal), "update" (fails on an unknown key).
# Returns 1 when written, 0 for an unknown key (create: an existing key), -1 when refused.
_WRITE_SCRIPT = """
local TERMINAL = {%s}
local mode, ttl_ms = ARGV[1], tonumber(ARGV[2])
local exists = redis.call('EXISTS', KEYS[1]) == 1
if mode == 'create' then
  if exists then return 0 end
elseif not exists then
  return 0
elseif mode == 'transition' then
  local status = redis.call('HGET', KEYS[1], 'status')
  if TERMINAL[status] then return -1 end
end
local i = 3
local sets = {}
while ARGV[i] ~= '--' do
  sets[#sets + 1] = ARGV[i]
  sets[#sets + 1] = ARGV[i + 1]
  i = i + 2
end
if #sets > 0 then redis.call('HSET', KEYS[1], unpack(sets)) end
if i < #ARGV then redis.call('HDEL', KEYS[1], unpack(ARGV, i + 1)) end
if ttl_ms > 0 then redis.call('PEXPIRE', KEYS[1], ttl_ms) end
return 1
""" % ", ".join(f"['{state.value}'] = true" for state in sorted(_TERMINAL))


class RequestStateStore:
    """Reads and writes `request:{id}` hashes through a `redis.asyncio.Redis` client.

    `ttl_s` (seconds, > 0) is how long a request's record lives after it reaches a terminal
    state. The client may or may not use `decode_responses`; both work.

    Raises:
        ValueError: `ttl_s` is not positive.
    """

    def __init__(self, redis: aioredis.Redis, ttl_s: float = 3600.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        self.redis = redis
        self.ttl_s = ttl_s
        self._write = redis.register_script(_WRITE_SCRIPT)

    @staticmethod
    def key(request_id: str) -> str:
        return f"request:{request_id}"

    async def create(self, request_id: str, *, prompt_tokens: int, model: str,
                     arrival_time: float | None = None, key_id: str = "") -> None:
        """Record a new request as QUEUED with `output_tokens` 0.

        `arrival_time` is unix seconds (default: now); `key_id` the API key's id, if any.

        Raises:
            KeyError: a request with this id already exists.
            ValueError: a value has the wrong type.
        """
        fields = {"status": RequestState.QUEUED, "prompt_tokens": prompt_tokens,
                  "output_tokens": 0, "model": model,
                  "arrival_time": time.time() if arrival_time is None else arrival_time}
        if key_id:
            fields["key_id"] = key_id
        if await self._run("create", request_id, fields, ttl_s=None) == 0:
            raise KeyError(f"request {request_id!r} already exists")

    async def transition(self, request_id: str, status: RequestState | str,
                         **fields: Any) -> bool:
        """Set `status` and `fields` together in one atomic round-trip.

        A terminal `status` (FINISHED/ABORTED/FAILED) also sets `finish_time` (unix seconds;
        now unless given) and makes the record expire after `ttl_s` seconds. A field given as
        None is removed from the record.

        Returns:
            True when written; False when the request was already terminal (nothing written).
        Raises:
            KeyError: no request with this id (never created, or expired).
            ValueError: unknown status, unknown field name, or a value of the wrong type.
        """
        status = _parse_status(status)
        fields = {**fields, "status": status}
        ttl_s = None
        if status.is_terminal:
            fields.setdefault("finish_time", time.time())
            ttl_s = self.ttl_s
        result = await self._run("transition", request_id, fields, ttl_s=ttl_s)
        if result == 0:
            raise KeyError(f"request {request_id!r} does not exist")
        return result == 1

    async def update(self, request_id: str, **fields: Any) -> None:
        """Set `fields` (not `status`: use `transition`); a field given as None is removed.

        Raises:
            KeyError: no request with this id.
            ValueError: `status` given, unknown field name, or a value of the wrong type.
        """
        if "status" in fields:
            raise ValueError("update() cannot set 'status'; use transition()")
        if not fields:
            return
        if await self._run("update", request_id, fields, ttl_s=None) == 0:
            raise KeyError(f"request {request_id!r} does not exist")

    async def get(self, request_id: str) -> dict[str, Any] | None:
        """The request's fields decoded to Python types (`status` as RequestState, counts as
        int, timestamps as float seconds, the rest str); fields never set are absent. None
        when the request does not exist (or has expired). Unknown stored fields are skipped.
        """
        raw = await self.redis.hgetall(self.key(request_id))
        if not raw:
            return None
        record: dict[str, Any] = {}
        for name, value in raw.items():
            name = _text(name)
            kind = FIELD_TYPES.get(name)
            if kind is not None:
                record[name] = kind(_text(value))
        return record

    async def _run(self, mode: str, request_id: str, fields: dict[str, Any],
                   ttl_s: float | None) -> int:
        to_set, to_delete = _encode(fields)
        ttl_ms = 0 if ttl_s is None else max(1, int(ttl_s * 1000))
        args = [mode, ttl_ms, *to_set, "--", *to_delete]
        return int(await self._write(keys=[self.key(request_id)], args=args))


def _parse_status(status: RequestState | str) -> RequestState:
    try:
        return RequestState(status)
    except ValueError:
        valid = ", ".join(s.value for s in RequestState)
        raise ValueError(f"status: unknown request state {status!r} (valid: {valid})") from None


def _encode(fields: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Validate names and types; return flat [name, value, ...] to set and names to delete."""
    to_set: list[str] = []
    to_delete: list[str] = []
    for name, value in fields.items():
        kind = FIELD_TYPES.get(name)
        if kind is None:
            raise ValueError(f"unknown request field {name!r} (valid: {', '.join(FIELD_TYPES)})")
        if value is None:
            if name == "status":
                raise ValueError("status cannot be removed")
            to_delete.append(name)
            continue
        to_set += [name, _encode_value(name, kind, value)]
    return to_set, to_delete


def _encode_value(name: str, kind: type, value: Any) -> str:
    if kind is RequestState:
        return _parse_status(value).value
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    if kind is str and isinstance(value, str):
        return value
    raise ValueError(f"{name} must be {kind.__name__}, got {type(value).__name__} {value!r}")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
