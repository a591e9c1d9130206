"""Self-speculative and tree-speculative decoding: exactness against plain generate, the loop-steps it saves,
rollback, the sampled distribution, mode guards, the pattern-5 helper, and beta."""
import collections
import dataclasses
import math

import pytest
import torch

import tinyloop
from tinyloop import GenerateConfig, SpeculativeConfig, generate, generate_speculative
from tinyloop.errors import ConfigError, ModeError
from tinyloop.model import LoopedLM
from tinyloop.sampling import filter_logits
from tinyloop.speculative import ChainModel, best_length, choose_speculative, speculative_from_env
from scripts.train import measure_beta

PROMPT = [5, 9, 14, 3, 22, 40, 7]


def same_as_plain(model, sc: SpeculativeConfig, **cfg):
    sc = dataclasses.replace(sc, fallback=False)  # every decode step a round, however fast (the mechanics tested)
    g = GenerateConfig(**{"max_tokens": 24, "loops": sc.verify_loops, **cfg})
    plain, spec = generate(model, PROMPT, g), generate_speculative(model, PROMPT, sc, g)
    assert plain.stats.generated_tokens > 3, "precondition: the model must not stop at once"
    assert spec.tokens == plain.tokens
    assert spec.text == plain.text and spec.stats.stop_reason == plain.stats.stop_reason
    return plain, spec


# --- greedy exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("width", [1, 3])
def test_greedy_equals_plain_generate_in_every_cache_mode(make_artifact, mode, width):
    model = tinyloop.load_model(make_artifact(), 128, cache_mode=mode)
    _, spec = same_as_plain(model, SpeculativeConfig(2, 6, 4, width), repetition_penalty=1.3)
    assert spec.stats.verify_steps >= 1 and spec.stats.drafted >= spec.stats.accepted >= 0


@pytest.mark.parametrize("mode", ["fp16", "int4"])
def test_greedy_with_a_sliding_window_rolls_the_ring_back(make_artifact, mode):
    """A window smaller than the drafts: rejected drafts must not evict or shadow what the window still needs."""
    model = tinyloop.load_model(make_artifact(), 128, cache_mode=mode)
    for window, ahead in ((5, 3), (3, 6)):
        _, spec = same_as_plain(model, SpeculativeConfig(2, 6, ahead), cache_window=window, max_tokens=30)
        assert spec.stats.accepted < spec.stats.drafted  # some drafts were rejected and rolled back


@pytest.mark.parametrize("overrides", [
    dict(state_init="normal", init_sigma=0.7),
    dict(state_init="embed", injection="add"),
    dict(n_prelude=2, n_core=4, n_coda=2, sandwich_norm=True, tie_embeddings=False, n_kv_heads=1),
])
def test_greedy_exact_across_architectures(make_artifact, overrides):
    model = tinyloop.load_model(make_artifact(**overrides), 128)
    for width in (1, 2):
        same_as_plain(model, SpeculativeConfig(3, 5, 3, width))


@pytest.mark.parametrize("width", [1, 3])
def test_every_choice_follows_the_samplers_adjustments(bundled_model, width):
    """Drafts, acceptance and corrections choose by the sampler's rules (tinyloop/sampling.py) on the same adjusted
    logits as plain decode: a greedy lane's presence and frequency penalties and logit bias (not only its repetition
    penalty) hold in verification too, so its output is plain decode's; a sampled lane's min_p filters its drafts and
    targets (min_p 1 keeps the most likely token alone: plain decode's tokens again)."""
    m, sc = bundled_model, SpeculativeConfig(2, 8, 4, width)
    cfgs = [GenerateConfig(max_tokens=20, loops=8, presence_penalty=0.4, logit_bias={7: 1.0}),
            GenerateConfig(max_tokens=20, loops=8, frequency_penalty=0.5),
            GenerateConfig(max_tokens=20, loops=8, temperature=1.0, min_p=1.0, seed=3)]
    for prompt in ("def f(x):", "import os\n", "class Point:\n    x"):
        for cfg in cfgs:
            assert generate_speculative(m, prompt, sc, cfg).tokens == generate(m, prompt, cfg).tokens, (prompt, cfg)


