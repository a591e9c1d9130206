"""tinyloop bench speculative: self- and tree-speculative decoding against plain decode."""
from __future__ import annotations

from scripts.bench.prompts import LONG_CODE_PROMPTS
import time

from tinyloop.batch import Scheduler
from tinyloop.generation import generate
from tinyloop.loader import Model, load_model
from tinyloop.speculative import SpeculativeConfig, SpeculativeStats, choose_speculative, generate_speculative
from tinyloop.request import GenerateConfig

# the early-exit threshold of the batch line whose requests exit early (the bundled model at 8 loops)
EARLY_EXIT = 0.05


def sequential_passes(model: Model, st: SpeculativeStats) -> float:
    """Layer passes per generated token that must run one after another (a chunk counts once): what decode
    costs on a device where a step is bound by launches and weight reads, not by the tokens in the chunk."""
    c, D, V = model.cfg, st.draft_loops, st.verify_loops
    rounds, drafted = st.verify_steps, st.drafted
    passes = (drafted + rounds) * (c.n_prelude + D * c.n_core) + drafted * c.n_coda + rounds * ((V - D) * c.n_core + c.n_coda)
    return passes / max(st.generated_tokens - 1, 1)


def bench_speculative(model_path: str | None, quick: bool) -> list[str]:
    """Speculative (draft 1-3 -> verify 8, a few draft_ahead values, tree on and off) vs plain decode at 8 loops, and
    what choose_speculative picks."""
    model = load_model(model_path, 1024)
    n_tokens, prompts, repeats = (32, LONG_CODE_PROMPTS[:2], 1) if quick else (96, LONG_CODE_PROMPTS, 3)
    configs = [SpeculativeConfig(2, 8, a) for a in ((4, 8) if quick else (2, 4, 6, 8, 12))]
    configs += [] if quick else [SpeculativeConfig(1, 8, 6), SpeculativeConfig(3, 8, 8)]
    configs += [SpeculativeConfig(2, 8, a, w) for a, w in (((3, 2),) if quick else ((3, 2), (4, 2)))]
    cfg = GenerateConfig(max_tokens=n_tokens, loops=8)
    c = model.cfg
    best: dict = {}
    runs: dict = {}

    runners = [lambda p: generate(model, p, cfg)]
    runners += [lambda p, sc=sc: generate_speculative(model, p, sc, cfg) for sc in configs]
    for run in runners[:2]:
        run(prompts[0])  # warm-up
    for _ in range(repeats):  # side by side: every prompt runs plain and every config back to back
        for i, prompt in enumerate(prompts):
            for j, run in enumerate(runners):
                res = run(prompt)
                dt = res.stats.decode_ms / 1000  # the decode phase: the prompt's prefill is the same work in both
                if dt < best.get((j, i), float("inf")):
                    best[(j, i)], runs[(j, i)] = dt, res
    beta = model.info.beta
    lines = [f"speculative vs plain decode at 8 loops: greedy, {n_tokens} tokens x {len(prompts)} prompts, "
             f"decode tokens/s, best of {repeats}; beta {beta if beta is None else round(beta, 3)}",
             f"  {'config':<22} {'tok/s':>7} {'ratio':>6} {'accept':>7} {'tok/verify':>10} {'loop-steps/tok':>14} "
             f"{'passes/tok':>10} {'pass ratio':>10} {'exact':>5}"]
    plain_passes = c.n_prelude + 8 * c.n_core + c.n_coda
    plain_tps = None
    for j, sc in enumerate([None] + configs):
        toks = sum(runs[(j, i)].stats.generated_tokens for i in range(len(prompts)))
        tps = toks / sum(best[(j, i)] for i in range(len(prompts)))
        plain_tps = plain_tps or tps
        if sc is None:
            exact = all(runs[(j, i)].tokens == runs[(0, i)].tokens for i in range(len(prompts)))
            lines.append(f"  {'plain 8 loops':<22} {tps:>7.1f} {tps / plain_tps:>5.2f}x "
                         f"{'-':>7} {1.0:>10.2f} {8.0:>14.2f} {plain_passes:>10.2f} {1.0:>9.2f}x {'-':>5}")
            continue
        sts = [runs[(j, i)].stats for i in range(len(prompts))]
        drafted, accepted, rounds = sum(s.drafted for s in sts), sum(s.accepted for s in sts), sum(s.verify_steps for s in sts)
        steps = sum(s.loop_steps for s in sts) / sum(s.generated_tokens - 1 for s in sts)
        passes = sum(sequential_passes(model, s) * (s.generated_tokens - 1) for s in sts) / sum(s.generated_tokens - 1 for s in sts)
        exact = all(runs[(j, i)].tokens == runs[(0, i)].tokens for i in range(len(prompts)))
        name = f"{sc.draft_loops}->8 ahead {sc.draft_ahead}" + (f" tree {sc.tree_width}" if sc.tree_width > 1 else "")
        lines.append(f"  {name:<22} {tps:>7.1f} {tps / plain_tps:>5.2f}x {accepted / max(drafted, 1):>7.2f} "
                     f"{(accepted + rounds) / max(rounds, 1):>10.2f} {steps:>14.2f} {passes:>10.2f} "
                     f"{plain_passes / passes:>9.2f}x {'yes' if exact else 'NO':>5}")
    pick = choose_speculative(model, prompts, SpeculativeConfig(2, 8, 4), GenerateConfig(max_tokens=min(n_tokens, 48)))
    lines.append(f"  choose_speculative: {pick.line()}")
    lines += bench_in_a_batch(model, prompts, 16, n_tokens, 1 if quick else 3)
    lines += bench_in_a_batch(model, prompts, 16, n_tokens, 1 if quick else 3, EARLY_EXIT)
    lines.append("  plain = generate as shipped; ratios are against plain; chains stop drafting after a doubtful draft "
                 "(DRAFT_CONFIDENCE), so ahead is their longest")
    lines.append("  loop-steps/tok: core passes x tokens per generated token (verification continues the drafts, so a"
                 " chain\n  spends verify_loops per pushed token, like plain decode); passes/tok: sequential layer passes"
                 " per token,\n  the speedup bound on a launch-bound device where a chunk costs one token (pass ratio)")
    return lines


