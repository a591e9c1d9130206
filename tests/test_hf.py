"""Checkpoint directories (Ouro, Huginn, Parcae, Nanbeige4.2) against the reference code's recorded outputs (tests/data/hf).

The tiny checkpoints and `<arch>_reference.*` were made by scripts/make_hf_fixtures.py with the reference modeling
code on transformers 4.56.2; the suite needs neither. Everything runs in fp32 from the bf16 weights (the reference
ran fp32 on the same values) with the random initial states (Huginn, Parcae) at init_scale 0 (a zero state: the
reference's deterministic output; Parcae's reference was run with state_init "zero" for it).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tinyloop
from tinyloop.chat import apply_chat_template, chat_ids
from tinyloop.hf import convert, read_hf_config

DATA = Path(__file__).parent / "data" / "hf"
ARCHS = ("ouro", "huginn", "parcae", "nanbeige")
CHAT = ("ouro", "huginn", "nanbeige")  # the checkpoints with a chat template (Parcae's base models have none)
TOL = 1e-4


def reference(arch: str) -> tuple[dict, dict]:
    return load_file(str(DATA / f"{arch}_reference.safetensors")), json.loads((DATA / f"{arch}_reference.json").read_text())


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(arch):
    return tinyloop.load_model(DATA / f"{arch}-tiny", 256, dtype=torch.float32, init_scale=0.0)


@pytest.fixture(scope="module")
def converted(arch, tmp_path_factory):
    """The same checkpoint through `tinyloop convert` and the .tinyloop loader."""
    out = convert(DATA / f"{arch}-tiny", tmp_path_factory.mktemp("conv") / f"{arch}.tinyloop", progress=False)
    return tinyloop.load_model(out, 256, dtype=torch.float32, init_scale=0.0)


def greedy(max_tokens=16, **kw) -> tinyloop.GenerateConfig:
    return tinyloop.GenerateConfig(max_tokens=max_tokens, temperature=0.0, **kw)


# --- parity with the reference --------------------------------------------------------------------------------

def test_logits_equal_the_reference_at_every_loop_count(model, arch):
    ref, meta = reference(arch)
    diffs = {L: float((tinyloop.score(model, meta["prompts"]["a"], L) - ref[f"logits_L{L}"]).abs().max())
             for L in range(1, meta["max_loops"] + 1)}
    print(arch, "max |logit - reference| by loops:", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) < TOL, diffs
    assert model.cfg.max_loops == meta["max_loops"]


def test_greedy_continuation_equals_the_reference_with_its_cache(model, converted, arch):
    _, meta = reference(arch)
    for key, want in meta["greedy"].items():
        name, loops = key.split("_L")
        prompt = meta["prompts"][name]
        cfg = greedy(loops=int(loops), ignore_eos=True)  # (the references ran without an EOS)
        assert tinyloop.generate(model, prompt, cfg).tokens == want, key
        assert tinyloop.generate(converted, prompt, cfg).tokens == want, key


def test_cached_decode_equals_full_recompute(model, arch):
    _, meta = reference(arch)
    prompt = meta["prompts"]["c"]
    for loops in (1, 3, model.cfg.max_loops):
        out = tinyloop.generate(model, prompt, greedy(24, loops=loops)).tokens
        logits = tinyloop.score(model, prompt + out, loops)
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


def test_exit_choices_equal_the_reference(model, arch):
    """Ouro: the exit gate's cumulative distribution picks each token's step (every loop still runs, so K/V and the
    chosen logits are the reference's). Huginn: latent-difference adaptive compute, skipped loops' K/V are the last
    loop's (the reference's "latest-m4" cache lookup)."""
    ref, meta = reference(arch)
    for key, rec in meta["exit"].items():
        threshold = float(key[1:])
        loops = 4 if arch == "ouro" else 8
        res = tinyloop.generate(model, meta["prompts"]["b"], greedy(loops=loops, early_exit_threshold=threshold))
        assert res.tokens == rec["greedy_b"], key
        if arch == "huginn":  # the prompt runs every loop; each later token's forward exits where the reference's did
            assert res.loops_used == [loops] + rec["steps"], key
        else:  # every position of a forward chooses its step (the prompt included): logits of the chosen steps
            x = torch.tensor([meta["prompts"]["a"]])
            with torch.inference_mode():
                got = model.net(x, loops, exit_threshold=threshold)[0]
            assert float((got - ref[f"exit_logits_{key}"]).abs().max()) < TOL, key
    plain = tinyloop.generate(model, meta["prompts"]["b"], greedy(loops=4))
    assert plain.loops_used == [4] * 16  # no threshold: every loop, as the reference's default (Ouro: 1.0)


# --- tokenizer and chat template ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", CHAT, scope="module")
def test_tokenizer_and_chat_template_render_as_transformers_does(model, arch):
    _, meta = reference(arch)
    for text, ids in meta["tokens"].items():
        assert model.codec.encode(text) == ids
    chat = meta["chat"]
    assert apply_chat_template(model, chat["messages"]) == chat["text"]
    assert chat_ids(model, chat["messages"]) == chat["ids"]
    eos = {"ouro": "<|im_end|>", "huginn": "<|end_text|>", "nanbeige": "<|im_end|>"}[arch]
    assert model.eos_id == model.codec.tokenizer.token_to_id(eos)


def test_converted_artifact_keeps_tokenizer_and_template(converted, model, arch):
    _, meta = reference(arch)
    for text, ids in meta["tokens"].items():
        assert converted.codec.encode(text) == ids
    if "chat" in meta:
        assert chat_ids(converted, meta["chat"]["messages"]) == meta["chat"]["ids"]
    assert converted.cfg == model.cfg == read_hf_config(DATA / f"{arch}-tiny").__class__(**{
        **read_hf_config(DATA / f"{arch}-tiny").to_dict(), "init_sigma": 0.0})
    assert converted.info.provenance["source"] == "huggingface" and converted.info.provenance["model_type"] == (
        {"huginn": "huginn_raven"}.get(arch, arch))


# --- runtime features on converted models ---------------------------------------------------------------------

def test_batched_prompts_of_different_lengths_are_exact(converted, arch):
    _, meta = reference(arch)
    prompts = [meta["prompts"][k] for k in ("a", "b", "c")]
    alone = [tinyloop.generate(converted, p, greedy(12, loops=3)).tokens for p in prompts]
    batched = [r.tokens for r in tinyloop.generate_batch(converted, prompts, greedy(12, loops=3))]
    assert batched == alone


def test_prefix_reuse_warm_start_and_speculative_equal_plain_generate(converted, arch):
    _, meta = reference(arch)
    prefix, suffix = meta["prompts"]["c"], meta["prompts"]["b"]
    want = tinyloop.generate(converted, prefix + suffix, greedy(12, loops=4)).tokens
    cache = tinyloop.create_prefix_cache(converted, prefix, 4)
    assert tinyloop.generate_from_prefix_cache(converted, cache, suffix, greedy(12, loops=4)).tokens == want
    tinyloop.free_handle(cache)
    if converted.cfg.value_embeds:  # continuing latent states without the tokens: refused clearly (docs/hf.md)
        sc = tinyloop.SpeculativeConfig(draft_loops=2, verify_loops=4, draft_ahead=3)
        with pytest.raises(tinyloop.ModeError, match="value embeddings"):
            tinyloop.generate_speculative(converted, prefix + suffix, sc, greedy(12))
        return
    handle = tinyloop.build_resume_handle(converted, prefix + suffix, 2)
    assert tinyloop.resume_generate(handle, 4, greedy(12)).tokens == want
    sc = tinyloop.SpeculativeConfig(draft_loops=2, verify_loops=4, draft_ahead=3)
    assert tinyloop.generate_speculative(converted, prefix + suffix, sc, greedy(12)).tokens == want
    tinyloop.free_handle(handle)


def test_window_and_beam_on_converted_models(converted, arch):
    _, meta = reference(arch)
    prompt = meta["prompts"]["a"]
    want = tinyloop.generate(converted, prompt, greedy(12, loops=3)).tokens
    assert tinyloop.generate(converted, prompt, greedy(12, loops=3, cache_window=64)).tokens == want
    beam = tinyloop.generate(converted, prompt, greedy(8, loops=3, beam_size=3))

    def logprob(out):  # the sequence's log-probability by a full recompute
        lp = torch.log_softmax(tinyloop.score(converted, prompt + out, 3), -1)
        return sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out))
    # Each hypothesis is scored exactly over the forked loop-aware cache, best first. (A beam need not beat greedy:
    # the greedy path can be pruned, as it is on nanbeige-tiny, whose beam ends 0.2 nats below greedy.)
    assert [h.tokens for h in beam.n_best][0] == beam.tokens
    assert all(abs(h.logprob - logprob(h.tokens)) < 1e-4 for h in beam.n_best)
    assert [h.score for h in beam.n_best] == sorted((h.score for h in beam.n_best), reverse=True)


def test_cache_modes_on_converted_models(arch):
    """fp16 is exact; int8 and int4 (store-h) approximate it: the cached next-token distribution along a greedy
    output stays within a small total-variation distance of a full recompute (bounds measured: 0.001 / 0.022)."""
    from tinyloop.engine.runner import Runner

    _, meta = reference(arch)
    prompt = meta["prompts"]["c"]
    exact = tinyloop.load_model(DATA / f"{arch}-tiny", 128, dtype=torch.float32, init_scale=0.0)
    out = tinyloop.generate(exact, prompt, greedy(12, loops=3)).tokens
    modes = (("fp16", 1e-5), ("int8", 0.01), ("int4", 0.05))
    if exact.cfg.qk_norm:  # int4 store-h recomputes K from h by wk alone: refused for normalised keys
        with pytest.raises(tinyloop.ConfigError, match="int4"):
            tinyloop.load_model(DATA / f"{arch}-tiny", 128, cache_mode="int4")
        modes = modes[:2]
    for mode, bound in modes:
        m = tinyloop.load_model(DATA / f"{arch}-tiny", 128, dtype=torch.float32, init_scale=0.0, cache_mode=mode)
        assert tinyloop.generate(m, prompt, greedy(4, loops=3)).stats.cache_mode == mode
        for i in (0, 5, 11):
            ids = prompt + out[:i]
            cache = m.new_cache(1, 128).reserve_all()
            runner = Runner(m, cache, 3)
            with torch.inference_mode():
                runner.prefill(ids[:-1], 0)
                row, _ = runner.decode([ids[-1]], [len(ids) - 1])
            cache.reset()
            p, q = torch.softmax(tinyloop.score(exact, ids, 3)[-1], -1), torch.softmax(row[0].float(), -1)
            assert 0.5 * float((p - q).abs().sum()) < bound, (mode, i)


# --- precision, init scale, errors ----------------------------------------------------------------------------

def test_bf16_weights_stay_bf16_unless_asked(arch):
    _, meta = reference(arch)
    m = tinyloop.load_model(DATA / f"{arch}-tiny", 128, init_scale=0.0)
    assert m.dtype == torch.bfloat16 and m.pool.dtype == torch.bfloat16
    ref, _ = reference(arch)
    got = tinyloop.score(m, meta["prompts"]["a"], 4)
    assert got.dtype == torch.float32
    assert float((got - ref["logits_L4"]).abs().max()) < 0.25  # bf16 arithmetic: close, not exact
    assert (got.argmax(-1) == ref["logits_L4"].argmax(-1)).float().mean() >= 0.75


def test_huginn_init_scale():
    _, meta = reference("huginn")
    p = meta["prompts"]["a"]
    default = tinyloop.load_model(DATA / "huginn-tiny", 64, dtype=torch.float32)
    assert default.cfg.init_sigma == pytest.approx((2 / 5) ** 0.5)  # std sqrt(2/(5d)) x embed scale sqrt(d)
    zero = tinyloop.load_model(DATA / "huginn-tiny", 64, dtype=torch.float32, init_scale=0.0)
    assert not torch.allclose(tinyloop.score(default, p, 2), tinyloop.score(zero, p, 2))
    assert torch.equal(tinyloop.score(default, p, 2), tinyloop.score(default, p, 2))  # fixed noise per position
    noise = default.net.init_noise[:256]
    assert float(noise.abs().max()) <= 3 * default.cfg.init_sigma + 1e-6  # truncated at 3 std, as the reference
    with pytest.raises(tinyloop.ConfigError, match="init_scale"):
        tinyloop.load_model(DATA / "huginn-tiny", 64, init_scale=-1.0)


def broken(tmp_path: Path, arch: str) -> Path:
    d = tmp_path / arch
    shutil.copytree(DATA / f"{arch}-tiny", d)
    return d


def test_unsupported_model_type_names_it_and_the_supported_ones(tmp_path):
    d = broken(tmp_path, "ouro")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(tinyloop.ArtifactError, match=r"model_type 'gpt_neox'.*ouro, huginn_raven, parcae, nanbeige, llama"):
        tinyloop.load_model(d)


def test_missing_shard_tensor_tokenizer_and_bad_shape_or_dtype(tmp_path):
    d = broken(tmp_path, "huginn")
    (d / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(tinyloop.ArtifactError, match=r"missing shard.*model-00002-of-00004"):
        tinyloop.load_model(d)

    d = broken(tmp_path / "t", "ouro")
    (d / "tokenizer.json").unlink()
    with pytest.raises(tinyloop.ArtifactError, match="no tokenizer.json"):
        tinyloop.load_model(d)

    d = broken(tmp_path / "s", "ouro")
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    save_file({**tensors, name: tensors[name][:-1].contiguous()}, str(d / "model.safetensors"))
    with pytest.raises(tinyloop.ArtifactError, match=r"up_proj.weight gives core.1.mlp.w_up.weight of shape \(159, 64\)"):
        tinyloop.load_model(d)

    save_file({k: v.float() for k, v in tensors.items()}, str(d / "model.safetensors"))
    with pytest.raises(tinyloop.ArtifactError, match="dtype torch.float32, config.json declares torch.bfloat16"):
        tinyloop.load_model(d)

    save_file({k: v for k, v in tensors.items() if "early_exit_gate" not in k}, str(d / "model.safetensors"))
    with pytest.raises(tinyloop.ArtifactError, match=r"weights missing for \['exit_gate.bias', 'exit_gate.weight'\]"):
        tinyloop.load_model(d)

    save_file({**tensors, "model.extra.weight": tensors[name].clone()}, str(d / "model.safetensors"))
    with pytest.raises(tinyloop.ArtifactError, match="unexpected tensor 'model.extra.weight'"):
        tinyloop.load_model(d)


def test_inspect_config_only_plans_the_real_models_without_weights():
    from scripts.inspect_model import config_text
    text = config_text(str(DATA / "configs" / "huginn-0125"))
    assert "parameters: 3,564,976,800" in text and "32 loops (132 KV slots per token)" in text
    # fp16 cache at bf16: 2 (K, V) x 5280 x 2 bytes x 132 slots per token
    assert f"{2 * 5280 * 2 * 132 / 1024:.1f} KiB" in text
    assert "parameters: 1,434,652,673" in config_text(str(DATA / "configs" / "ouro-1.4b"))
    # Nanbeige4.2-3B: 22 layers run twice (44 KV slots), 8 KV heads of 128: 2 x 8 x 128 x 2 bytes x 44 per token
    text = config_text(str(DATA / "configs" / "nanbeige4.2-3b"))
    assert "parameters: 4,169,800,704" in text and "2 loops (44 KV slots per token)" in text
    assert f"{2 * 8 * 128 * 2 * 44 / 1024:.1f} KiB" in text
    # Parcae, as its reference counts them (parcae_lm's model on the meta device; the tied head counted once)
    for size, n in (("140m", 144_323_136), ("370m", 388_003_328), ("770m", 776_655_680), ("1.3b", 1_338_591_744)):
        text = config_text(str(DATA / "configs" / f"parcae-{size}"))
        assert f"parameters: {n:,}" in text and "8 loops" in text and "int4" in text and "not for this model" in text


def served(engine, op: str, params: dict) -> dict:
    """One request through the worker engine's batch, as the worker's compute loop runs it."""
    assert engine.join("k", op, params, None, lambda: False)
    while True:
        for _, out in engine.step():
            assert isinstance(out, dict), out
            return out


@pytest.mark.parametrize("arch", CHAT, scope="module")
def test_the_worker_serves_a_converted_chat_model(converted, arch):
    """The service's chat op renders the checkpoint's template, encodes it as transformers does and generates."""
    from workers.engine import ModelEngine

    _, meta = reference(arch)
    engine = ModelEngine(converted, max_handles=2, plan_bytes=0, model_name=f"{arch}-tiny")
    out = served(engine, "chat", {"messages": meta["chat"]["messages"], "max_tokens": 8, "temperature": 0.0,
                                  "loops": 3, "logprobs": True})
    assert out["prompt_text"] == meta["chat"]["text"]
    assert out["tokens"] == tinyloop.generate(converted, meta["chat"]["ids"], greedy(8, loops=3)).tokens


@pytest.mark.parametrize("arch", ["parcae"], scope="module")
def test_the_worker_serves_a_converted_base_model(converted, arch):
    from workers.engine import ModelEngine

    engine = ModelEngine(converted, max_handles=2, plan_bytes=0, model_name=f"{arch}-tiny")
    out = served(engine, "generate", {"prompt": "hello world", "max_tokens": 8, "temperature": 0.0, "loops": 4})
    assert out["tokens"] == tinyloop.generate(converted, "hello world", greedy(8, loops=4)).tokens


def test_grammar_constrains_a_converted_model(converted):
    import re

    res = tinyloop.generate(converted, "x", greedy(24, loops=2, grammar={"regex": r"[a-z]{3,6}@[a-z]{2,5}\.com"}))
    assert re.fullmatch(r"[a-z]{3,6}@[a-z]{2,5}\.com", res.text), res.text


def test_command_line_convert_inspect_and_chat(tmp_path):
    import subprocess
    import sys

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "scripts.cli", *args], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out
    art = tmp_path / "h.tinyloop"
    assert "wrote" in cli("convert", str(DATA / "huginn-tiny"), str(art)).stdout
    text = cli("inspect", "--config-only", str(art)).stdout
    assert "embed_scale" in text and "weights bfloat16" in text and "int4" in text
    out = cli("generate", "--model", str(art), "--chat", "Hi", "--max-tokens", "4", "--init-scale", "0")
    assert out.stdout.startswith("<|begin_text|><|begin_header|>user<|end_header|>\n\nHi<|end_turn|>")
    bad = subprocess.run([sys.executable, "-m", "scripts.cli", "convert", str(tmp_path), str(art)], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "no config.json" in bad.stderr and "Traceback" not in bad.stderr


def test_ouro_exit_can_skip_the_loops_after_the_exit(tmp_path):
    """`convert --exit-kv copy`: an exited token runs no further loops (its K/V there are copies). Its first decoded
    token sees the same cache as in the reference's mode, so it exits at the same loop."""
    _, meta = reference("ouro")
    art = convert(DATA / "ouro-tiny", tmp_path / "o.tinyloop", progress=False, exit_kv="copy")
    skip = tinyloop.load_model(art, 128, dtype=torch.float32)
    exact = tinyloop.load_model(DATA / "ouro-tiny", 128, dtype=torch.float32)
    cfg = greedy(12, loops=4, early_exit_threshold=0.3)
    a, b = tinyloop.generate(skip, meta["prompts"]["b"], cfg), tinyloop.generate(exact, meta["prompts"]["b"], cfg)
    assert skip.cfg.exit_kv == "copy" and a.tokens[0] == b.tokens[0] and a.loops_used[1] == b.loops_used[1] < 4
    with pytest.raises(tinyloop.ConfigError, match="cannot override"):
        convert(DATA / "ouro-tiny", tmp_path / "x.tinyloop", progress=False, d_model=8)


