"""generate / generate_stream: sampling, stops, cancellation, validation, concurrency, early exit, stats."""
import threading

import pytest
import torch

import tinyloop
from tinyloop import ConfigError, GenerateConfig, generate, generate_stream
from tinyloop.sampling import filter_logits


def test_greedy_is_deterministic_and_matches_argmax_of_full_forward(tiny_model):
    res = generate(tiny_model, [5, 6, 7], GenerateConfig(max_tokens=6, loops=3))
    ids = [5, 6, 7]
    for _ in range(len(res.tokens)):
        ids.append(int(tiny_model.net(torch.tensor([ids]), 3)[0, -1].argmax()))
    assert res.tokens == ids[3:3 + len(res.tokens)]
    assert generate(tiny_model, [5, 6, 7], GenerateConfig(max_tokens=6, loops=3)).tokens == res.tokens


def test_seed_makes_sampling_reproducible(tiny_model):
    cfg = lambda seed: GenerateConfig(max_tokens=12, temperature=1.2, top_k=50, top_p=0.95, seed=seed)
    a, b, c = (generate(tiny_model, "def add", cfg(s)).tokens for s in (7, 7, 8))
    assert a == b and a != c


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert torch.isinf(filter_logits(logits, 1.0, 2, 1.0)).tolist() == [False, False, True, True, True]
    probs = torch.softmax(logits, -1)  # [0.64, 0.23, 0.09, ...]
    kept = ~torch.isinf(filter_logits(logits, 1.0, 0, 0.8))
    assert kept.tolist() == [True, True, False, False, False] and probs[:1].sum() < 0.8 <= probs[:2].sum()


def test_repetition_penalty_discourages_repeats(tiny_model):
    plain = generate(tiny_model, [5, 6, 7], GenerateConfig(max_tokens=30, loops=2)).tokens
    penalised = generate(tiny_model, [5, 6, 7], GenerateConfig(max_tokens=30, loops=2, repetition_penalty=5.0)).tokens
    assert len(set(penalised)) > len(set(plain))


def test_string_stop_sequence_across_token_boundaries(tiny_model):
    free = generate(tiny_model, "def add", GenerateConfig(max_tokens=40, loops=2))
    text = free.text
    assert len(text) > 6
    # a stop string that starts mid-text and spans several tokens
    stop = text[3:8]
    streamed = []
    res = generate_stream(tiny_model, "def add", GenerateConfig(max_tokens=40, loops=2, stop_sequences=[stop]),
                          lambda t, i: streamed.append(t) or True)
    assert res.stats.stop_reason == "stop_sequence"
    assert res.text == text[:text.find(stop)]
    assert stop not in tiny_model.codec.decode(streamed)  # nothing of the stop sequence was streamed
    assert streamed == res.tokens


def test_token_stop_sequence(tiny_model):
    free = generate(tiny_model, [5, 6, 7], GenerateConfig(max_tokens=20, loops=2))
    stop = free.tokens[4:6]
    res = generate(tiny_model, [5, 6, 7], GenerateConfig(max_tokens=20, loops=2, stop_sequences=[stop]))
    first = next(i for i in range(len(free.tokens)) if free.tokens[i:i + 2] == stop)
    assert res.tokens == free.tokens[:first] and res.stats.stop_reason == "stop_sequence"


def test_eos_stops_generation(make_artifact, tiny_codec):
    model = tinyloop.load_model(make_artifact(), 64)
    with torch.no_grad():  # make EOS the only sensible next token
        model.net.embed.weight[model.eos_id] *= 0
        model.net.embed.weight[model.eos_id] += model.net.norm.weight.sign() * 50
    res = generate(model, [5, 6], GenerateConfig(max_tokens=10, loops=2))
    assert res.stats.stop_reason == "eos" and model.eos_id not in res.tokens


def test_callback_cancels(tiny_model):
    seen = []
    res = generate_stream(tiny_model, "def", GenerateConfig(max_tokens=30), lambda t, i: seen.append(i) or i < 4)
    assert res.stats.stop_reason == "cancelled" and seen == [0, 1, 2, 3, 4] and len(res.tokens) == 5


def test_stats_have_real_timings(tiny_model):
    res = generate(tiny_model, "def add(a, b):", GenerateConfig(max_tokens=8, loops=3))
    s = res.stats
    assert s.prompt_tokens == len(tiny_model.encode_prompt("def add(a, b):"))
    assert s.generated_tokens == len(res.tokens) == 8 and s.stop_reason == "max_tokens"
    assert 0 < s.prefill_ms <= s.first_token_ms <= s.total_ms and 0 < s.decode_ms <= s.total_ms
    assert s.loops_mean == 3 and s.cache_mode == "fp16"


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", 0, "max_tokens"), ("loops", 0, "loops"),
    ("loops", 17, r"GenerateConfig\.loops must be in \[1, 16\] \(this model's max_loops\), got 17"),
    ("temperature", -0.5, "temperature"), ("top_k", -1, "top_k"), ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"),
    ("repetition_penalty", 0, "repetition_penalty"), ("seed", -3, "seed"), ("beam_size", 0, "beam_size"),
    ("cache_window", -1, "cache_window"), ("early_exit_threshold", -0.1, "early_exit_threshold"),
    ("stop_sequences", [""], "stop_sequences"), ("stop_sequences", "stop", "stop_sequences"),
    ("max_tokens", 2.5, "max_tokens"), ("temperature", float("nan"), "temperature"),
])
def test_invalid_fields_name_the_field(tiny_model, field, value, message):
    with pytest.raises(ConfigError, match=message):
        generate(tiny_model, "def", GenerateConfig(**{field: value}))


