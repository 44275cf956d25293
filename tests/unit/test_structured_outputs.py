"""Structured outputs and logit_bias in the engine (services/engine/grammars.py, the sampler's
token bitmask): outputs that validate against their JSON schema, match their regex or choice,
also when the first token or the earlier output came from elsewhere (P/D, migration), beside
free rows whose tokens do not change; bad specs refused naming the field."""
from __future__ import annotations

import functools
import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from services.engine.engine import EngineConfig, LLMEngine
from services.engine.grammars import grammar_of
from services.engine.sampler import apply_token_bitmask
from services.engine.sampling_params import SamplingParams, StructuredOutput
from services.engine.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3}},
    "required": ["name", "age", "languages"], "additionalProperties": False}


@functools.cache
def engine_and_tokenizer():
    engine = LLMEngine(EngineConfig(quantization="auto", num_kv_blocks=512, max_num_seqs=32))
    return engine, Tokenizer.load(engine.config.model)


def prompt(text: str) -> list[int]:
    _, tok = engine_and_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def run(requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    engine, _ = engine_and_tokenizer()
    for rid, (ids, params) in requests.items():
        engine.add_request(engine.make_request(rid, ids, params))
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id].extend(o.new_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.step()  # an empty step hands the runner the last finished requests
    assert not engine.runner.input_batch.row_of and not engine.runner.input_batch.matchers._matchers
    return out


def text(ids: list[int]) -> str:
    return engine_and_tokenizer()[1].decode(ids)


def json_params(schema, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured_output=StructuredOutput(
        format="json", spec=json.dumps(schema)), **kw)


def test_bitmask_keeps_exactly_the_set_bits():
    logits = torch.zeros(2, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 - 2**31  # tokens 0 and 31 (bit 31: the sign bit of an int32)
    bitmask[1, 2] = 1 << 5  # token 69
    kept = torch.isfinite(apply_token_bitmask(logits, bitmask))
    assert kept[0].nonzero().flatten().tolist() == [0, 31]
    assert kept[1].nonzero().flatten().tolist() == [69]


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.9, seed=3)])
def test_json_schema_output_validates_greedy_and_sampled_beside_free_rows(kw):
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ask = prompt("Describe a person as JSON.")
    # the same batch shapes with an unconstrained neighbour (the kernels' batch invariance is
    # issue 28's; here only the grammar's effect on other rows is in question)
    plain = run({"json": (ask, SamplingParams(max_tokens=120, ignore_eos=True, **kw)),
                 "free": (prompt("Name three colours."), free)})
    out = run({"json": (ask, json_params(PERSON, **kw)),
               "free": (prompt("Name three colours."), free)})
    value = json.loads(text(out["json"]).strip())
    jsonschema.validate(value, PERSON)
    assert len(out["json"]) > 16  # alive beside the free row for all of its steps
    assert out["free"] == plain["free"]  # a constrained neighbour changes nothing of a free row


def test_regex_and_choice_hold():
    date = SamplingParams(temperature=0.8, seed=1, max_tokens=20, structured_output=StructuredOutput(
        format="regex", spec=r"\d{4}-\d{2}-\d{2}"))
    pick = SamplingParams(temperature=0, max_tokens=10, structured_output=StructuredOutput(
        format="choice", spec=json.dumps(["Paris", "Lyon", "Nice"])))
    grammar = SamplingParams(temperature=0, max_tokens=10, structured_output=StructuredOutput(
        format="grammar", spec='root ::= "yes" | "no"'))
    out = run({"date": (prompt("When was the Eiffel tower built?"), date),
               "pick": (prompt("What is the capital of France?"), pick),
               "yn": (prompt("Is the sky blue?"), grammar)})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", text(out["date"]).strip())
    assert text(out["pick"]).strip() in ("Paris", "Lyon", "Nice")
    assert text(out["yn"]).strip() in ("yes", "no")


def test_a_resumed_request_continues_the_grammar_from_its_earlier_output():
    """Migration: the new attempt's prompt ends with the output so far; the matcher replays it."""
    _, tok = engine_and_tokenizer()
    ask = prompt("Describe a person as JSON.")
    whole = run({"a": (ask, json_params(PERSON, temperature=0))})["a"]
    k = 6
    resumed = run({"b": (ask + whole[:k], json_params(PERSON, temperature=0,
                                                       num_prior_output_tokens=k))})["b"]
    assert whole[:k] + resumed == whole
    jsonschema.validate(json.loads(tok.decode(whole).strip()), PERSON)


