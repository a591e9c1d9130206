"""ResumeHandle: warm start skips the loops a prompt's prefill already ran, with output equal to generate."""
from __future__ import annotations

import pytest

import tinyloop
from tinyloop.cache import BLOCK_TOKENS
from conftest import ARCHS, ids
from tinyloop import GenerateConfig as G



# every cache mode on one architecture, every architecture on the fp16 cache
@pytest.mark.parametrize("mode,arch", [("int8", "huginn"), ("int4", "huginn")] + [("fp16", a) for a in ARCHS])
def test_upgrades_equal_generate(make_artifact, mode, arch):
    model = tinyloop.load_model(make_artifact(**ARCHS[arch]), 128, cache_mode=mode)
    prompt = ids(24, 1)
    handle = tinyloop.build_resume_handle(model, prompt, 4)
    assert handle.depth == 4
    sizes = [handle.nbytes]
    for loops in (4, 8, 16):  # draft, then two upgrades, each from the deepest state held
        out = tinyloop.resume_generate(handle, loops, G(max_tokens=6))
        assert out.tokens == tinyloop.generate(model, prompt, G(max_tokens=6, loops=loops)).tokens
        assert out.stats.skipped_loops == len(prompt) * (4 if loops <= 8 else 8)
        assert handle.depth == loops and out.stats.prompt_tokens == len(prompt) and out.stats.cache_mode == mode
        sizes.append(handle.nbytes)
    assert sizes[0] == sizes[1] < sizes[2] < sizes[3]


def test_fewer_loops_than_held_recompute_from_the_input(tiny_model):
    prompt = ids(20, 2)
    handle = tinyloop.build_resume_handle(tiny_model, prompt, 8)
    for loops in (3, 8, 1):
        out = tinyloop.resume_generate(handle, loops, G(max_tokens=6))
        assert out.tokens == tinyloop.generate(tiny_model, prompt, G(max_tokens=6, loops=loops)).tokens
        assert out.stats.skipped_loops == (len(prompt) * 8 if loops == 8 else 0)
        assert handle.depth == 8


def test_loops_from_config_and_sampling(tiny_model):
    prompt = ids(18, 3)
    handle = tinyloop.build_resume_handle(tiny_model, prompt, 2)
    cfg = G(max_tokens=8, loops=6, temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.3)
    out = tinyloop.resume_generate(handle, None, cfg)  # loops None: cfg.loops
    assert out.tokens == tinyloop.generate(tiny_model, prompt, cfg).tokens and handle.depth == 6


@pytest.mark.parametrize("mode", ["fp16", "int4"])
def test_cache_window(make_artifact, mode):
    model = tinyloop.load_model(make_artifact(), 128, cache_mode=mode)
    prompt = ids(20, 4)
    for window in (8, 64):  # shorter and longer than the prompt
        handle = tinyloop.build_resume_handle(model, prompt, 2, cache_window=window)
        for loops in (2, 5, 1):
            cfg = G(max_tokens=10, loops=loops, cache_window=window)
            out = tinyloop.resume_generate(handle, loops, cfg)
            assert out.tokens == tinyloop.generate(model, prompt, cfg).tokens, (window, loops)
        with pytest.raises(tinyloop.ConfigError, match="cache_window"):
            tinyloop.resume_generate(handle, 5, G(max_tokens=4))


def test_grammar_and_early_exit(tiny_model):
    prompt = ids(22, 5)
    handle = tinyloop.build_resume_handle(tiny_model, prompt, 3)
    for cfg in (G(max_tokens=10, loops=3, grammar={"regex": "[a-z ]+"}),
                G(max_tokens=10, loops=7, grammar={"json_schema": {"type": "object"}}),
                G(max_tokens=10, loops=9, early_exit_threshold=0.5)):
        ref = tinyloop.generate(tiny_model, prompt, cfg)
        out = tinyloop.resume_generate(handle, cfg.loops, cfg)
        assert out.tokens == ref.tokens and out.stats.stop_reason == ref.stats.stop_reason
        assert out.stats.loops_mean == ref.stats.loops_mean


