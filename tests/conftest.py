"""Shared fixtures. A real, throwaway redis-server backs every test that asks for Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from services.state.redis_server import RedisServer, start_redis_server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the whole session (persistence off, free loopback port).

    Fails (does not skip) when `redis-server` is missing: CI installs it.
    """
    with start_redis_server() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the session's redis-server with database 0 emptied (FLUSHDB) before the test."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushdb()
    finally:
        client.close()
    return redis_server.url
