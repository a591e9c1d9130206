"""Which requests join a worker's continuous batch (workers/engine.py): prefix-pool, beam, windowed, speculative and
resume requests and continued streams run beside plain lanes, finish before a long request that arrived first, and
answer exactly what they answer alone."""
from __future__ import annotations

import pytest

import tinyloop
from workers.engine import ModelEngine

SCAFFOLD = '"""Project conventions for every answer."""\nimport os\nimport sys\n\n\n'
never = lambda: False  # noqa: E731
# the long request the others run beside: sampled, so it takes one token a step (a greedy lane may draw up to a
# block of tokens in one step, and would finish first)
LONG = {"temperature": 0.8, "seed": 1}


@pytest.fixture(scope="module")
def engine():
    model = tinyloop.load_model(None, 512, prefix_caching=True)
    return ModelEngine(model, max_handles=4, plan_bytes=0, model_name="bundled", lanes=4,
                       prefixes=[{"prefix": SCAFFOLD, "loops": 8}])


def run_batch(engine, requests: list[tuple[str, str, dict, list[int] | None]]) -> tuple[dict, list[str]]:
    """Join every (key, op, params, delivered) and step until all finish: their answers and the order they ended."""
    streamed: dict[str, list] = {key: [] for key, *_ in requests}
    for key, op, params, delivered in requests:
        sink = lambda token, pos, text, key=key: streamed[key].append((pos, text))  # noqa: E731
        assert engine.join(key, op, params, sink, never, delivered=delivered), f"{key} ({op}) did not join the batch"
    answers, order = {}, []
    while len(answers) < len(requests):
        for key, answer in engine.step():
            assert not isinstance(answer, Exception), answer
            answers[key] = {**answer, "streamed": streamed[key]}
            order.append(key)
    return answers, order


def test_a_pool_request_runs_beside_a_long_one_and_equals_generate_with_pool(engine):
    model, pool = engine.model, engine.pool
    prompt = SCAFFOLD + "def fibonacci(n):\n"
    hits_before = pool.stats.hits
    answers, order = run_batch(engine, [
        ("long", "generate", {"prompt": "class Stack:\n", "max_tokens": 120, **LONG}, None),
        ("pool", "generate_pool", {"prompt": prompt, "max_tokens": 16, "loops": 8}, None)])
    assert order == ["pool", "long"]  # it did not wait for the batch to drain
    alone = tinyloop.generate(model, prompt, tinyloop.GenerateConfig(max_tokens=16, loops=8))
    assert answers["pool"]["tokens"] == alone.tokens
    assert answers["pool"]["stats"]["prefix_hit_tokens"] >= len(model.encode_prompt(SCAFFOLD)) - 16
    assert pool.stats.hits == hits_before + 1


def test_a_continued_stream_joins_the_batch_and_answers_the_whole_output(engine, monkeypatch):
    """A continued stream answers the whole output; its echo and log-probabilities come from the step's own logits
    (the delivered tokens' from its prefill's rows: they are part of its prompt), with no second forward."""
    model = engine.model
    prompt, cfg = "def read_file(path):\n", tinyloop.GenerateConfig(max_tokens=24, logprobs=2, prompt_logprobs=2)
    whole = tinyloop.generate(model, prompt, cfg)
    delivered = whole.tokens[:9]

    def second_forward(*args, **kwargs):
        raise AssertionError("the worker scored a request with a second forward (tinyloop.score)")
    monkeypatch.setattr(tinyloop.scoring, "score", second_forward)
    scoring = {"logprobs": True, "top_logprobs": 2, "echo": True}
    answers, order = run_batch(engine, [
        ("long", "generate", {"prompt": "import os\n", "max_tokens": 120, **LONG}, None),
        ("cont", "generate", {"prompt": prompt, "max_tokens": 24, **scoring}, delivered)])
    assert order == ["cont", "long"]
    cont = answers["cont"]
    assert cont["tokens"] == whole.tokens and cont["text"] == whole.text
    assert cont["prompt_text"] == prompt and cont["prompt_logprobs"]["tokens"] == model.encode_prompt(prompt)
    assert cont["prompt_logprobs"]["logprobs"][0] is None and cont["prompt_logprobs"]["top"][0] is None
    assert cont["prompt_logprobs"]["logprobs"][1:] == pytest.approx(whole.prompt_logprobs[1:], abs=1e-4)
    assert cont["logprobs"]["tokens"] == whole.tokens
    assert cont["logprobs"]["logprobs"] == pytest.approx(whole.logprobs, abs=1e-4)
    assert [[t for t, *_ in top] for top in cont["logprobs"]["top"]] == [[t for t, _ in top] for top in whole.top_logprobs]
    assert cont["stats"]["continued_after"] == 9
    positions = [pos for pos, _ in cont["streamed"]]
    assert positions == list(range(9, len(whole.tokens)))  # streamed after what the client holds, never twice
    assert model.codec.decode(delivered) + "".join(text for _, text in cont["streamed"]) == whole.text


