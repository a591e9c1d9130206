"""Grammar-constrained decoding: every output parses / matches, in single decode, batches, cache modes."""
from __future__ import annotations

import json
import re

import pytest

import tinyloop
from tinyloop import ConfigError, GenerateConfig, generate, generate_batch, generate_stream
from tinyloop.grammar import grammar_kind

EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "ok", "kind", "n"]}
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
EBNF_AS_REGEX = r"\([0-9x](,[0-9x])*\)"


pytestmark = pytest.mark.usefixtures("one_thread")


def check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "ok", "kind", "n"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6 and isinstance(obj["ok"], bool)
    assert obj["kind"] in ("cat", "dog") and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99


@pytest.mark.parametrize("cache_mode", ["fp16", "int8", "int4"])
def test_outputs_satisfy_regex_schema_and_ebnf(make_artifact, cache_mode):
    model = tinyloop.load_model(make_artifact(), 256, cache_mode=cache_mode)
    for prompt in ("x", "def add(a, b):"):
        r = generate(model, prompt, GenerateConfig(max_tokens=40, grammar={"regex": EMAIL}))
        assert re.fullmatch(EMAIL, r.text) and r.stats.stop_reason == "grammar_complete"
        r = generate(model, prompt, GenerateConfig(max_tokens=80, grammar={"json_schema": SCHEMA}))
        check_schema(r.text)
        assert r.stats.stop_reason == "grammar_complete"
        r = generate(model, prompt, GenerateConfig(max_tokens=60, grammar={"ebnf": EBNF}))
        if r.stats.stop_reason == "grammar_complete":
            assert re.fullmatch(EBNF_AS_REGEX, r.text)
        else:  # an unbounded list may run into max_tokens: still a valid prefix
            assert r.stats.stop_reason == "max_tokens" and re.fullmatch(r"\([0-9x](,[0-9x])*,?", r.text)
        assert r.tokens and model.eos_id not in r.tokens and r.stats.generated_tokens == len(r.tokens)


def test_sampling_under_a_grammar_always_matches(tiny_model):
    for seed in range(6):
        cfg = GenerateConfig(max_tokens=80, temperature=1.5, seed=seed, grammar=SCHEMA)
        check_schema(generate(tiny_model, "{", cfg).text)
        cfg = GenerateConfig(max_tokens=40, temperature=1.5, top_k=20, seed=seed, grammar=EMAIL)
        assert re.fullmatch(EMAIL, generate(tiny_model, "mail", cfg).text)


def test_eos_is_never_text_and_stop_is_grammar_complete(tiny_model):
    # "<" "|" ">" and letters are all allowed, so a matcher that took EOS for the text "<|endoftext|>" could emit it
    pattern = r"[<|a-z>]{1,12}!"
    for seed in range(4):
        r = generate(tiny_model, "<", GenerateConfig(max_tokens=30, temperature=2.0, seed=seed, grammar={"regex": pattern}))
        assert re.fullmatch(pattern, r.text) and "endoftext" not in r.text
        assert r.stats.stop_reason == "grammar_complete"
    # once the grammar is complete and allows more, the model may end it with EOS: also grammar_complete
    r = generate(tiny_model, "z", GenerateConfig(max_tokens=6, grammar={"regex": "[a-z]*"}))
    assert re.fullmatch("[a-z]*", r.text) and r.stats.stop_reason in ("grammar_complete", "max_tokens")


def test_grammar_per_lane_in_a_batch(tiny_model):
    prompts = ["x", "def add(a, b):", "import os", "y"]
    cfgs = [GenerateConfig(max_tokens=40, grammar={"regex": EMAIL}), GenerateConfig(max_tokens=80, grammar=SCHEMA),
            GenerateConfig(max_tokens=20), GenerateConfig(max_tokens=60, grammar=EBNF)]
    out = generate_batch(tiny_model, prompts, cfgs)
    assert re.fullmatch(EMAIL, out[0].text)
    check_schema(out[1].text)
    assert out[2].stats.stop_reason == "max_tokens" and len(out[2].tokens) == 20
    assert [r.tokens for r in out] == [generate(tiny_model, p, c).tokens for p, c in zip(prompts, cfgs)]


def test_grammar_with_cache_window_stream_and_stop_sequence(tiny_model):
    streamed: list[int] = []
    r = generate_stream(tiny_model, "x", GenerateConfig(max_tokens=80, cache_window=6, grammar=SCHEMA),
                        lambda t, i: streamed.append(t) is None)
    check_schema(r.text)
    assert streamed == r.tokens
    # a stop sequence still ends decode (the output is then a prefix of a grammar sentence)
    r = generate(tiny_model, "x", GenerateConfig(max_tokens=80, grammar=SCHEMA, stop_sequences=['"ok"']))
    assert r.stats.stop_reason == "stop_sequence" and r.text.startswith('{"name": "') and '"ok"' not in r.text


def test_grammar_forms_and_errors(tiny_model):
    assert grammar_kind(SCHEMA)[0] == "json_schema"
    assert grammar_kind(json.dumps(SCHEMA)) == ("json_schema", SCHEMA)
    assert grammar_kind(EBNF) == ("ebnf", EBNF)
    assert grammar_kind(EMAIL) == ("regex", EMAIL)
    assert grammar_kind({"regex": "{a}"}) == ("regex", "{a}")
    r = generate(tiny_model, "x", GenerateConfig(max_tokens=80, grammar=json.dumps(SCHEMA)))
    check_schema(r.text)
    with pytest.raises(ConfigError, match="invalid regex"):
        generate(tiny_model, "x", GenerateConfig(grammar={"regex": "(unclosed"}))
    with pytest.raises(ConfigError, match="invalid ebnf"):
        generate(tiny_model, "x", GenerateConfig(grammar={"ebnf": "root ::= undefined_rule"}))
    with pytest.raises(ConfigError, match="exactly one"):
        generate(tiny_model, "x", GenerateConfig(grammar={"regex": "a", "ebnf": "root ::= \"a\""}))
    with pytest.raises(ConfigError, match="grammar must be"):
        generate(tiny_model, "x", GenerateConfig(grammar=42))
    with pytest.raises(ConfigError, match="grammar"):  # batch compiles at call entry too
        generate_batch(tiny_model, ["a", "b"], [GenerateConfig(), GenerateConfig(grammar={"regex": "(("})])
