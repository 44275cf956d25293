"""Per-key limits (services/gateway/limits.py) on an injected clock: requests/s and tokens/min
token buckets with Retry-After, reconciliation with the tokens used, the streams cap, keys
kept apart, and everything off at 0."""
from __future__ import annotations

import json

import pytest

from services.gateway.limits import KeyLimiter, KeyLimits, RateLimited, TokenBucket
from services.errors import ResourceExhausted


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bucket_refills_at_its_rate_up_to_capacity():
    clock = Clock()
    bucket = TokenBucket(capacity=10, rate=2, clock=clock)
    assert bucket.take(10) == 0.0
    assert bucket.take(1) == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.take(1) == 0.0
    clock.now += 100
    bucket._refill()
    assert bucket.level == 10


def test_oversized_take_needs_a_full_bucket_and_leaves_debt():
    clock = Clock()
    bucket = TokenBucket(capacity=10, rate=1, clock=clock)
    assert bucket.take(25) == 0.0  # full: admitted, 15 in debt
    assert bucket.take(1) == pytest.approx(16.0)
    clock.now += 25
    assert bucket.take(25) == 0.0


def test_requests_per_s_second_immediate_request_gets_retry_after():
    clock = Clock()
    limiter = KeyLimiter(KeyLimits(requests_per_s=1), clock)
    limiter.check_request("k1")
    with pytest.raises(RateLimited) as info:
        limiter.check_request("k1", "team-a")
    assert isinstance(info.value, ResourceExhausted)  # RESOURCE_EXHAUSTED / HTTP 429
    assert info.value.retry_after_s == 1
    assert str(info.value).startswith("gateway.rate_limit_requests_per_s: key 'team-a'")
    limiter.check_request("k2")  # another key has its own bucket
    clock.now += 1.0
    limiter.check_request("k1")


def test_fractional_rate_retry_after_rounds_up():
    clock = Clock()
    limiter = KeyLimiter(KeyLimits(requests_per_s=0.25), clock)
    limiter.check_request("")
    with pytest.raises(RateLimited, match="anonymous") as info:
        limiter.check_request("")
    assert info.value.retry_after_s == 4


def test_tokens_per_min_and_reconciliation():
    clock = Clock()
    limiter = KeyLimiter(KeyLimits(tokens_per_min=600), clock)  # 10 tokens/s
    lease = limiter.acquire("k", 500)
    with pytest.raises(RateLimited, match="rate_limit_tokens_per_min") as info:
        limiter.acquire("k", 200)  # 100 left
    assert info.value.retry_after_s == 10
    lease.release(used_tokens=120)  # 380 unused come back: 480 left
    second = limiter.acquire("k", 450)
    second.release(used_tokens=450)
    lease.release(used_tokens=0)  # a second release changes nothing
    with pytest.raises(RateLimited):
        limiter.acquire("k", 100)


def test_refused_acquire_takes_nothing():
    clock = Clock()
    limiter = KeyLimiter(KeyLimits(tokens_per_min=60, max_streams=2), clock)
    limiter.acquire("k", 50)
    with pytest.raises(RateLimited, match="tokens_per_min"):
        limiter.acquire("k", 20)
    assert limiter.open_streams == {"k": 1}  # no stream place taken by the refusal
    limiter.acquire("k", 10)  # and no tokens: the 10 left are still there


def test_streams_cap_refuses_the_next_until_one_ends():
    limiter = KeyLimiter(KeyLimits(max_streams=2), Clock())
    a, b = limiter.acquire("k", 5), limiter.acquire("k", 5)
    with pytest.raises(RateLimited, match="gateway.max_streams_per_key") as info:
        limiter.acquire("k", 5)
    assert info.value.retry_after_s == 1
    limiter.acquire("other", 5)
    a.release(5)
    c = limiter.acquire("k", 5)
    for lease in (b, c):
        lease.release(5)
    assert "k" not in limiter.open_streams


def test_everything_off_by_default():
    limiter = KeyLimiter(KeyLimits(), Clock())
    for _ in range(1000):
        limiter.check_request("")
        limiter.acquire("", 10**6)


@pytest.mark.parametrize("field,value", [("requests_per_s", -1), ("tokens_per_min", float("nan"))])
def test_bad_limits_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        KeyLimits(**{field: value})


def test_http_answer_of_a_rate_limit_is_openai_429_with_retry_after():
    from services.gateway.http import _error_response

    response = _error_response(RateLimited("gateway.rate_limit_tokens_per_min: over", 7), {})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    error = json.loads(response.body)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