def test_drafts_and_verification_follow_weight_updates(make_artifact):
    """Drafts and verification run the C step built from the model's fused weights (kept per model): an in-place
    change of the model's parameters must reach it (else verification would use the old weights)."""
    model = tinyloop.load_model(make_artifact(), 128)
    sc, cfg = SpeculativeConfig(2, 6, 4), GenerateConfig(max_tokens=16, loops=6)
    assert generate_speculative(model, PROMPT, sc, cfg).tokens == generate(model, PROMPT, cfg).tokens
    with torch.no_grad():
        model.net.embed.weight.mul_(-2.0)  # the tied head: logits change sign and scale
        model.net.core[0].mlp.w_up.weight.mul_(3.0)
    plain = generate(model, PROMPT, cfg)
    assert generate_speculative(model, PROMPT, sc, cfg).tokens == plain.tokens


def test_tree_accepts_more_than_the_chain_on_the_same_model(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    _, chain = same_as_plain(model, SpeculativeConfig(2, 8, 4, 1), max_tokens=40)
    _, tree = same_as_plain(model, SpeculativeConfig(2, 8, 4, 4), max_tokens=40)
    assert tree.stats.tokens_per_verify > chain.stats.tokens_per_verify


def test_stop_sequences_and_streaming_match_plain(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    base = dict(max_tokens=12, loops=6, repetition_penalty=1.5)
    first = generate(model, PROMPT, GenerateConfig(**base)).tokens
    stop = first[5:7]  # a token stop sequence that completes inside a speculative round
    g = GenerateConfig(**base, stop_sequences=[stop])
    streamed, plain_streamed = [], []
    spec = generate_speculative(model, PROMPT, SpeculativeConfig(2, 6, 4), g, on_token=lambda t, i: streamed.append(t))
    plain = tinyloop.generate_stream(model, PROMPT, g, on_token=lambda t, i: plain_streamed.append(t))
    assert spec.tokens == plain.tokens == streamed == plain_streamed and len(spec.tokens) <= 5
    assert spec.stats.stop_reason == plain.stats.stop_reason == "stop_sequence"
    cancel = lambda t, i: i < 2
    cancelled = generate_speculative(model, PROMPT, SpeculativeConfig(2, 6, 4), GenerateConfig(**base), on_token=cancel)
    assert cancelled.tokens == tinyloop.generate_stream(model, PROMPT, GenerateConfig(**base), cancel).tokens == first[:3]
    assert cancelled.stats.stop_reason == "cancelled"


def test_verification_has_the_bits_of_plain_decode(make_artifact, monkeypatch):
    """On the CPU drafts and verification run the C step of plain decode (engine/forward.py: forward_loops): the
    logits verification computes for each committed position are plain decode's, bit for bit."""
    from tinyloop.engine import forward as paged
    monkeypatch.setenv("TINYLOOP_RUN_AHEAD", "0")  # plain decode's logits come back to Python, a token a step
    model = tinyloop.load_model(make_artifact(state_init="normal"), 128)
    D, V = 2, 6
    plain_logits, verified = {}, {}
    real_rows, real_lane = paged.decode_rows, paged.LoopForward.rows

    def rows(net, tokens, positions, loops, cache):
        out = real_rows(net, tokens, positions, loops, cache)
        plain_logits[positions[0]] = out[0].clone()
        return out

    def lane(self, positions, first, last, latent, tokens=None, head=True, lanes=None):
        out = real_lane(self, positions, first, last, latent, tokens, head, lanes)
        if first == D and last == V:
            assert self.plan is not None  # the C step
            verified.update((p, out[0, i].clone()) for i, p in enumerate(positions))
        return out

    monkeypatch.setattr(paged, "decode_rows", rows)
    monkeypatch.setattr(paged.LoopForward, "rows", lane)
    _, spec = same_as_plain(model, SpeculativeConfig(D, V, 4), max_tokens=30)
    committed = range(len(PROMPT), len(PROMPT) + spec.stats.generated_tokens - 1)
    assert spec.stats.accepted < spec.stats.drafted  # some drafts were rejected
    assert all(torch.equal(verified[p], plain_logits[p]) for p in committed)


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_greedy_through_the_triton_kernels(make_artifact, monkeypatch, mode):
    """TINYLOOP_TRITON=1 (interpreted without a GPU): drafts of one token run the Triton decode kernels, chunks the
    torch block; the tokens are plain decode's through the same kernels."""
    if not torch.cuda.is_available():  # (before triton is imported: it decides then whether it interprets)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TINYLOOP_TRITON", "1")
    import tinyloop.kernels.attention as attention
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = tinyloop.load_model(make_artifact(n_core=1, max_loops=4, default_loops=3), 64, device=dev,
                                dtype=torch.float32, cache_mode=mode)
    calls = []
    real = attention.decode_attention_triton
    monkeypatch.setattr(attention, "decode_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = GenerateConfig(max_tokens=8, loops=3)
    plain = generate(model, PROMPT, g)
    spec = generate_speculative(model, PROMPT, SpeculativeConfig(1, 3, 3), g)
    assert spec.tokens == plain.tokens and len(calls) > 7 * 5  # the plain steps' calls, and the drafts'


# --- the draft's loops are reused, not recomputed ------------------------------------------------------------
def test_verification_continues_the_drafted_states(make_artifact):
    """Every token pushed through a round gets exactly draft_loops while drafting and verify - draft loops
    while verifying: verify_loops loop-steps in all, as plain decode, never draft + verify."""
    model = tinyloop.load_model(make_artifact(), 128)
    D, V = 2, 8
    _, spec = same_as_plain(model, SpeculativeConfig(D, V, 4), max_tokens=30)
    st = spec.stats
    assert st.stop_reason == "max_tokens"
    pushed = st.drafted + st.verify_steps  # each chain round: the root plus its drafts
    assert st.draft_loop_steps == D * pushed
    assert st.verify_loop_steps == (V - D) * pushed
    assert st.loop_steps == V * pushed < (D + V) * pushed
    # accounting: the first token comes from the prefill, each round yields its accepted drafts plus one
    assert st.generated_tokens == 1 + st.accepted + st.verify_steps
    assert st.tokens_per_verify == pytest.approx((st.accepted + st.verify_steps) / st.verify_steps)
    assert st.draft_accept_rate == pytest.approx(st.accepted / st.drafted)


# --- early exit ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,width,window", [("int8", 1, 0), ("int8", 3, 0), ("int8", 1, 5), ("fp16", 1, 0),
                                               ("fp16", 3, 0)])
def test_early_exit_composes_with_speculation(make_artifact, mode, width, window):
    """Per-token early exit while drafting and verifying gives plain early-exit decode's tokens and loops (fp16: one
    loop at a time through the C step, for the tokens still looping)."""
    model = tinyloop.load_model(make_artifact(), 128, cache_mode=mode)
    plain, spec = same_as_plain(model, SpeculativeConfig(3, 8, 3, width), early_exit_threshold=0.6, cache_window=window,
                                max_tokens=30, repetition_penalty=1.3)
    assert spec.stats.loops_mean == pytest.approx(plain.stats.loops_mean)
    assert spec.stats.loops_mean < 8  # tokens did exit early
    pushed = spec.stats.verify_steps + spec.stats.drafted * width  # roots plus every drafted tree token
    assert spec.stats.loop_steps < 8 * pushed


def test_exit_gate_model(make_artifact):
    model = tinyloop.load_model(make_artifact(n_prelude=0, n_coda=0, injection="none", exit_gate=True), 128)
    prompt = [30, 31, 32]
    g = GenerateConfig(max_tokens=16, loops=6)
    plain = generate(model, prompt, g)
    spec = generate_speculative(model, prompt, SpeculativeConfig(2, 6, 3), g)
    assert spec.tokens == plain.tokens and spec.stats.loops_mean == pytest.approx(plain.stats.loops_mean)


# --- sampled: the output keeps the target distribution ------------------------------------------------------
@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory, tiny_codec):
    """A small model whose 1-loop and 3-loop next-token distributions differ clearly (scaled embeddings)."""
    cfg = tinyloop.ModelConfig(vocab_size=320, d_model=32, n_heads=2, n_kv_heads=1, ffn_hidden=64, n_prelude=1, n_core=1,
                               n_coda=1, max_loops=4, default_loops=3, bos_id=tiny_codec.eos_id, eos_id=tiny_codec.eos_id)
    torch.manual_seed(1)
    net = LoopedLM(cfg.validate(), max_seq_len=8)
    with torch.no_grad():
        net.embed.weight.mul_(30)
    path = str(tmp_path_factory.mktemp("stat") / "peaked.tinyloop")
    tinyloop.save_artifact(path, net, tiny_codec)
    return tinyloop.load_model(path, 32)


