"""README.md's examples print what README.md says they print, with the default settings (the
default precision: the built-in GGUF's Q4_1 weights, int8 activations; greedy output does not
depend on the batch or the cache, so it can be compared exactly).

The Python example is cut out of README.md and run against a real stack (gateway with HTTP,
prefill and decode workers, Redis); its first printed line must equal the text of the comment
after ``print(...)`` in README.md, so the README and this test cannot drift apart.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import WORKER_ARGS, free_port, start_stack

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
DEFAULT_PRECISION = ["--dtype", "auto", "--quantization", "auto"]


@pytest.fixture(scope="module")
def base_url(redis_server) -> Iterator[str]:
    port = free_port()
    s = start_stack([*WORKER_ARGS, *DEFAULT_PRECISION], redis_server.url,
                    gateway_args=["--http-port", str(port)])
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        s.stop()


def python_example() -> tuple[str, str]:
    """README's OpenAI client example and the output its comment promises."""
    code = README.read_text().split("```python\nfrom openai import OpenAI", 1)[1].split("```", 1)[0]
    code = "from openai import OpenAI" + code
    promised = re.search(r"print\(reply\.choices\[0\]\.message\.content\)\s+# (.+)", code)
    assert promised, "README's Python example lost its printed-output comment"
    return code, promised.group(1)


def test_readme_python_example_prints_what_it_says(base_url, capsys):
    code, promised = python_example()
    exec(compile(code.replace("http://127.0.0.1:8000/v1", base_url), "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == promised
    assert len(printed) > 1 and printed[1]  # the streamed haiku
