"""tinyloop bench core: the engine core against an earlier revision of it, side by side in one run (issue 54's figures).

The same workloads run in this tree and in a baseline revision of this repository (TINYLOOP_BENCH_BASELINE, default
BEFORE_SPLIT: the last commit before the scheduler / executor split), extracted with `git archive` and run in
alternating subprocesses; best of the rounds. Every figure is tokens per second of the bundled model (greedy):
decode at batch 1 (8 loops) and in a 16-lane batch, a 256-token prefill, early exit (16 loops, threshold 0.05) at
batch 1 and 16, speculative decoding (draft 2, verify 8, ahead 4) alone and as one lane of a 16-lane batch (that
lane's own tokens per second of decode, beside 15 plain lanes), and a request asking each token's log-probability
and 5 alternatives at batch 1 and 16 (tok/s of the whole request). Each tree also says whether its tokens are those
of the other tree.
"""
from __future__ import annotations

import json
import os
import textwrap

from scripts.bench.engine import baseline_tree, run_script

BEFORE_SPLIT = "a1b2b15"  # the engine core before the scheduler / executor split (issue 54)

WORKLOADS = ["decode b1", "decode b16", "prefill 256", "early exit b1", "early exit b16", "speculative b1",
             "speculative in b16", "logprobs b1", "logprobs b16"]

CORE_SCRIPT = textwrap.dedent("""
    import json, sys, time, tinyloop
    from tinyloop.batch import Scheduler
    n = int(sys.argv[1])
    model = tinyloop.load_model(None, 1024)
    G, S = tinyloop.GenerateConfig, tinyloop.SpeculativeConfig
    prompts = ["def f%d(x):\\n    return x * %d\\n" % (i, i) for i in range(16)]
    long_prompt = " ".join("word%d" % i for i in range(400))
    ids = model.encode_prompt(long_prompt)[:256]
    plain, exits = G(max_tokens=n, loops=8), G(max_tokens=n, loops=16, early_exit_threshold=0.05)
    asking = G(max_tokens=n, loops=8, logprobs=5)
    spec = S(2, 8, 4)

    def one(cfg):
        t = time.perf_counter(); r = tinyloop.generate(model, prompts[0], cfg)
        return r.stats.generated_tokens / (time.perf_counter() - t), r.tokens

    def lanes(cfg):
        t = time.perf_counter(); rs = tinyloop.generate_batch(model, prompts, cfg)
        return sum(r.stats.generated_tokens for r in rs) / (time.perf_counter() - t), [r.tokens for r in rs]

    def prefill():
        r = tinyloop.generate(model, ids, G(max_tokens=1, loops=8))
        return r.stats.prompt_tokens / (r.stats.prefill_ms / 1000), r.tokens

    def speculative():
        r = tinyloop.generate_speculative(model, prompts[0], spec, plain)
        return r.stats.generated_tokens / (r.stats.decode_ms / 1000), r.tokens

    def speculative_in_batch():
        sched = Scheduler(model, 16)
        seqs = [sched.submit(p, plain, speculative=spec if i == 0 else None) for i, p in enumerate(prompts)]
        while not sched.idle():
            sched.step()
        r = seqs[0].result()
        return r.stats.generated_tokens / (r.stats.decode_ms / 1000), [s.result().tokens for s in seqs]

    runs = [lambda: one(plain), lambda: lanes(plain), prefill, lambda: one(exits), lambda: lanes(exits),
            speculative, speculative_in_batch, lambda: one(asking), lambda: lanes(asking)]
    for run in runs:
        run()  # warm-up: the first call of each shape pays for it
    print(json.dumps([run() for run in runs]))
""")


def bench_core(model_path: str | None, quick: bool) -> list[str]:
    rev = os.environ.get("TINYLOOP_BENCH_BASELINE", BEFORE_SPLIT)
    rounds, n = (2, 24) if quick else (5, 64)
    tree = baseline_tree(rev)
    runs = {"this tree": None} | ({rev: tree} if tree is not None else {})
    best = {name: [0.0] * len(WORKLOADS) for name in runs}
    tokens: dict[str, list] = {}
    for _ in range(rounds):
        for name, where in runs.items():
            out = json.loads(" ".join(run_script(CORE_SCRIPT, [str(n)], where)))
            best[name] = [max(b, tps) for b, (tps, _) in zip(best[name], out)]
            tokens[name] = [toks for _, toks in out]
    lines = [f"engine core, tok/s (bundled model, greedy, {n} tokens), best of {rounds} alternating rounds "
             f"(subprocesses), this tree against {rev}",
             f"  {'':<20} {'this tree':>10} {rev:>10} {'ratio':>7}  tokens"]
    for i, work in enumerate(WORKLOADS):
        now = best["this tree"][i]
        if tree is None:
            lines.append(f"  {work:<20} {now:>10.1f}")
            continue
        base = best[rev][i]
        same = tokens["this tree"][i] == tokens[rev][i]
        lines.append(f"  {work:<20} {now:>10.1f} {base:>10.1f} {now / base:>6.2f}x  {'same' if same else 'DIFFER'}")
    if tree is None:
        lines.append(f"  (no baseline: git revision {rev} not available here)")
    for name, fig in best.items():  # what a request asking log-probabilities costs against a plain one, same batch
        plain_b1, plain_b16, asking_b1, asking_b16 = (fig[WORKLOADS.index(w)] for w in
                                                      ("decode b1", "decode b16", "logprobs b1", "logprobs b16"))
        lines.append(f"  logprobs cost against plain, {name}: batch 1 {plain_b1 / asking_b1:.2f}x, "
                     f"batch 16 {plain_b16 / asking_b16:.2f}x (goal <= 1.1x)")
    return lines