def bench_in_a_batch(model: Model, prompts: list[str], lanes: int, n_tokens: int, repeats: int,
                     early_exit: float = 0.0) -> list[str]:
    """One scheduler of `lanes` lanes (a worker's batch): `lanes` plain requests against `lanes - 1` plain and one
    speculative, alternating, best of `repeats`: output tokens per second of the whole batch, the tokens, and the
    speculative lane's own decode rate against the plain lanes' beside it. early_exit: every request's threshold
    (its tokens exit early, the batch runs by loop iterations)."""
    cfg = GenerateConfig(max_tokens=n_tokens, loops=8, early_exit_threshold=early_exit)
    sc = SpeculativeConfig(2, 8, 4)

    def batch(speculative: bool) -> tuple[float, list[list[int]], float, float]:
        sched = Scheduler(model, lanes)
        seqs = [sched.submit(prompts[i % len(prompts)], cfg, speculative=sc if speculative and i == 0 else None)
                for i in range(lanes)]
        t = time.perf_counter()
        while not sched.idle():
            sched.step()
        dt = time.perf_counter() - t
        rate = [r.stats.generated_tokens / (r.stats.decode_ms / 1000) for r in (s.result() for s in seqs)]
        return sum(s.count for s in seqs) / dt, [s.result().tokens for s in seqs], rate[0], sum(rate[1:]) / (lanes - 1)

    batch(True)  # warm-up
    best = {False: 0.0, True: 0.0}
    lane, beside = 0.0, 1.0  # the speculative lane's own decode rate and the plain lanes' beside it (its best run)
    tokens = {}
    for _ in range(repeats):
        for speculative in (False, True):
            tps, tokens[speculative], first, rest = batch(speculative)
            best[speculative] = max(best[speculative], tps)
            if speculative and first / rest > lane / beside:
                lane, beside = first, rest
    which = f", every request exiting early (threshold {early_exit})" if early_exit else ""
    return [f"  in one {lanes}-lane batch{which}: {lanes} plain {best[False]:.1f} tok/s, {lanes - 1} plain + 1 "
            f"speculative (2->8 ahead 4) {best[True]:.1f} tok/s = {best[True] / best[False]:.2f}x; tokens identical: "
            f"{'yes' if tokens[True] == tokens[False] else 'NO'}",
            f"  the speculative lane decodes at {lane:.1f} tok/s, the plain lanes beside it at {beside:.1f} (mean) in "
            f"the same batch: {lane / beside:.2f}x"]