def test_speculative_with_ouro_exit_rule_is_refused_clearly():
    ouro = tinyloop.load_model(DATA / "ouro-tiny", 64, dtype=torch.float32)
    sc = tinyloop.SpeculativeConfig(draft_loops=2, verify_loops=4, draft_ahead=3)
    with pytest.raises(tinyloop.ModeError, match="cdf exit rule"):
        tinyloop.generate_speculative(ouro, [5, 6, 7], sc, greedy(4, early_exit_threshold=0.5))


# --- Parcae ---------------------------------------------------------------------------------------------------

def test_parcae_like_init_state_is_the_references():
    """Its random initial state ("like-init"): the std and the 3-std cut of the reference's draw; with the
    reference's own draw in place of TinyLoop's, the logits are the reference's (the diagonal injection's decay then
    acts on a non-zero state from the first loop)."""
    ref, meta = reference("parcae")
    m = tinyloop.load_model(DATA / "parcae-tiny", 64, dtype=torch.float32)
    sigma, drawn = m.cfg.init_sigma, ref["state0"]
    assert sigma == pytest.approx((2 / (5 * 64)) ** 0.5) and float(drawn.std()) == pytest.approx(sigma, rel=0.1)
    assert float(drawn.abs().max()) <= 3 * sigma and float(m.net.init_noise.abs().max()) <= 3 * sigma + 1e-6
    m.net.init_noise[:len(meta["prompts"]["a"])] = drawn
    assert float((tinyloop.score(m, meta["prompts"]["a"], 4) - ref["state0_logits_L4"]).abs().max()) < TOL