def exact_joint(model, prompt, n_tokens: int, loops: int, top_k: int) -> dict[tuple, float]:
    """Probability of every first-n_tokens sequence under plain sampling (full recompute, no cache)."""
    out = {}

    def walk(seq, prob):
        if len(seq) == n_tokens:
            out[tuple(seq)] = prob
            return
        with torch.no_grad():
            logits = model.net(torch.tensor([prompt + seq]), loops)[0, -1]
        p = torch.softmax(filter_logits(logits, 1.0, top_k, 1.0), -1)
        for t in p.nonzero().flatten().tolist():
            walk(seq + [t], prob * float(p[t]))

    walk([], 1.0)
    return out


def chi_square(counts: collections.Counter, probs: dict[tuple, float], n: int) -> tuple[float, int]:
    """Pearson's statistic, pooling outcomes expected fewer than 5 times into one cell; (statistic, df)."""
    stat, pool_obs, pool_exp, cells = 0.0, 0, 0.0, 0
    for k, p in probs.items():
        if n * p < 5:
            pool_obs, pool_exp = pool_obs + counts[k], pool_exp + n * p
        else:
            stat, cells = stat + (counts[k] - n * p) ** 2 / (n * p), cells + 1
    pool_obs += sum(c for k, c in counts.items() if k not in probs)  # impossible outcomes land here
    if pool_exp > 0:
        stat, cells = stat + (pool_obs - pool_exp) ** 2 / pool_exp, cells + 1
    return stat, cells - 1


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("width,runs", [(1, 400), (2, 300)])
def test_sampled_output_keeps_the_target_distribution(peaked_model, width, runs):
    prompt, K, D, V, top_k = [5, 9, 14], 4, 1, 3, 2
    target, draft = exact_joint(peaked_model, prompt, K, V, top_k), exact_joint(peaked_model, prompt, K, D, top_k)
    counts, accept = collections.Counter(), []
    for seed in range(runs):
        r = generate_speculative(peaked_model, prompt, SpeculativeConfig(D, V, 2, width),
                                 GenerateConfig(max_tokens=K, loops=V, temperature=1.0, top_k=top_k, seed=seed))
        counts[tuple(r.tokens)] += 1
        accept.append(r.stats.draft_accept_rate)
    rate = sum(accept) / runs
    assert 0.2 < rate < 0.9, rate  # both acceptance and rejection (the residual) were exercised
    stat, df = chi_square(counts, target, runs)
    assert stat < chi2_critical(df), (stat, df)
    # the test has power: the draft's own distribution (what accepting everything would give) is rejected
    stat_q, df_q = chi_square(counts, draft, runs)
    assert stat_q > chi2_critical(df_q), (stat_q, df_q)