def test_logit_bias_bans_and_forces_tokens():
    ask = prompt("What is the capital of France?")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = run({"base": (ask, greedy)})["base"]
    banned = run({"ban": (ask, greedy.model_copy(update={"logit_bias": ((base[0], -100.0),)}))})["ban"]
    assert banned[0] != base[0]
    forced = run({"force": (ask, greedy.model_copy(update={"logit_bias": ((4321, 100.0),)}))})["force"]
    assert forced == [4321] * 4


@pytest.mark.parametrize("so,message", [
    (StructuredOutput.model_construct(format="json", spec="{not json"), "structured_output: json"),
    (StructuredOutput.model_construct(format="json", spec='{"type": "bogus"}'), "bogus"),
    (StructuredOutput.model_construct(format="regex", spec="[a-z"), "structured_output: regex"),
    (StructuredOutput.model_construct(format="choice", spec='"one"'), "list of strings"),
    (StructuredOutput.model_construct(format="grammar", spec="root ::= ("), "structured_output: grammar"),
])
def test_bad_specs_are_refused_naming_the_field(so, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_output=so)
    with pytest.raises(ValueError, match=message):
        grammar_of(so.format, so.spec)


@pytest.mark.parametrize("bias,message", [(((5, 101.0),), "within"), (((-1, 1.0),), ">= 0"),
                                          (((5, 1.0), (5, 2.0)), "distinct")])
def test_bad_logit_bias_is_refused_naming_the_field(bias, message):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_names_the_field():
    engine, _ = engine_and_tokenizer()
    with pytest.raises(ValueError, match="logit_bias"):
        engine.make_request("x", [1, 2], SamplingParams(logit_bias=((10**6, 1.0),)))


def test_rows_without_grammars_skip_the_masks():
    engine, _ = engine_and_tokenizer()
    ib = engine.runner.input_batch
    assert ib.matchers is not None and not np.any(ib.constrained)


def test_the_worker_proto_carries_the_new_fields():
    from services.api.convert import params_from_proto, params_to_proto

    p = SamplingParams(structured_output=StructuredOutput(format="regex", spec="a+"),
                       logit_bias=((1, 2.0), (3, -1.5)), prompt_logprobs=3)
    assert params_from_proto(params_to_proto(p)) == p
    assert params_from_proto(params_to_proto(SamplingParams())) == SamplingParams()


# -- prompt logprobs ----------------------------------------------------------------------------
def test_prompt_logprobs_equal_transformers_log_softmax_in_float32():
    """vLLM's prompt_logprobs (OpenAI's echo + logprobs): one logprob per prompt token after the
    first, equal to transformers' log-softmax there; chunked over 3 steps; max_tokens 0 scores
    the prompt without generating."""
    from loadtest.hf_baseline import build_hf_model
    from services.engine.loader import load_model
    from services.engine.model_files import default_model_path
    from tests.unit.test_engine import make_engine

    engine = make_engine(max_num_batched_tokens=16)  # float32 oracle mode, chunks of 16
    ids = prompt("Write a short poem about the sea.")[:40]
    engine.add_request(engine.make_request("score", ids, SamplingParams(
        max_tokens=0, prompt_logprobs=2)))
    engine.add_request(engine.make_request("gen", ids, SamplingParams(
        temperature=0, max_tokens=2, prompt_logprobs=0)))
    outs: dict[str, list] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    (score,) = outs["score"]
    assert score.new_token_ids == [] and score.finish_reason == "length"
    first_gen = outs["gen"][0]
    assert len(first_gen.new_token_ids) == 1 and all(o.prompt_logprobs is None for o in outs["gen"][1:])
    model = build_hf_model(*load_model(default_model_path()))
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for got, top in ((score.prompt_logprobs, 2), (first_gen.prompt_logprobs, 0)):
        assert len(got) == len(ids) and got[0] is None
        for j in range(1, len(ids)):
            lp = got[j]
            assert lp.token_id == ids[j]
            assert abs(lp.logprob - ref[j - 1, ids[j]].item()) < 1e-4, j
            assert len(lp.top) == top
            if top:
                assert [t for t, _ in lp.top] == ref[j - 1].topk(top).indices.tolist()
    assert engine.block_manager.num_free_blocks == 256


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
