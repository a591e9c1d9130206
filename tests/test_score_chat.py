"""tinyloop.score (per-position logits, log-probabilities) and tinyloop.chat (Jinja chat templates)."""
from __future__ import annotations

import json

import pytest
import torch

import tinyloop
from tinyloop.chat import DEFAULT_CHAT_TEMPLATE, apply_chat_template, load_chat_template, render_chat
from tinyloop.scoring import token_logprobs


@pytest.fixture(scope="module")
def model():
    return tinyloop.load_model(max_seq_len=256)


def test_score_rows_predict_what_greedy_decode_picks(model):
    cfg = tinyloop.GenerateConfig(max_tokens=12, loops=4, temperature=0.0)
    prompt = model.codec.encode("def add(a, b):\n")
    out = tinyloop.generate(model, prompt, cfg).tokens
    logits = tinyloop.score(model, prompt + out, loops=4)
    assert logits.shape == (len(prompt) + len(out), model.cfg.vocab_size) and logits.dtype == torch.float32
    # Row i predicts token i + 1: the full forward agrees with the cached greedy decode.
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out
    # More loops give different logits (the knob reaches the forward).
    assert not torch.allclose(logits, tinyloop.score(model, prompt + out, loops=8))


def test_token_logprobs_are_log_softmax_of_score(model):
    ctx, tgt = model.codec.encode("import os\n"), model.codec.encode("import sys")
    lp = token_logprobs(model, ctx, tgt, loops=3, top=2, score_context=True)
    full = torch.log_softmax(tinyloop.score(model, ctx + tgt, loops=3), -1)
    expect = [float(full[len(ctx) - 1 + i, t]) for i, t in enumerate(tgt)]
    assert lp["tokens"] == tgt and lp["logprobs"] == pytest.approx(expect, abs=1e-5)
    assert lp["context"]["logprobs"][0] is None and lp["context"]["top"][0] is None
    assert lp["context"]["logprobs"][1:] == pytest.approx([float(full[i, t]) for i, t in enumerate(ctx[1:])], abs=1e-5)
    for alts, value in zip(lp["top"], lp["logprobs"]):
        assert len(alts) == 2 and alts[0][2] >= alts[1][2] and alts[0][2] >= value - 1e-6
        assert alts[0][1] == model.codec.decode([alts[0][0]])


def test_score_rejects_bad_input_with_a_clear_error(model):
    with pytest.raises(tinyloop.ConfigError, match="empty"):
        tinyloop.score(model, [])
    with pytest.raises(tinyloop.ConfigError, match="outside the vocabulary"):
        tinyloop.score(model, [1, model.cfg.vocab_size])
    with pytest.raises(tinyloop.ConfigError, match="loops must be an integer in 1..16"):
        tinyloop.score(model, [1, 2], loops=99)
    with pytest.raises(tinyloop.ConfigError, match="max_seq_len"):
        tinyloop.score(model, [1] * 300)
    with pytest.raises(tinyloop.ConfigError, match="list of token ids"):
        tinyloop.score(model, "text")
    with model.busy(), pytest.raises(tinyloop.BusyError):
        tinyloop.score(model, [1, 2])


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_chat_templates_render_like_hugging_face(tmp_path, model):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(CHATML, msgs) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                         "<|im_start|>assistant\n")
    assert render_chat(CHATML, msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    # trim_blocks / lstrip_blocks, eos_token and raise_exception, as transformers provides them.
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}\n"
                "  {% for m in messages %}\n[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n  {% endfor %}\n")
    assert render_chat(template, msgs[1:], eos_token="</s>") == "[user] Hi</s>\n"
    with pytest.raises(tinyloop.ConfigError, match="first message must be user"):
        render_chat(template, msgs)
    with pytest.raises(tinyloop.ConfigError):  # the sandbox refuses unsafe attribute access
        render_chat("{{ messages.__class__.__mro__ }}", msgs)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [{"name": "default", "template": CHATML}, {"name": "x", "template": "y"}]}))
    assert load_chat_template(config) == CHATML
    assert apply_chat_template(model, msgs) == "system: Be brief.\nuser: Hi\nassistant:"
    assert render_chat(DEFAULT_CHAT_TEMPLATE, msgs) == "system: Be brief.\nuser: Hi\nassistant:"
    with pytest.raises(tinyloop.ConfigError, match="role must be one of"):
        render_chat(CHATML, [{"role": "robot", "content": "x"}])


def test_chat_template_from_the_environment(tmp_path, model, monkeypatch):
    path = tmp_path / "t.jinja"
    path.write_text(CHATML)
    monkeypatch.setenv("TINYLOOP_CHAT_TEMPLATE", str(path))
    assert apply_chat_template(model, [{"role": "user", "content": "Hi"}]).startswith("<|im_start|>user\nHi")