# --- guards and configuration --------------------------------------------------------------------------
def test_mode_matrix_guards(make_artifact):
    model = tinyloop.load_model(make_artifact(), 64)
    with pytest.raises(ModeError, match="Grammar.*Speculative"):
        generate_speculative(model, PROMPT, SpeculativeConfig(2, 4, 2), GenerateConfig(grammar=r"[a-z]+"))
    with pytest.raises(ModeError, match="Beam search.*Tree-speculative"):
        generate_speculative(model, PROMPT, SpeculativeConfig(2, 4, 2, 2), GenerateConfig(beam_size=2))
    with pytest.raises(ModeError, match="cache_window > 0.*Tree-speculative"):
        generate_speculative(model, PROMPT, SpeculativeConfig(2, 4, 2, 2), GenerateConfig(cache_window=8))


def test_config_errors_name_the_field(make_artifact):
    model = tinyloop.load_model(make_artifact(), 64)
    for sc, field in [(SpeculativeConfig(4, 4), "verify_loops"), (SpeculativeConfig(0, 4), "draft_loops"),
                      (SpeculativeConfig(2, 40), "verify_loops"), (SpeculativeConfig(2, 4, 0), "draft_ahead"),
                      (SpeculativeConfig(2, 4, 2, 0), "tree_width")]:
        with pytest.raises(ConfigError, match=field):
            generate_speculative(model, PROMPT, sc)
    with pytest.raises(ConfigError, match="draft_loops"):  # verify loops from GenerateConfig.loops
        generate_speculative(model, PROMPT, SpeculativeConfig(4), GenerateConfig(loops=3))