def test_a_config_is_checked_when_built_and_a_batch_names_its_bad_prompt(tiny_model):
    """The wire's words, where the value is written; generate_batch says which prompt broke a rule."""
    for fields, words in [({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
                          ({"seed": 1.5}, "seed must be an integer, got float"),
                          ({"top_p": "0.5"}, "top_p must be a finite number, got str")]:
        with pytest.raises(ConfigError, match=f"^GenerateConfig.{words}$"):
            GenerateConfig(**fields)
    cfgs = [GenerateConfig(max_tokens=2) for _ in range(5)]
    cfgs[3].loops = 17  # set after building: checked at the call, against the model
    with pytest.raises(ConfigError, match=r"^generate_batch prompt 3: GenerateConfig\.loops must be in \[1, 16\]"):
        tinyloop.generate_batch(tiny_model, ["a", "b", "c", "d", "e"], cfgs)
    with pytest.raises(ConfigError, match="^generate_batch prompt 2: prompt is empty$"):
        tinyloop.generate_batch(tiny_model, ["a", "b", "", "d", "e"], GenerateConfig(max_tokens=2))


def test_prompt_errors(tiny_model):
    with pytest.raises(ConfigError, match="prompt is empty"):
        generate(tiny_model, "")
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        generate(tiny_model, [1, 99999])
    with pytest.raises(ConfigError, match="string or a list"):
        generate(tiny_model, 3.5)
    with pytest.raises(ConfigError, match="exceeds max_seq_len 256"):
        generate(tiny_model, [5] * 200, GenerateConfig(max_tokens=57))
    assert generate(tiny_model, [5] * 200, GenerateConfig(max_tokens=56)).stats.generated_tokens > 0


def test_environment_defaults_and_overrides(make_artifact, monkeypatch):
    monkeypatch.setenv("TINYLOOP_CACHE_MODE", "int8")
    monkeypatch.setenv("TINYLOOP_EARLY_EXIT", "0.25")
    model = tinyloop.load_model(make_artifact(), 64)
    assert model.cache_mode == "int8" and tinyloop.load_model(make_artifact(), 64, cache_mode="int4").cache_mode == "int4"
    assert GenerateConfig().early_exit_threshold == 0.25 and GenerateConfig(early_exit_threshold=0).early_exit_threshold == 0
    monkeypatch.setenv("TINYLOOP_CACHE_MODE", "fp8")
    with pytest.raises(ConfigError, match="TINYLOOP_CACHE_MODE='fp8'"):
        tinyloop.load_model(make_artifact(), 64)
    monkeypatch.setenv("TINYLOOP_EARLY_EXIT", "lots")
    with pytest.raises(ConfigError, match="TINYLOOP_EARLY_EXIT"):
        GenerateConfig()


def test_model_used_from_two_threads_raises_busy(tiny_model):
    started, errors = threading.Event(), []

    def slow(token, index):
        started.set()
        return index < 40

    t = threading.Thread(target=lambda: generate_stream(tiny_model, "def", GenerateConfig(max_tokens=60), slow))
    t.start()
    started.wait(10)
    try:
        generate(tiny_model, "def", GenerateConfig(max_tokens=2))
    except tinyloop.BusyError as e:
        errors.append(e)
    t.join()
    assert errors and "not reentrant" in str(errors[0])
    assert generate(tiny_model, "def", GenerateConfig(max_tokens=2)).stats.generated_tokens == 2  # free again


def test_freed_model_raises_handle_error(make_artifact):
    model = tinyloop.load_model(make_artifact(), 32)
    tinyloop.free_model(model)
    with pytest.raises(tinyloop.HandleError, match="freed"):
        generate(model, "def")


def test_early_exit_uses_fewer_loops_on_the_bundled_model(bundled_model):
    full = generate(bundled_model, "def fibonacci(n):\n", GenerateConfig(max_tokens=24, loops=16))
    fast = generate(bundled_model, "def fibonacci(n):\n", GenerateConfig(max_tokens=24, loops=16, early_exit_threshold=0.05))
    assert full.stats.loops_mean == 16
    assert fast.stats.loops_mean < 16
    # easy tokens exit early but the continuation stays mostly the same
    agree = sum(a == b for a, b in zip(full.tokens, fast.tokens)) / len(full.tokens)
    assert agree > 0.5


def test_cache_window_single_decode_runs_long(tiny_model):
    res = generate(tiny_model, [5, 6, 7, 8], GenerateConfig(max_tokens=40, cache_window=8, loops=2))
    assert res.stats.generated_tokens == 40
