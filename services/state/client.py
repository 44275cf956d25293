"""The Redis client every long-running service uses (gateway and workers alike)."""
from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

REDIS_TIMEOUT_S = 2.0  # connect and per-command socket timeout of the services' Redis clients


def redis_client(url: str) -> aioredis.Redis:
    """A Redis client for a long-running service: every command fails within
    ``REDIS_TIMEOUT_S`` seconds when Redis is unreachable (redis.RedisError), and retries once
    on a fresh connection, so a restarted Redis is used again without any reconnect logic
    (the pool drops a broken connection; nothing keeps a dead one)."""
    return aioredis.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1))
