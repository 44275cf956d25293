"""scripts/gpu_precision.py's migration check, on the CPU: a stream resumed as the gateway's
migration resumes it (prompt + the tokens so far as a new prompt) gives the uninterrupted
stream's tokens in the CPU's default precision, where every kernel is batch- and
chunk-invariant; on a GPU the script reports where bf16 parts."""
from __future__ import annotations

from scripts.gpu_precision import first_divergence, migration_vs_uninterrupted
from tests.reference import CHAT_PROMPTS, chat_prompt_ids


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1


def test_a_stream_resumed_as_a_migration_resumes_it_equals_the_uninterrupted_one_on_the_cpu():
    prompts = [chat_prompt_ids(p) for p in CHAT_PROMPTS[:3]]
    assert migration_vs_uninterrupted("cpu", "auto", prompts, 24, 9) == [None, None, None]


def test_the_resumed_stream_is_prompt_plus_tokens_so_far_and_the_rest_to_generate(monkeypatch):
    """What the gateway's migration sends (services/gateway/dispatch.py), and a resumed stream
    that parts from the uninterrupted one is reported where it parts."""
    from types import SimpleNamespace

    from scripts import gpu_precision

    calls = []

    class FakeLLM:
        def __init__(self, config):
            assert not config.enable_prefix_caching

        def generate(self, prompts, params):
            calls.append(([list(p) for p in prompts], params.max_tokens))
            first = len(calls) == 1
            return [SimpleNamespace(token_ids=list(range(10, 10 + params.max_tokens)) if first
                                    else [90] + list(range(14, 10 + 6))) for _ in prompts]

    monkeypatch.setattr(gpu_precision, "LLM", FakeLLM)
    assert migration_vs_uninterrupted("cpu", "auto", [[1, 2], [3]], 6, 2) == [2, 2]
    assert calls == [([[1, 2], [3]], 6), ([[1, 2, 10, 11], [3, 10, 11]], 4)]