def test_prefix_reuse_in_the_batch_at_any_loop_count(engine):
    """A prompt cached at 16 loops is reused by a batched request at 16 loops (the model's default is 8)."""
    model = engine.model
    prompt = "def parse(text):\n    return [line.split() for line in text.splitlines()]\n" * 3
    first, _ = run_batch(engine, [("a", "generate", {"prompt": prompt, "max_tokens": 4, "loops": 16}, None)])
    again, _ = run_batch(engine, [("b", "generate", {"prompt": prompt + "x", "max_tokens": 8, "loops": 16}, None)])
    assert again["b"]["stats"]["prefix_hit_tokens"] > 0
    alone = tinyloop.generate(model, prompt + "x", tinyloop.GenerateConfig(max_tokens=8, loops=16))
    assert again["b"]["tokens"] == alone.tokens


def test_a_beam_request_holds_lanes_of_the_batch_and_equals_beam_search_alone(engine):
    model = engine.model
    prompt = "def add(a, b):\n    return"
    answers, order = run_batch(engine, [
        ("long", "generate", {"prompt": "class Stack:\n", "max_tokens": 120, **LONG}, None),
        ("beam", "generate", {"prompt": prompt, "max_tokens": 12, "beam_size": 3, "logprobs": True, "top_logprobs": 1,
                              "echo": True}, None),
        ("short", "generate", {"prompt": "import os\n", "max_tokens": 8}, None)])
    assert order.index("beam") < order.index("long") and order.index("short") < order.index("long")
    alone = tinyloop.generate(model, prompt, tinyloop.GenerateConfig(max_tokens=12, beam_size=3, logprobs=1,
                                                                     prompt_logprobs=1))
    assert answers["beam"]["tokens"] == alone.tokens and answers["beam"]["text"] == alone.text
    # the best hypothesis's tokens scored under the logits they were chosen from, the prompt's by its prefill
    assert answers["beam"]["logprobs"]["logprobs"] == pytest.approx(alone.logprobs, abs=1e-4)
    assert answers["beam"]["prompt_logprobs"]["logprobs"][1:] == pytest.approx(alone.prompt_logprobs[1:], abs=1e-4)
    assert "".join(text for _, text in answers["beam"]["streamed"]) == alone.text


def test_windowed_requests_step_beside_the_batch_and_equal_generate(engine):
    model = engine.model
    plain, beam = {"prompt": "def main():\n", "max_tokens": 40, "cache_window": 24}, \
        {"prompt": "import os\n", "max_tokens": 12, "cache_window": 16, "beam_size": 2}
    answers, order = run_batch(engine, [
        ("long", "generate", {"prompt": "class Stack:\n", "max_tokens": 120, **LONG}, None),
        ("window", "generate", plain, None), ("window-beam", "generate", beam, None)])
    assert order[-1] == "long"
    for key, params in (("window", plain), ("window-beam", beam)):
        cfg = tinyloop.GenerateConfig(**{k: v for k, v in params.items() if k != "prompt"})
        alone = tinyloop.generate(model, params["prompt"], cfg)
        assert answers[key]["tokens"] == alone.tokens, key


def test_speculative_requests_run_in_the_batch_and_equal_speculative_alone(engine):
    """Greedy chain and tree speculation (plain rows beside others, rounds alone) and seeded sampled speculation
    (its rounds always) beside a long plain request: the tokens of each request alone."""
    model = engine.model
    chain = {"prompt": "def add(a, b):\n", "max_tokens": 40, "draft_loops": 2, "verify_loops": 8, "draft_ahead": 4}
    tree = {**chain, "prompt": "import os\n", "tree_width": 2}
    sampled = {**chain, "prompt": "class Node:\n", "temperature": 0.8, "seed": 3, "max_tokens": 24}
    windowed = {**chain, "prompt": "def main():\n", "cache_window": 24, "max_tokens": 30}
    answers, order = run_batch(engine, [
        ("long", "generate", {"prompt": "class Stack:\n", "max_tokens": 160, **LONG}, None),
        ("chain", "speculative", chain, None), ("tree", "speculative", tree, None),
        ("sampled", "speculative", sampled, None), ("window", "generate", windowed, None)])
    assert order[-1] == "long"  # none of them waited for the batch to drain
    for key, params in (("chain", chain), ("tree", tree), ("sampled", sampled), ("window", windowed)):
        spec = {k: params[k] for k in ("draft_loops", "verify_loops", "draft_ahead", "tree_width") if k in params}
        cfg = tinyloop.GenerateConfig(**{k: v for k, v in params.items() if k not in spec and k != "prompt"})
        alone = tinyloop.generate_speculative(model, params["prompt"], tinyloop.SpeculativeConfig(**spec), cfg)
        assert answers[key]["tokens"] == alone.tokens, key
        assert "".join(text for _, text in answers[key]["streamed"]) == alone.text, key
    assert answers["sampled"]["stats"]["verify_steps"] > 0  # a sampled lane speculates beside others too