def test_environment_flag(make_artifact, monkeypatch):
    model = tinyloop.load_model(make_artifact(), 64)
    monkeypatch.setenv("TINYLOOP_SPECULATIVE", "2:5:3:2")
    assert speculative_from_env() == SpeculativeConfig(2, 5, 3, 2)
    res = generate_speculative(model, PROMPT, None, GenerateConfig(max_tokens=6))
    assert (res.stats.draft_loops, res.stats.verify_loops, res.stats.draft_ahead, res.stats.tree_width) == (2, 5, 3, 2)
    for bad in ("2:8", "a:b:c", "8:2:4"):
        monkeypatch.setenv("TINYLOOP_SPECULATIVE", bad)
        with pytest.raises(ConfigError, match="TINYLOOP_SPECULATIVE|verify_loops"):
            speculative_from_env()


def test_model_busy_and_freed(make_artifact):
    model = tinyloop.load_model(make_artifact(), 64)
    with model.busy():
        with pytest.raises(tinyloop.BusyError):
            generate_speculative(model, PROMPT, SpeculativeConfig(2, 4, 2))
    tinyloop.free_model(model)
    with pytest.raises(tinyloop.HandleError):
        generate_speculative(model, PROMPT, SpeculativeConfig(2, 4, 2))


# --- pattern 5 -----------------------------------------------------------------------------------------------
def test_choose_speculative_returns_its_measurements(make_artifact):
    model = tinyloop.load_model(make_artifact(), 64)
    prompts = [PROMPT, [40, 41, 42, 43]]
    cfg = GenerateConfig(max_tokens=8)
    pick = choose_speculative(model, prompts, SpeculativeConfig(2, 6, 3), cfg, min_speedup=0.0)
    assert pick.use_speculative and pick.speedup > 0
    assert len(pick.per_prompt) == 2 and all(r["plain_tokens"] == r["speculative_tokens"] for r in pick.per_prompt)
    assert pick.config.verify_loops == 6 and "->" in pick.line()
    assert [c["draft_loops"] for c in pick.candidates] == [1, 2, 3, 4]  # each measured, the best one picked
    best = max(pick.candidates, key=lambda c: c["predicted"])
    assert (pick.config.draft_loops, pick.config.draft_ahead) == (best["draft_loops"], best["draft_ahead"])
    assert all(0 <= c["accept"] <= 1 and c["draft_ms"] > 0 for c in pick.candidates)
    never = choose_speculative(model, prompts, SpeculativeConfig(2, 6, 3), cfg, min_speedup=1e9)
    assert not never.use_speculative
    assert never.use_speculative == (never.speedup > never.min_speedup)