def test_parcae_value_embeddings_sit_where_the_reference_has_table_and_gate():
    from tinyloop.models.parcae import value_embed_layers
    assert value_embed_layers(2, 2, 2, 8, 4) == (1, 3, 5)  # the 140M config: every other layer, the last included
    # an odd core: tables alternate over 7 layers (0, 2, 4, 6), gates over ids counting the core 8 times (odd ids)
    assert value_embed_layers(2, 3, 2, 8, 4) == (6,)
    assert read_hf_config(DATA / "parcae-tiny").value_embeds == (1, 3, 5)


def test_parcae_lanes_at_their_own_depths_advance_by_loop_iterations(monkeypatch):
    """A model whose layers read the token at every loop (Parcae's value embeddings) takes loop iterations like any
    other, each pass given every row's token (engine/iteration.py's `looping`): lanes at different loop counts and one
    that may exit early, batched, each give the tokens and loop counts of the same request alone, and the passes ran."""
    from tinyloop.engine.executor import Executor
    m = tinyloop.load_model(DATA / "parcae-tiny", 128, dtype=torch.float32, init_scale=0.0)
    _, meta = reference("parcae")
    prompts = [meta["prompts"][k] for k in ("a", "b", "c")]
    cfgs = [greedy(10, loops=2), greedy(10, loops=5), greedy(10, loops=6, early_exit_threshold=0.3)]
    passes = [0]
    one_pass = Executor.one_pass
    monkeypatch.setattr(Executor, "one_pass", lambda *a: (passes.__setitem__(0, passes[0] + 1), one_pass(*a))[1])
    batched = tinyloop.generate_batch(m, prompts, cfgs)
    assert passes[0] > 0  # (before, such a model ran whole tokens only)
    for prompt, cfg, res in zip(prompts, cfgs, batched):
        alone = tinyloop.generate(m, prompt, cfg)
        assert (res.tokens, res.loops_used) == (alone.tokens, alone.loops_used)
    assert min(batched[2].loops_used) < 6  # (the threshold stopped its tokens early)


