"""Per-API-key limits at the gateway: requests per second, tokens per minute (token buckets)
and requests open at once (streams). Each is off at 0, the default.

Per key means per key id (``services/gateway/keys.py``); an open gateway (no keys) has one
anonymous key id, so its limits are shared by every client. Memory is bounded by the number of
configured keys: only authenticated key ids get a bucket.

- requests/s: a bucket of ``requests_per_s`` requests (at least one), refilled at that rate,
  taken before the request is validated or tokenized.
- tokens/min: a bucket of ``tokens_per_min`` tokens refilled at ``tokens_per_min / 60`` per
  second; a request takes ``prompt + max_tokens`` once its prompt is tokenized and gives back
  what it did not use when it ends (prompt + generated tokens is what it cost). A request larger
  than the whole bucket is admitted when the bucket is full, leaving it in debt, so no request
  is refused forever.
- streams: at most ``max_streams`` requests of a key in flight (gRPC streams, HTTP requests
  streaming or not); the next gets RESOURCE_EXHAUSTED / 429 until one ends.

Refusals raise ``RateLimited`` (a ``ResourceExhausted``: gRPC RESOURCE_EXHAUSTED, HTTP 429)
naming the setting, with ``retry_after_s`` (whole seconds, for HTTP's ``Retry-After``).
Token bucket: the classic traffic-shaping algorithm (e.g. Tanenbaum, Computer Networks, 5.4.3).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.errors import ResourceExhausted


class RateLimited(ResourceExhausted):
    """A key is over one of its limits; ``retry_after_s``: whole seconds until it may pass."""

    code = "rate_limit_exceeded"  # the error code OpenAI's API answers a 429 with

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class KeyLimits:
    requests_per_s: float = 0.0  # 0: off
    tokens_per_min: int = 0      # 0: off
    max_streams: int = 0         # 0: off

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "tokens_per_min", "max_streams"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a finite number >= 0, got {value}")


class TokenBucket:
    """``capacity`` units, refilled continuously at ``rate`` units per second up to capacity.

    ``clock`` returns seconds (monotonic); injected so tests need no sleeping."""

    def __init__(self, capacity: float, rate: float, clock: Callable[[], float]) -> None:
        self.capacity, self.rate, self.clock = capacity, rate, clock
        self.level = capacity
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now

    def take(self, amount: float) -> float:
        """Take ``amount`` if the bucket holds it (or is full: a request larger than the bucket
        leaves it in debt); returns 0.0, or the seconds until it would hold it (nothing taken)."""
        self._refill()
        need = min(amount, self.capacity)
        if self.level >= need:
            self.level -= amount
            return 0.0
        return (need - self.level) / self.rate

    def give(self, amount: float) -> None:
        """Return ``amount`` units (a reservation not used), up to capacity."""
        self._refill()
        self.level = min(self.capacity, self.level + amount)


class KeyLimiter:
    """The limits of every key id: ``check_request`` on arrival, ``acquire`` at admission,
    ``Lease.release`` at the end. Single-threaded (the gateway's event loop)."""

    def __init__(self, limits: KeyLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        self.open_streams: dict[str, int] = {}

    def check_request(self, key_id: str, name: str = "") -> None:
        """Take one request from the key's requests/s bucket. Raises RateLimited."""
        rate = self.limits.requests_per_s
        if not rate:
            return
        bucket = self._requests.get(key_id)
        if bucket is None:
            bucket = self._requests[key_id] = TokenBucket(max(1.0, rate), rate, self.clock)
        wait = bucket.take(1)
        if wait:
            raise RateLimited(f"gateway.rate_limit_requests_per_s: {_who(key_id, name)} is over "
                              f"{rate:g} requests/s; retry in {_seconds(wait)} s", _seconds(wait))

    def acquire(self, key_id: str, tokens: int, name: str = "") -> Lease:
        """One stream place and ``tokens`` (prompt + max_tokens) of the key. Raises RateLimited
        (nothing taken). Release the lease when the request ends."""
        streams = self.open_streams.get(key_id, 0)
        cap = self.limits.max_streams
        if cap and streams >= cap:
            raise RateLimited(f"gateway.max_streams_per_key: {_who(key_id, name)} has {streams} "
                              f"requests open (the most allowed); retry when one ends", 1)
        per_min = self.limits.tokens_per_min
        if per_min:
            bucket = self._tokens.get(key_id)
            if bucket is None:
                bucket = self._tokens[key_id] = TokenBucket(per_min, per_min / 60.0, self.clock)
            wait = bucket.take(tokens)
            if wait:
                raise RateLimited(
                    f"gateway.rate_limit_tokens_per_min: {_who(key_id, name)} is over {per_min} "
                    f"tokens/min (this request needs {tokens}); retry in {_seconds(wait)} s",
                    _seconds(wait))
        self.open_streams[key_id] = streams + 1
        return Lease(self, key_id, tokens)

    def _release(self, key_id: str, unused_tokens: int) -> None:
        left = self.open_streams.get(key_id, 1) - 1
        if left > 0:
            self.open_streams[key_id] = left
        else:
            self.open_streams.pop(key_id, None)
        bucket = self._tokens.get(key_id)
        if bucket is not None and unused_tokens > 0:
            bucket.give(unused_tokens)


class Lease:
    """A request's stream place and reserved tokens; ``release`` once (later calls: no-op)."""

    def __init__(self, limiter: KeyLimiter, key_id: str, tokens: int) -> None:
        self._limiter, self.key_id, self.tokens = limiter, key_id, tokens
        self._released = False

    def release(self, used_tokens: int | None = None) -> None:
        """End the request: its stream place is freed and the tokens it reserved but did not
        use (``tokens - used_tokens``; None: none used) go back to the bucket."""
        if self._released:
            return
        self._released = True
        used = 0 if used_tokens is None else used_tokens
        self._limiter._release(self.key_id, self.tokens - used)


def _who(key_id: str, name: str) -> str:
    return "the anonymous key (no API keys configured)" if not key_id else f"key {name or key_id!r}"


def _seconds(wait: float) -> int:
    return max(1, math.ceil(wait))
