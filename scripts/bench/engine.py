"""tinyloop bench engine: what the paged block pool costs and what it buys, side by side in one run.

1. Decode speed before and after paging: the same workload (batch 1 and a 16-lane batch, greedy, 8 loops) run by
   this tree and by a baseline tree, in alternating subprocesses; best of the rounds. The baseline is a git revision
   of this repository (TINYLOOP_BENCH_BASELINE, default BEFORE_PAGING, the last commit with per-lane caches),
   extracted with `git archive`; without git the row is skipped and says so.
2. Sequences of 512 tokens held at once in a 256 MiB KV budget: paged (blocks for the loops a sequence runs) at 4
   and 16 loops, run for real with more lanes than fit, against the per-lane allocation of before (every lane got
   max_len x every slot of max_loops, whatever its loop count).
3. Peak memory under that load (RSS growth of the process) against what the plan set aside beside the weights.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from tinyloop.memory import plan_memory

BEFORE_PAGING = "01c3e61"  # per-lane KVCache allocations, before the engine core (issue 12)

DECODE_SCRIPT = textwrap.dedent("""
    import sys, time, torch, tinyloop
    model = tinyloop.load_model(None, 512)
    prompts = ["def f%d(x):\\n    return x * %d\\n" % (i, i) for i in range(16)]
    one = tinyloop.GenerateConfig(max_tokens=int(sys.argv[1]), loops=8)
    lanes = tinyloop.GenerateConfig(max_tokens=int(sys.argv[2]), loops=8)
    tinyloop.generate(model, prompts[0], tinyloop.GenerateConfig(max_tokens=4, loops=8))
    tinyloop.generate_batch(model, prompts[:2], tinyloop.GenerateConfig(max_tokens=4, loops=8))
    t = time.perf_counter(); r = tinyloop.generate(model, prompts[0], one); a = time.perf_counter() - t
    t = time.perf_counter(); rs = tinyloop.generate_batch(model, prompts, lanes); b = time.perf_counter() - t
    print(r.stats.generated_tokens / a, sum(x.stats.generated_tokens for x in rs) / b,
          ",".join(str(x) for x in r.tokens))
""")

HOLD_SCRIPT = textwrap.dedent("""
    import sys, torch, tinyloop
    loops, lanes, prompt_len, new = (int(x) for x in sys.argv[1:5])
    def rss():
        return int(open('/proc/self/statm').read().split()[1]) * 4096
    probe = tinyloop.load_model(None, 512)
    weights = tinyloop.plan_memory(probe, max_seq_len=512)
    budget = weights.bytes_of("weights") + weights.bytes_of("workspace") + 256 * 2**20
    del probe
    model = tinyloop.load_model(None, 512, memory_budget=budget)
    tinyloop.generate(model, "x", tinyloop.GenerateConfig(max_tokens=2, loops=loops))
    base, peak, running = rss(), [0], {}
    def seen(lane, token, index):
        running[lane] = index
        peak.append(rss())
        return True
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(prompt_len)] for i in range(lanes)]
    out = tinyloop.generate_batch(model, prompts, tinyloop.GenerateConfig(max_tokens=new, loops=loops), seen)
    pool = model.pool
    print(pool.num_blocks, pool.peak_used, pool.block_bytes, sum(r.stats.preempted for r in out),
          max(peak) - base, budget - weights.bytes_of("weights"))
""")


def baseline_tree(rev: str) -> Path | None:
    """A directory holding the baseline revision's `tinyloop` package, or None without git or that revision."""
    root = Path(__file__).resolve().parents[2]  # the repository: scripts/bench/engine.py
    out = Path(tempfile.mkdtemp(prefix="tinyloop-baseline-"))
    try:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, "tinyloop"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out


def run_script(script: str, args: list[str], tree: Path | None = None) -> list[str]:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         cwd=str(tree) if tree is not None else None, timeout=1800)
    if res.returncode:
        raise RuntimeError(f"bench subprocess failed:\n{res.stderr[-2000:]}")
    return res.stdout.split()


