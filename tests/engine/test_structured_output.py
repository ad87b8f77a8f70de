"""Grammar-constrained sampling: every output of a tiny random-weight model matches its schema.

References are independent of xgrammar: ``jsonschema`` and pydantic validate the outputs,
and the first-step token mask is compared with the vocabulary entries a plain ``re`` match
allows. A random model at temperature 1 is the hard case: it goes wherever the mask lets it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pydantic
import pytest
import torch

from raymoe.engine.engine import EngineConfig, LLMEngine
from raymoe.engine.sampling_params import SamplingParams
from raymoe.engine.structured_output import GrammarCompiler, StructuredOutput, mask_logits
from raymoe.engine.tokenizer import Tokenizer

EOS = 2  # tests/tiny_models.py: <|im_end|>

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "colors": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
        "mood": {"enum": ["calm", None]},
    },
    "required": ["name", "age", "member", "colors"],
    "additionalProperties": False,
}


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=4)
    age: int = pydantic.Field(ge=0, le=120)
    member: bool
    colors: list[str] = pydantic.Field(max_length=2)
    mood: str | None = None


@pytest.fixture(scope="module")
def engine(tiny_mixtral_dir):
    return LLMEngine.from_pretrained(tiny_mixtral_dir, EngineConfig(dtype="float32"))


@pytest.fixture(scope="module")
def tokenizer(tiny_mixtral_dir):
    return Tokenizer(tiny_mixtral_dir)


@pytest.mark.parametrize("schema, message", [
    ("{", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"type": "strin"}, "not a valid JSON Schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "cannot be enforced"),
])
def test_bad_schemas_are_refused_naming_response_format(schema, message):
    with pytest.raises(ValueError) as error:
        StructuredOutput.json_schema(schema)
    assert str(error.value).split(" ", 1)[0] == "response_format" and message in str(error.value)


def test_first_step_mask_equals_the_regex_reference(tiny_mixtral_dir, tokenizer):
    """For ``[0-9]{1,3}`` the first token may be any vocabulary entry whose text is 1-3
    digits; after three digits only EOS remains."""
    compiler = GrammarCompiler.from_model_dir(tiny_mixtral_dir, 320, [EOS])
    state = compiler.new_state(StructuredOutput.regex("[0-9]{1,3}"))
    logits = torch.zeros(2, 320)
    mask_logits(logits, [1], [state])  # row 0 is unconstrained
    allowed = {t for t in range(320) if logits[1, t] == 0}
    expected = {t for t in range(4, 320) if re.fullmatch(r"[0-9]{1,3}", tokenizer.decode([t]))}
    assert len(expected) >= 10 and allowed == expected
    assert (logits[0] == 0).all()
    digit = tokenizer.encode("7", add_special_tokens=False)
    for token in digit * 3:
        assert state.accept(token)
    logits = torch.zeros(1, 320)
    mask_logits(logits, [0], [state])
    assert {t for t in range(320) if logits[0, t] == 0} == {EOS}
    assert state.accept(EOS) and state.is_terminated


def test_compiled_grammars_are_cached_by_schema(tiny_mixtral_dir):
    compiler = GrammarCompiler.from_model_dir(tiny_mixtral_dir, 320, [EOS])
    first = compiler.compile(StructuredOutput.json_schema(SCHEMA))
    assert compiler.compile(StructuredOutput.json_schema(json.dumps(SCHEMA))) is first
    compiler.compile(StructuredOutput.json_object())
    assert compiler.num_cached == 2


def test_twenty_sampled_outputs_validate_against_the_schema(engine, tokenizer):
    structured = StructuredOutput.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=100, temperature=1.0, seed=seed, structured=structured) for seed in range(20)]
    prompt = tokenizer.encode("Describe a person as JSON:")
    outputs = engine.generate([prompt] * 20, params)
    texts = []
    for output in outputs:
        assert output.finish_reason == "stop" and output.output_token_ids[-1] == EOS
        text = tokenizer.decode(output.output_token_ids)
        value = json.loads(text)  # strict: no raw control characters in strings
        jsonschema.validate(value, SCHEMA)
        Person.model_validate_json(text)
        texts.append(text)
    assert len(set(texts)) > 15  # really sampled


def test_json_object_outputs_are_objects_and_greedy_rows_are_constrained_too(engine, tokenizer):
    prompt = tokenizer.encode("JSON please:")
    params = [SamplingParams(max_tokens=40, temperature=t, seed=seed, structured=StructuredOutput.json_object())
              for seed, t in enumerate([1.0, 1.0, 0.0])]
    for output in engine.generate([prompt] * 3, params):
        if output.finish_reason == "stop":
            assert isinstance(json.loads(tokenizer.decode(output.output_token_ids)), dict)
        else:  # an unconstrained object may run past max_tokens: still a valid prefix of one
            assert output.finish_reason == "length" and tokenizer.decode(output.output_token_ids).startswith("{")


def test_a_finished_grammar_ends_the_output_despite_min_tokens_and_ignore_eos(engine, tokenizer):
    structured = StructuredOutput.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                               "required": ["ok"], "additionalProperties": False})
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3, min_tokens=50, ignore_eos=True,
                            structured=structured)
    (output,) = engine.generate([tokenizer.encode("ok?")], params)
    assert output.finish_reason == "stop" and len(output.output_token_ids) < 50
    assert json.loads(tokenizer.decode(output.output_token_ids)) in ({"ok": True}, {"ok": False})


def test_penalties_and_bias_combine_with_the_grammar(engine, tokenizer):
    regex = StructuredOutput.regex("(ab|cd){2,4}")
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=1, structured=regex, frequency_penalty=2.0,
                            presence_penalty=2.0, repetition_penalty=2.0,
                            logit_bias=tuple((t, 100.0) for t in range(4, 40)))
    (output,) = engine.generate([tokenizer.encode("go")], params)
    assert re.fullmatch("(ab|cd){2,4}", tokenizer.decode(output.output_token_ids))


def test_requests_the_engine_cannot_serve_are_refused_naming_the_field(engine, tiny_mixtral_dir):
    with pytest.raises(ValueError, match=r"^logit_bias token ids \[320\]"):
        engine.add_request("bias", [5, 6], SamplingParams(logit_bias=((7, 1.0), (320, 1.0))))
    bare = LLMEngine(engine.config, engine.model, EngineConfig(dtype="float32", kv_cache_bytes=2**20), engine.dtype)
    with pytest.raises(ValueError, match=r"^response_format "):
        bare.add_request("s", [5, 6], SamplingParams(structured=StructuredOutput.json_object()))