def test_resume_requests_run_in_the_batch_and_equal_resume_alone(engine):
    model = engine.model
    prompt = "def fibonacci(n):\n    "
    built = engine.run("build_handle", {"prompt": prompt, "l_used": 4}, None, never)
    mine = tinyloop.build_resume_handle(model, prompt, 4)
    refine, sampled = {"handle": built["handle"], "loops": 16, "max_tokens": 24}, \
        {"handle": built["handle"], "loops": 16, "max_tokens": 16, "temperature": 0.7, "seed": 5}
    for params in (refine, sampled):  # one at a time: a handle serves one call at a time
        answers, order = run_batch(engine, [
            ("long", "generate", {"prompt": "class Stack:\n", "max_tokens": 120, **LONG}, None),
            ("resume", "resume", params, None)])
        assert order == ["resume", "long"] and answers["resume"]["handle"] == built["handle"]
        cfg = tinyloop.GenerateConfig(**{k: v for k, v in params.items() if k not in ("handle", "loops")})
        alone = tinyloop.resume_generate(mine, params["loops"], cfg)
        assert answers["resume"]["tokens"] == alone.tokens
        assert answers["resume"]["stats"]["skipped_loops"] == alone.stats.skipped_loops > 0
    engine.run("release_handle", {"handle": built["handle"]}, None, never)


def test_a_fault_in_one_request_fails_it_alone(engine, monkeypatch):
    """A request whose own postprocess fails (here its stream sink raises at its 4th token, and another's grammar
    mask raises) gets its error; its batch-mates' answers are those of a clean run."""
    model = engine.model
    prompts = ["def add(a, b):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]
    clean, _ = run_batch(engine, [(f"c{i}", "generate", {"prompt": p, "max_tokens": 12}, None)
                                  for i, p in enumerate(prompts)])

    def sink(token, pos, text):
        if pos == 3:
            raise RuntimeError("the client's stream broke")

    assert engine.join("bad-stream", "generate", {"prompt": prompts[0], "max_tokens": 12}, sink, never)
    assert engine.join("bad-mask", "generate", {"prompt": prompts[1], "max_tokens": 12}, None, never)
    bad = next(job.seq for job in engine.batch.values() if job.key == "bad-mask")
    monkeypatch.setattr(bad, "masked", lambda logits: 1 / 0)
    for i in (2, 3):
        assert engine.join(f"ok{i}", "generate", {"prompt": prompts[i], "max_tokens": 12}, None, never)
    answers = {}
    while len(answers) < 4:
        answers.update(engine.step())
    assert answers["bad-stream"].code == "runtime_error" and "stream broke" in answers["bad-stream"].message
    assert answers["bad-mask"].code == "runtime_error" and "ZeroDivisionError" in answers["bad-mask"].message
    for i in (2, 3):
        assert answers[f"ok{i}"]["tokens"] == clean[f"c{i}"]["tokens"]
    assert tinyloop.generate(model, prompts[0], tinyloop.GenerateConfig(max_tokens=4)).stats.generated_tokens == 4


def test_a_failed_shared_forward_fails_only_its_steps_lanes(engine):
    """A forward that breaks through no request's fault (Runner.fail_at_step, the test-only hook the worker reads
    from TINYLOOP_TEST_FAIL_STEP) fails the lanes of that step with forward_failed; the request still waiting for a
    lane, and every request after, answer what a clean run does."""
    prompts = ["def mean(xs):\n", "while True:\n", "try:\n    import json\n", "x = [i * i for i in", "# a note\n"]
    clean, _ = run_batch(engine, [(f"c{i}", "generate", {"prompt": p, "max_tokens": 10}, None)
                                  for i, p in enumerate(prompts)])
    runner = engine.scheduler.runner
    runner.fail_at_step = runner.scheduler.steps + 3  # decode steps of the first four (4 lanes); the fifth waits for a lane
    try:
        for i, p in enumerate(prompts):
            assert engine.join(f"r{i}", "generate", {"prompt": p, "max_tokens": 10}, None, never)
        answers = {}
        while len(answers) < len(prompts):
            answers.update(engine.step())
    finally:
        runner.fail_at_step = None
    for i in range(4):
        assert answers[f"r{i}"].code == "forward_failed", answers[f"r{i}"]
        assert "injected" in answers[f"r{i}"].message
    assert answers["r4"]["tokens"] == clean["c4"]["tokens"]
    again, _ = run_batch(engine, [(f"a{i}", "generate", {"prompt": p, "max_tokens": 10}, None)
                                  for i, p in enumerate(prompts)])
    assert [again[f"a{i}"]["tokens"] for i in range(5)] == [clean[f"c{i}"]["tokens"] for i in range(5)]