def bench_engine(model_path: str | None, quick: bool) -> list[str]:
    rev = os.environ.get("TINYLOOP_BENCH_BASELINE", BEFORE_PAGING)
    rounds, n_one, n_lanes = (2, 32, 16) if quick else (3, 96, 32)
    lines = [f"decode tok/s, bundled model at 8 loops, best of {rounds} alternating rounds (subprocesses)",
             f"  {'':<24} {'batch 1':>9} {'16 lanes':>9}"]
    tree = baseline_tree(rev)
    runs = {"paged (this tree)": None} | ({f"before ({rev})": tree} if tree is not None else {})
    best: dict[str, list[float]] = {k: [0.0, 0.0] for k in runs}
    tokens: dict[str, str] = {}
    for _ in range(rounds):
        for name, where in runs.items():
            one, lanes, toks = run_script(DECODE_SCRIPT, [str(n_one), str(n_lanes)], where)
            best[name] = [max(best[name][0], float(one)), max(best[name][1], float(lanes))]
            tokens[name] = toks
    for name in runs:
        lines.append(f"  {name:<24} {best[name][0]:>9.1f} {best[name][1]:>9.1f}")
    if tree is None:
        lines.append(f"  (no baseline: git revision {rev} not available here)")
    else:
        base = best[f"before ({rev})"]
        now = best["paged (this tree)"]
        same = tokens[f"before ({rev})"] == tokens["paged (this tree)"]
        lines.append(f"  {'paged / before':<24} {now[0] / base[0]:>8.2f}x {now[1] / base[1]:>8.2f}x"
                     f"   greedy tokens {'identical' if same else 'DIFFER'}")

    prompt_len, new = (240, 16) if quick else (480, 32)
    seq = prompt_len + new
    lines.append(f"\nsequences of {seq} tokens held at once in a 256 MiB KV budget (bundled model, fp32 entries)")
    lines.append(f"  {'':<34} {'4 loops':>8} {'16 loops':>9}")
    import torch

    from tinyloop.cache import bytes_per_token_slot
    from tinyloop.memory import blocks_for
    from tinyloop.loader import load_model, pool_blocks_for
    model = load_model(model_path, 512)
    cfg, plan = model.cfg, plan_memory(model, max_seq_len=512)
    budget = plan.bytes_of("weights") + plan.bytes_of("workspace") + 256 * 2**20
    blocks = pool_blocks_for(cfg, "fp16", torch.float32, model.device, 512, plan.bytes_of("weights"), budget)
    per_lane = 512 * cfg.n_slots() * bytes_per_token_slot(cfg, "fp16", 4)  # before: max_len x every slot of max_loops
    before = (256 * 2**20) // per_lane
    held, memory = {}, {}
    for loops in (4, 16):
        fits = blocks // blocks_for(cfg, seq, loops)
        out = run_script(HOLD_SCRIPT, [str(loops), str(fits + 4), str(prompt_len), str(new)])
        n_blocks, peak_blocks, _, preempted, growth, beside = map(int, out)
        held[loops] = (fits, peak_blocks, n_blocks, preempted)
        memory[loops] = (growth, beside)
    lines.append(f"  {'paged (lanes that fit the pool)':<34} {held[4][0]:>8} {held[16][0]:>9}")
    lines.append(f"  {'per-lane allocation (before)':<34} {before:>8} {before:>9}")
    lines.append(f"  {'paged / before':<34} {held[4][0] / before:>7.2f}x {held[16][0] / before:>8.2f}x")
    for loops in (4, 16):
        fits, peak_blocks, blocks, preempted = held[loops]
        growth, beside = memory[loops]
        lines.append(f"  {loops:>2} loops: {fits + 4} lanes run, pool peak {peak_blocks}/{blocks} blocks, {preempted} "
                     f"preemptions; RSS growth {growth / 2**20:.1f} MiB vs {beside / 2**20:.1f} MiB set aside "
                     f"(pool + workspace) = {growth / beside:.2f}")
    return lines