def test_one_token_prompt(make_artifact):
    model = tinyloop.load_model(make_artifact(n_prelude=0, n_coda=0, injection="none", exit_gate=True), 64)
    handle = tinyloop.build_resume_handle(model, [7], 2)
    for loops in (2, 6):
        out = tinyloop.resume_generate(handle, loops, G(max_tokens=6))
        assert out.tokens == tinyloop.generate(model, [7], G(max_tokens=6, loops=loops)).tokens


def test_rules(tiny_model, make_artifact):
    with pytest.raises(tinyloop.ConfigError, match="l_used"):
        tinyloop.build_resume_handle(tiny_model, ids(5, 1), 0)
    with pytest.raises(tinyloop.ConfigError, match="loops"):
        tinyloop.resume_generate(tinyloop.build_resume_handle(tiny_model, ids(5, 1), 2), 17)
    handle = tinyloop.build_resume_handle(tiny_model, ids(12, 6), 2)
    with pytest.raises(tinyloop.ModeError, match="Beam"):
        tinyloop.resume_generate(handle, 4, G(beam_size=2))
    with pytest.raises(tinyloop.ConfigError, match="max_seq_len"):
        tinyloop.resume_generate(handle, 4, G(max_tokens=250))
    with pytest.raises(tinyloop.HandleError, match="ResumeHandle"):
        tinyloop.resume_generate(tinyloop.create_prefix_cache(tiny_model, [1, 2], 2), 4)

    def reenter(token, index):
        with pytest.raises(tinyloop.BusyError, match="ResumeHandle is already in use"):
            tinyloop.resume_generate(handle, 8, G(max_tokens=2))
        return False

    out = tinyloop.resume_generate(handle, 4, G(max_tokens=4), on_token=reenter)
    assert out.stats.stop_reason == "cancelled"
    tinyloop.free_handle(handle)
    assert handle.nbytes == 0
    with pytest.raises(tinyloop.HandleError, match="freed"):
        tinyloop.resume_generate(handle, 4)