def test_the_choice_follows_acceptance_and_costs():
    """choose_speculative's model: a round yields the accepted drafts and one token more, drafts stop after a doubtful
    one; the draft length with the most tokens per second wins, and where drafts are rarely accepted nothing pays
    (the choice is then plain decode)."""
    assert ChainModel(1.0).tokens(4) == 5 and ChainModel(0.5).tokens(2) == pytest.approx(1.75)
    assert ChainModel(0.5).drafts(3) == 3 and ChainModel(1.0, doubtful=0.5).drafts(3) == pytest.approx(1.75)
    # a doubtful first draft (half the time) ends the round after it: 1 + (0.5 * 1 + 0.5 * 0.5) + 0.5 * (...)
    assert ChainModel(1.0, 0.5, 0.5).tokens(2) == pytest.approx(1 + 0.75 + 0.5 * 0.75)
    costs = dict(draft_s=0.37, verify_s=lambda T: 0.65 + 0.12 * (T - 1), plain_s=1.0, max_ahead=12)
    n, speedup = best_length(ChainModel(0.93), **costs)
    assert 3 <= n <= 8 and 1.3 < speedup < 1.8
    assert best_length(ChainModel(0.97), **costs)[0] > n  # longer drafts where they are accepted more
    stopping = best_length(ChainModel(0.97, doubtful=0.15, alpha_doubtful=0.6), **costs)
    assert stopping[0] > n and stopping[1] > speedup  # doubtful drafts end chains: longer ones pay
    assert best_length(ChainModel(0.3), **costs)[1] < 1  # does not pay


# --- beta ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("default_loops", [2, 4])
def test_measure_beta_is_the_design_definition(make_artifact, default_loops):
    """beta = median over tokens of |s_L - s_{L-1}| / |s_{L-1} - s_{L-2}| at the default loop count L."""
    model = tinyloop.load_model(make_artifact(default_loops=default_loops, state_init="normal"), 256)
    net, L = model.net, default_loops
    data = torch.randint(0, 320, (600,), generator=torch.Generator().manual_seed(0))
    beta = measure_beta(net, data, seq_len=32, n_seqs=4)
    # by hand, step by step through the model's pieces, on the same calibration windows
    g = torch.Generator().manual_seed(99)
    starts = torch.randint(0, len(data) - 32, (4,), generator=g)
    x = torch.stack([data[s:s + 32] for s in starts])
    with torch.no_grad():
        step = net.make_step(torch.arange(32).expand(4, 32), 32)
        ctx = net.dense(step)
        e = net.encode(x, ctx)
        states = [net.init_state(e, step)]
        for k in range(L):
            states.append(net.loop(states[-1], e, k, ctx))
    ratio = (states[L] - states[L - 1]).norm(dim=-1) / (states[L - 1] - states[L - 2]).norm(dim=-1)
    assert beta == pytest.approx(float(ratio.flatten().median()), rel=1e-5)
    assert beta > 0


@pytest.mark.parametrize("lanes,beside", [("plain", "plain"), ("mixed", "plain"), ("mixed", "early exit"),
                                          ("chain and tree", "early exit, int8 cache")])