def test_parcae_options_it_lacks_and_unsafe_pickles_are_refused(tmp_path):
    for change, words in (({"num_key_value_heads": 2}, "grouped-query heads"),
                          ({"norm_class_name": "LayerNorm"}, "norm 'LayerNorm'"),
                          ({"recurrent_embedding_dimension": 128}, "recurrent block of another width")):
        d = broken(tmp_path / words.split()[0], "parcae")
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(tinyloop.ArtifactError, match=words):
            tinyloop.load_model(d)
    d = broken(tmp_path / "pickle", "parcae")
    torch.save({"transformer.wte.weight": _NotATensor()}, d / "pytorch_model.bin")  # weights_only=True refuses it
    with pytest.raises(tinyloop.ArtifactError, match="not a loadable torch pickle"):
        tinyloop.load_model(d)


class _NotATensor:
    pass


# --- Nanbeige4.2 -----------------------------------------------------------------------------------------------

def test_nanbeige_maps_its_loop_and_heads_and_refuses_what_the_published_config_leaves_off(tmp_path):
    """The whole stack looped num_loops times with the final norm closing every pass (or, skip_loop_final_norm, the
    last only), heads of their own width; the research options of its modeling code are refused by name."""
    cfg = read_hf_config(DATA / "nanbeige-tiny")
    assert (cfg.n_prelude, cfg.n_core, cfg.n_coda, cfg.default_loops, cfg.head_dim, cfg.q_dim) == (0, 3, 0, 2, 24, 96)
    assert cfg.loop_norm and not cfg.final_norm and cfg.torch_only() == ["head_size"]
    raw = json.loads((DATA / "nanbeige-tiny" / "config.json").read_text())
    for change, words in (({"skip_loop_final_norm": True}, None), ({"loop_loss_weights": [0.5, 0.5]}, None),
                          ({"loop_share_kv": True}, "loop_share_kv=true"),
                          ({"enable_hyper_connection": True}, "enable_hyper_connection=true"),
                          ({"emb_neighbor_num": 3}, "emb_neighbor_num 3")):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**raw, **change}))
        if words:
            with pytest.raises(tinyloop.ArtifactError, match=words):
                read_hf_config(d)
        elif "skip_loop_final_norm" in change:
            assert not read_hf_config(d).loop_norm and read_hf_config(d).final_norm
        else:
            assert read_hf_config(d).default_loops == 3  # len(loop_loss_weights) + 1, as its _get_num_loops


@pytest.mark.parametrize("arch", ["parcae", "nanbeige"], scope="module")
def test_every_weight_format_runs_the_new_families(model, arch):
    """bf16, int8 and int4 weights (their fields beyond the original family included: value-embedding gates, the
    readout, heads of their own width) stay close to fp32: the next-token distributions of a prompt stay within a
    total-variation bound (measured: int8 0.005 / 0.007, int4 0.073 / 0.085; Ouro's int4 is 0.040)."""
    _, meta = reference(arch)
    prompt = meta["prompts"]["a"]
    exact = torch.softmax(tinyloop.score(model, prompt, 2), -1)
    for fmt, bound in (("bf16", 0.02), ("int8", 0.02), ("int4", 0.15)):
        m = tinyloop.load_model(DATA / f"{arch}-tiny", 64, dtype=torch.float32, init_scale=0.0, weights=fmt)
        tv = float((torch.softmax(tinyloop.score(m, prompt, 2), -1) - exact).abs().sum(-1).max()) / 2
        assert tv < bound, (fmt, tv)
        assert len(tinyloop.generate(m, prompt, greedy(4, loops=2)).tokens) == 4