def test_freed_model(make_artifact):
    model = tinyloop.load_model(make_artifact(), 64)
    handle = tinyloop.build_resume_handle(model, ids(10, 7), 2)
    tinyloop.free_model(model)
    with pytest.raises(tinyloop.HandleError, match="free_model"):
        tinyloop.resume_generate(handle, 4)


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_handle_bytes_match_memory_plan(make_artifact, mode):
    model = tinyloop.load_model(make_artifact(), 64, cache_mode=mode)
    cfg, prompt = model.cfg, ids(24, 8)
    handle = tinyloop.build_resume_handle(model, prompt, cfg.max_loops)  # the deepest, largest handle
    per_slot, d_bytes = tinyloop.bytes_per_token_slot(cfg, mode, 4), 4
    held_slots = cfg.n_slots() - cfg.n_coda  # the coda's entries are recomputed on every resume
    blocks = -(-len(prompt) // BLOCK_TOKENS)  # whole blocks of the pool
    assert handle.nbytes == blocks * BLOCK_TOKENS * held_slots * per_slot + len(prompt) * 2 * cfg.d_model * d_bytes
    plan = tinyloop.plan_memory(model, max_handles=3, handle_tokens=len(prompt))
    assert handle.nbytes <= plan.per_handle_bytes


MODE_SETTINGS = {"fp16": {}, "int8": {}, "int4": {}, "grammar": dict(grammar={"regex": "[a-z ]+"}),
                 "cache_window": dict(cache_window=8), "beam": dict(beam_size=2)}


@pytest.mark.parametrize("mode", tinyloop.modes.MODES)
def test_mode_matrix_prefix_and_warm_start_columns(make_artifact, mode):
    """Each row of the matrix, read from the data: a "yes" cell runs and equals generate, a "no" raises ModeError."""
    model = tinyloop.load_model(make_artifact(), 64, cache_mode=mode if mode in tinyloop.CACHE_MODES else "fp16")
    prefix, suffix = ids(14, 9), ids(3, 10)
    cfg = G(max_tokens=5, loops=3, **MODE_SETTINGS[mode])
    pc = tinyloop.create_prefix_cache(model, prefix, 3)
    pool = tinyloop.create_prefix_pool(1)
    tinyloop.register_prefix(pool, model, prefix, 3)
    handle = tinyloop.build_resume_handle(model, prefix + suffix, 2, cache_window=cfg.cache_window)
    calls = {"prefix": [lambda: tinyloop.generate_from_prefix_cache(model, pc, suffix, cfg),
                        lambda: tinyloop.generate_with_pool(model, pool, prefix + suffix, cfg)],
             "warm_start": [lambda: tinyloop.resume_generate(handle, 3, cfg)]}
    for column, fns in calls.items():
        for fn in fns:
            if tinyloop.MATRIX[(mode, column)] == "no":
                with pytest.raises(tinyloop.ModeError, match=f"{mode} x {column}"):
                    fn()
            else:
                assert fn().tokens == tinyloop.generate(model, prefix + suffix, cfg).tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_refine_reuses_the_draft(mode):
    # the bundled model's drafts at 4 loops mostly agree with 16, so a refine takes many tokens from drafts
    model = tinyloop.load_model(None, 256, cache_mode=mode)
    prompt = "def fibonacci(n):\n    "
    handle = tinyloop.build_resume_handle(model, prompt, 4)
    cfg = G(max_tokens=20)
    draft = tinyloop.resume_generate(handle, 4, cfg)
    assert draft.stats.draft_reused_tokens == 0 and handle.draft == draft.tokens
    again = tinyloop.resume_generate(handle, 4, cfg)  # the same call again: every token is verified in chunks
    assert again.tokens == draft.tokens and again.stats.draft_reused_tokens == len(draft.tokens) - 1
    # greedy refine: self-speculation drafted at the handle's depth, continued to 16 loops
    refined = tinyloop.resume_generate(handle, 16, cfg)
    assert refined.tokens == tinyloop.generate(model, prompt, G(max_tokens=20, loops=16)).tokens
    st = refined.stats
    assert (st.draft_loops, st.verify_loops, st.draft_ahead) == (4, 16, 6) and st.skipped_loops == 4 * handle_len(model, prompt)
    assert st.draft_reused_tokens == st.accepted > 0 and st.verify_steps < len(refined.tokens)
    # a sampled refine follows the last output (the greedy refine) while its tokens agree with it
    sampled = G(max_tokens=20, loops=16, temperature=0.5, seed=1)
    out = tinyloop.resume_generate(handle, 16, sampled)
    assert out.tokens == tinyloop.generate(model, prompt, sampled).tokens
    assert out.stats.draft_reused_tokens == min(common_prefix(out.tokens, refined.tokens), len(out.tokens) - 1)


def test_greedy_refine_verifies_a_right_draft_in_growing_pieces(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    prompt, cfg = ids(12, 6), G(max_tokens=40)
    answer = tinyloop.generate(model, prompt, G(max_tokens=40, loops=6)).tokens
    reused = []
    for draft in (answer, [], answer[:9] + [(answer[9] + 1) % 64] + answer[10:]):
        handle = tinyloop.build_resume_handle(model, prompt, 2)
        handle.draft = draft  # as if the draft at 2 loops had produced it
        out = tinyloop.resume_generate(handle, 6, cfg)
        assert out.tokens == answer
        reused.append(out.stats.draft_reused_tokens)
        if draft == answer:  # pieces of 4, 8, 16, 32 tokens, one verification each
            assert out.stats.verify_steps <= 4, out.stats.verify_steps
    # a wrong draft: drafting takes over after it (or plain rows, where drafting rounds do not pay)
    assert reused[0] > max(reused[1:]), reused


def test_a_greedy_refine_verifies_its_guess_inside_a_busy_batch(bundled_model, monkeypatch):
    """A greedy refine beside other lanes verifies pieces of its last answer in their step: rows of their token step
    (one C call of every loop) beside fixed-depth rows, rows of their loop iterations' C call beside rows exiting
    early. Its tokens are plain decode's at its depth, it takes tokens from the guess, and the rows beside it are
    exact."""
    from tinyloop.engine.executor import Executor
    from tinyloop.kernels import cpu_block
    shared, beside_rows = [], []
    with_chunks, until = Executor.with_chunks, cpu_block.DecodeStep.iterate_until
    monkeypatch.setattr(Executor, "with_chunks", lambda self, *a: shared.append(with_chunks(self, *a)) or shared[-1])

    def counting(self, *a, verify=None, **k):
        if verify is not None:
            beside_rows.append(verify.count(False))
        return until(self, *a, verify=verify, **k)
    monkeypatch.setattr(cpu_block.DecodeStep, "iterate_until", counting)
    model, prompt = bundled_model, "def fibonacci(n):\n    "
    for threshold in (0.0, 0.05):
        shared.clear(), beside_rows.clear()
        handle = tinyloop.build_resume_handle(model, prompt, 4)
        tinyloop.resume_generate(handle, 4, G(max_tokens=20))  # its answer at 4 loops: the guess
        others = G(max_tokens=30, loops=16, early_exit_threshold=threshold)
        sched = tinyloop.Scheduler(model, 4)
        beside = [sched.submit(f"def f{i}(x):\n", others) for i in range(3)]
        refine = sched.resume(handle, G(max_tokens=20, loops=16))
        while not sched.idle():
            sched.step()
        got = refine.result()
        assert got.tokens == tinyloop.generate(model, prompt, G(max_tokens=20, loops=16)).tokens
        assert got.stats.draft_reused_tokens > 0
        assert [s.result().tokens for s in beside] == [
            tinyloop.generate(model, f"def f{i}(x):\n", others).tokens for i in range(3)]
        if threshold:
            assert not any(shared) and beside_rows and max(beside_rows) > 0, beside_rows
        else:
            assert any(shared) and not beside_rows


def handle_len(model, prompt) -> int:
    return len(model.encode_prompt(prompt))


def test_any_draft_keeps_the_output_exact(tiny_model):
    prompt = ids(16, 9)
    handle = tinyloop.build_resume_handle(tiny_model, prompt, 2)
    for guess, cfg in ((ids(30, 1), G(max_tokens=12, loops=6)),
                       (None, G(max_tokens=12, loops=6)),  # the right answer as the draft
                       (ids(5, 2), G(max_tokens=12, loops=5, temperature=0.9, top_k=20, seed=4, repetition_penalty=1.2)),
                       (None, G(max_tokens=12, loops=5, temperature=0.9, top_k=20, seed=4, repetition_penalty=1.2)),
                       (None, G(max_tokens=12, loops=5, stop_sequences=[[tiny_model.encode_prompt(ids(1, 3))[0]]])),
                       (None, G(max_tokens=12, loops=4, grammar={"regex": "[a-z ]+"}))):
        ref = tinyloop.generate(tiny_model, prompt, cfg)
        if guess is None:  # the last call's output is the draft; make it this call's answer
            handle.draft = ref.tokens + [1, 2, 3]
        else:
            handle.draft = guess
        out = tinyloop.resume_generate(handle, cfg.loops, cfg)
        assert out.tokens == ref.tokens and out.stats.stop_reason == ref.stats.stop_reason
        if guess is None and cfg.grammar is None:
            assert out.stats.draft_reused_tokens == min(len(ref.tokens), cfg.max_tokens - 1)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_a_handle_runs_the_prompt_in_the_runners_pieces(make_artifact, mode):
    """A prompt longer than the prefill chunk is built and deepened piece by piece through the loop-range forward, cut
    where generate's prefill cuts it: every resume, deeper or shallower than the handle, equals generate."""
    model = tinyloop.load_model(make_artifact(), 128, cache_mode=mode)
    model.prefill_chunk = 8
    prompt = ids(30, 17)
    handle = tinyloop.build_resume_handle(model, prompt, 3)
    assert len(handle.pieces()) == 4
    for loops in (5, 6, 2, 6):
        cfg = G(max_tokens=10, loops=loops)
        assert tinyloop.resume_generate(handle, loops, cfg).tokens == tinyloop.generate(model, prompt, cfg).tokens
    assert handle.depth == 6