def test_speculative_lanes_verify_inside_a_busy_batch(bundled_model, monkeypatch, lanes, beside):
    """Beside other decode rows a speculative lane still speculates: it drafts before the step's forward and its
    drafted chunk is rows of that forward: a token step of every row (one C call of every loop) where the chunks and
    the rows all run at one depth, else rows of the step's loop iterations (one C call that ends only once the
    chunks' rows are done, each stopping by its lane's exit rule; a tree's rows each seeing their ancestors, by a
    mask per row), several lanes' chunks in one call. A greedy lane, early exit or not, chain or tree, gives plain
    decode's tokens and loops; a seeded sampled one, which speculates in every step, the tokens it gives alone; the
    rows beside them are exact too. Over an int8 cache, where the C step does not run, each chunk is verified by a
    forward of its own (Executor.verify_alone), with the same tokens."""
    m = tinyloop.load_model(None, 1024, cache_mode="int8") if "int8" in beside else bundled_model
    from tinyloop.engine.executor import Executor
    from tinyloop.kernels import cpu_block
    shared, calls = [], []  # with_chunks' answers; per C call with chunks' rows: (other rows, chunks, masks given)
    with_chunks, until = Executor.with_chunks, cpu_block.DecodeStep.iterate_until
    monkeypatch.setattr(Executor, "with_chunks", lambda self, *a: shared.append(with_chunks(self, *a)) or shared[-1])
    alone_verifies, verify_alone = [], Executor.verify_alone
    monkeypatch.setattr(Executor, "verify_alone", lambda self, c: alone_verifies.append(c) or verify_alone(self, c))

    def counting(self, cache, cells, done, tokens, exits, rows_lanes, *a, verify=None, masks=None, **k):
        if verify is not None:
            chunks = {lane for lane, v in zip(rows_lanes, verify) if v}
            calls.append((verify.count(False), len(chunks), masks is not None))
        return until(self, cache, cells, done, tokens, exits, rows_lanes, *a, verify=verify, masks=masks, **k)
    monkeypatch.setattr(cpu_block.DecodeStep, "iterate_until", counting)
    early = dict(early_exit_threshold=0.05)
    chain, tree = SpeculativeConfig(2, 8, 4), SpeculativeConfig(2, 8, 3, 2)
    plain, exiting = GenerateConfig(max_tokens=40, loops=8), GenerateConfig(max_tokens=40, loops=8, **early)
    spec = {"plain": [(plain, chain)], "chain and tree": [(plain, chain), (exiting, tree)],  # (request, speculation)
            "mixed": [(plain, chain), (exiting, chain), (exiting, tree),
                      (GenerateConfig(max_tokens=40, loops=8, temperature=0.8, seed=7, **early), chain)]}[lanes]
    others = GenerateConfig(max_tokens=40, loops=8) if beside == "plain" else \
        GenerateConfig(max_tokens=40, loops=16, **early)
    prompts = ["def f%d(x):\n    return x * %d\n" % (i, i) for i in range(len(spec) + 2)]
    sched = tinyloop.Scheduler(m, len(prompts))
    seqs = [sched.submit(p, cfg, speculative=sc) for p, (cfg, sc) in zip(prompts, spec)]
    seqs += [sched.submit(p, others) for p in prompts[len(spec):]]
    while not sched.idle():
        sched.step()
    res = [s.result() for s in seqs]
    for p, (cfg, sc), got in zip(prompts, spec, res):
        alone = generate(m, p, cfg) if cfg.temperature == 0 else generate_speculative(m, p, sc, cfg)
        assert (got.tokens, got.loops_used) == (alone.tokens, alone.loops_used), (cfg, sc)
        st = got.stats
        assert st.verify_steps and st.accepted and st.verify_steps < len(got.tokens) - 1  # rounds, drafts taken
        if cfg.early_exit_threshold:
            assert min(got.loops_used) < 8  # its tokens did exit early
    assert [(r.tokens, r.loops_used) for r in res[len(spec):]] == [
        (g.tokens, g.loops_used) for g in (generate(m, p, others) for p in prompts[len(spec):])]
    # the rounds ran inside the other rows' forward: their token step, or their loop iterations' C call
    if lanes == beside == "plain":
        assert shared and all(shared) and not calls
    elif "int8" in beside:
        assert not calls and {(c.exit is not None, c.width) for c in alone_verifies} >= {(False, 1), (True, 2)}
    else:
        assert not alone_verifies and calls and max(n for n, _, _ in calls) > 0, calls  # beside other rows
        assert max(k for _, k, _ in calls) > 1 and any(mask for _, _, mask in calls), calls  # chunks together, a tree
