"""The gateway's front-door checks without a network: request bodies as bytes (size limit,
protobuf and UTF-8 failures named by field), sampling options against the model, and the
gateway's imports (no torch, engine, kernels or worker runtime)."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from services.api import gateway_pb2
from services.gateway import validation
from services.gateway.model_card import ModelCard
from services.gateway.validation import RequestLimits
from services.gateway.wire import invalid_utf8_field, parse_body

MODEL = ModelCard("m", max_model_len=64, vocab_size=100)


def params(**fields):
    req = gateway_pb2.GenerateRequest(prompt="hi", **fields)
    return validation.sampling_params(req, 4, MODEL)


def rejected(**fields) -> str:
    with pytest.raises(ValueError) as err:
        req = gateway_pb2.GenerateRequest(prompt="hi", **fields)
        validation.check_request(req, RequestLimits())
        validation.sampling_params(req, 4, MODEL)
    return str(err.value)


# -- bodies ------------------------------------------------------------------------------------
def _with_bytes(request: gateway_pb2.GenerateRequest, marker: bytes, raw: bytes) -> bytes:
    data = request.SerializeToString()
    assert data.count(marker) == 1
    return data.replace(marker, raw)


def test_invalid_utf8_names_the_field_and_no_internal_class():
    data = _with_bytes(gateway_pb2.GenerateRequest(prompt="XY"), b"XY", b"\xc3(")
    with pytest.raises(ValueError) as err:
        parse_body(gateway_pb2.GenerateRequest, data, 1 << 20)
    assert str(err.value).startswith("prompt:") and "UTF-8" in str(err.value)
    assert "DecodeError" not in str(err.value) and "google" not in str(err.value)


def test_invalid_utf8_in_a_nested_message_names_its_index():
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content="fine"),
                  gateway_pb2.ChatMessage(role="assistant", content="QQ")],
        stop_token_ids=[1, 2], max_tokens=3)
    data = _with_bytes(request, b"QQ", b"\xff\xfe")
    assert invalid_utf8_field(gateway_pb2.GenerateRequest.DESCRIPTOR, data) == "messages[1].content"
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content: is not valid UTF-8"):
        parse_body(gateway_pb2.GenerateRequest, data, 1 << 20)


def test_malformed_body_is_a_value_error_naming_the_request():
    with pytest.raises(ValueError, match="^request: not a well-formed GenerateRequest"):
        parse_body(gateway_pb2.GenerateRequest, b"\x1a\x50abc", 1 << 20)  # prompt cut short


def test_oversized_body_is_refused_before_parsing_naming_the_limit_and_setting():
    data = gateway_pb2.GenerateRequest(prompt="x" * 200).SerializeToString()
    with pytest.raises(ValueError) as err:
        parse_body(gateway_pb2.GenerateRequest, data + b"\xff" * 10, 100)  # not even parseable
    assert str(err.value).startswith("request:")
    assert "limit of 100 bytes" in str(err.value) and "max_request_bytes" in str(err.value)
    assert parse_body(gateway_pb2.GenerateRequest, data, len(data)).prompt == "x" * 200


# -- options -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1e-45, 1e-6, 0.0])
def test_temperature_below_epsilon_is_greedy(value):
    assert params(temperature=value).temperature == 0.0


def test_temperature_at_epsilon_samples():
    assert params(temperature=1e-4).temperature == pytest.approx(1e-4)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_are_rejected_naming_the_field(field, value):
    message = rejected(**{field: value})
    assert message.startswith(f"{field}:") and "finite" in message


def test_negative_temperature_is_still_rejected():
    assert rejected(temperature=-1e-7).startswith("temperature:")


def test_top_logprobs_out_of_range_names_top_logprobs():
    assert rejected(logprobs=True, top_logprobs=1000).startswith("top_logprobs:")
    assert params(logprobs=True, top_logprobs=20).logprobs == 20


def test_stop_token_ids_outside_the_vocabulary_are_rejected():
    message = rejected(stop_token_ids=[5, 100])
    assert message.startswith("stop_token_ids[1]:") and "99" in message
    assert params(stop_token_ids=[0, 99]).stop_token_ids == (0, 99)


def test_message_count_is_bounded():
    limits = RequestLimits(max_messages=3)
    msgs = [gateway_pb2.ChatMessage(role="user", content="x")] * 4
    with pytest.raises(ValueError, match="^messages: 4 messages exceed the limit of 3 .*max_messages"):
        validation.check_request(gateway_pb2.GenerateRequest(messages=msgs), limits)
    validation.check_request(gateway_pb2.GenerateRequest(messages=msgs[:3]), limits)


# -- imports -----------------------------------------------------------------------------------
def test_gateway_imports_no_torch_engine_kernels_or_worker_runtime():
    code = ("import sys, services.gateway.app, services.runtime.serve, services.runtime.client; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.') or "
            "m.startswith('kernels') or m in ('services.engine.model', 'services.engine.engine', "
            "'services.engine.model_runner', 'services.engine.scheduler', 'services.runtime.worker', "
            "'services.kv_transfer')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- prompt token ids ----------------------------------------------------------------------------
def test_prompt_token_ids_are_a_prompt_of_their_own_checked_against_the_vocabulary():
    from types import SimpleNamespace

    tok = SimpleNamespace(vocab_size=100)
    req = gateway_pb2.GenerateRequest(prompt_token_ids=[5, 99, 0])
    validation.check_request(req, RequestLimits())
    assert validation.prompt_token_ids(req, tok, max_model_len=64) == [5, 99, 0]
    with pytest.raises(ValueError, match=r"^prompt_token_ids\[1\]: 100 is not a token id"):
        validation.prompt_token_ids(gateway_pb2.GenerateRequest(prompt_token_ids=[5, 100]), tok, 64)
    with pytest.raises(ValueError, match=r"^prompt_token_ids: 64 tokens do not fit"):
        validation.prompt_token_ids(gateway_pb2.GenerateRequest(prompt_token_ids=[1] * 64), tok, 64)
    with pytest.raises(ValueError, match=r"^prompt, prompt_token_ids: give exactly one of them"):
        validation.check_request(gateway_pb2.GenerateRequest(prompt="x", prompt_token_ids=[1]), RequestLimits())
