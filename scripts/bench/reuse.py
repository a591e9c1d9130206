"""`tinyloop bench` sections for cache reuse and warm start, each measured side by side in one run.

cache_reuse: time to first token with a PrefixPool hit versus a plain prefill, for a long shared scaffold
             and short suffixes (whole calls with max_tokens=1, wall clock, best of the repeats).
warm_start:  a draft at 4 loops then a refine at 16, through one ResumeHandle (build 4, resume 4, resume 16)
             versus generate at 4 then a fresh generate at 16, on a prompt-heavy request; then the same with a
             32-token answer, where the refine also reuses the draft (self-speculation from the handle's depth).
"""
from __future__ import annotations

import time

import torch

from tinyloop.generation import GenerateConfig, generate
from tinyloop.prefix import create_prefix_pool, generate_with_pool, register_prefix
from tinyloop.resume import build_resume_handle, resume_generate
from tinyloop.loader import Model, load_model

SCAFFOLD = ('"""Project conventions for every answer."""\n'
            "import os\nimport sys\nfrom dataclasses import dataclass\n\n\n"
            "@dataclass\nclass Request:\n    prompt: str\n    max_tokens: int = 64\n    temperature: float = 0.0\n\n\n"
            "def read_config(path: str) -> dict:\n    with open(path) as f:\n        return dict(line.split('=', 1) for line in f)\n\n\n")
SUFFIXES = ["def fibonacci(n):\n    ", "class Stack:\n    def push(self, x):\n", "def parse(text):\n    return ",
            "for i in range(10):\n    print("]


def scaffold_ids(model: Model, n_tokens: int) -> list[int]:
    text, ids = SCAFFOLD, model.codec.encode(SCAFFOLD)
    while len(ids) < n_tokens:
        text += SCAFFOLD
        ids = model.codec.encode(text)
    return ids[:n_tokens]


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_cache_reuse(model_path: str | None, quick: bool) -> list[str]:
    n_scaffold, repeats = (384, 2) if quick else (896, 3)
    model = load_model(model_path, 1024)
    loops = model.cfg.default_loops
    scaffold = scaffold_ids(model, n_scaffold)
    pool = create_prefix_pool(4)
    t_register, _ = best_of(lambda: register_prefix(pool, model, scaffold, loops), 1)
    cfg = GenerateConfig(max_tokens=1, loops=loops)
    generate(model, scaffold[:32], cfg)  # warm up
    lines = [f"time to first token, {n_scaffold}-token scaffold + short suffix, loops {loops}, cache {model.cache_mode} "
             f"(ms, best of {repeats}; register once: {t_register * 1000:.0f} ms)",
             f"  {'suffix':>6} {'plain':>9} {'pool hit':>9} {'speedup':>8} {'same token':>10}"]
    ratios = []
    for suffix in SUFFIXES:
        ids = scaffold + model.codec.encode(suffix)
        t_plain, plain = best_of(lambda: generate(model, ids, cfg), repeats)
        t_pool, hit = best_of(lambda: generate_with_pool(model, pool, ids, cfg), repeats)
        assert hit.stats.prefix_hit_tokens == n_scaffold
        ratios.append(t_plain / t_pool)
        lines.append(f"  {len(ids) - n_scaffold:>6} {t_plain * 1000:>9.1f} {t_pool * 1000:>9.1f} {t_plain / t_pool:>7.1f}x "
                     f"{'yes' if plain.tokens == hit.tokens else 'NO':>10}")
    st = pool.stats
    lines.append(f"  mean speedup {sum(ratios) / len(ratios):.1f}x; pool: {st.entries} entry, {st.hits} hits, "
                 f"{st.misses} misses, {st.bytes / 2**20:.1f} MiB")
    return lines


def bench_warm_start(model_path: str | None, quick: bool) -> list[str]:
    n_prompt, n_tokens, repeats = (256, 4, 1) if quick else (896, 4, 2)  # prompt-heavy: decode is not skipped
    model = load_model(model_path, 1024)
    ids = scaffold_ids(model, n_prompt)
    generate(model, ids[:32], GenerateConfig(max_tokens=2, loops=4))  # warm up
    cfg = GenerateConfig(max_tokens=n_tokens)
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    same = True

    def run(name: str, fn):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        wall.setdefault(name, []).append(time.perf_counter() - t)
        cpu.setdefault(name, []).append(time.process_time() - c)
        return out

    for _ in range(repeats):  # interleaved, so drifting machine load hits both sides alike
        ref = {L: run(f"gen{L}", lambda: generate(model, ids, GenerateConfig(max_tokens=n_tokens, loops=L))).tokens
               for L in (4, 8, 16)}
        for chain in ((4, 16), (4, 8, 16)):
            handle = run(f"build{chain}", lambda: build_resume_handle(model, ids, 4))
            for L in chain:
                out = run(f"res{chain}{L}", lambda: resume_generate(handle, L, cfg))
                same &= out.tokens == ref[L]
            skipped = out.stats.skipped_loops
    c = model.cfg
    passes = lambda L: c.n_prelude + L * c.n_core + c.n_coda  # layer passes per prompt token at L loops
    lines = [f"warm start, {n_prompt}-token prompt, {n_tokens} new tokens, cache {model.cache_mode} "
             f"(best of {repeats}; wall-clock s, and process CPU s in brackets)"]
    for chain in ((4, 16), (4, 8, 16)):
        lines.append(f"  draft @4 then upgrade {' -> '.join(map(str, chain[1:]))}:")
        b = {k: (min(wall[k]), min(cpu[k])) for k in wall}
        fresh = [b[f"gen{L}"] for L in chain]
        warm = [b[f"build{chain}"]] + [b[f"res{chain}{L}"] for L in chain]
        lines.append("    fresh generate each: " + " + ".join(f"@{L} {w:.2f}" for L, (w, _) in zip(chain, fresh))
                     + f" = {sum(w for w, _ in fresh):.2f} [{sum(x for _, x in fresh):.2f}]")
        lines.append(f"    one handle: build@4 {warm[0][0]:.2f} + " + " + ".join(f"resume@{L} {w:.2f}" for L, (w, _) in zip(chain, warm[1:]))
                     + f" = {sum(w for w, _ in warm):.2f} [{sum(x for _, x in warm):.2f}]")
        up_w = [warm[i + 2][0] / fresh[i + 1][0] for i in range(len(chain) - 1)]
        up_c = [warm[i + 2][1] / fresh[i + 1][1] for i in range(len(chain) - 1)]
        bound = [1 - (passes(chain[i + 1]) - passes(chain[i]) + c.n_coda) / passes(chain[i + 1]) for i in range(len(chain) - 1)]
        lines.append("    each upgrade vs a fresh generate at its depth: " + ", ".join(
            f"@{chain[i + 1]} {1 - w:.1%} [{1 - x:.1%}] saved (layer passes skipped {bd:.1%})"
            for i, (w, x, bd) in enumerate(zip(up_w, up_c, bound))))
        fw, ww = sum(w for w, _ in fresh), sum(w for w, _ in warm)
        fc, wc = sum(x for _, x in fresh), sum(x for _, x in warm)
        lines.append(f"    whole sequence: {1 - ww / fw:.1%} wall-clock [{1 - wc / fc:.1%} CPU] saved")
    lines.append(f"  outputs equal generate at every depth: {'yes' if same else 'NO'}; last skipped_loops {skipped}")
    lines += refine_with_answer(model, n_prompt, 8 if quick else 32, repeats)
    return lines


def refine_with_answer(model: Model, n_prompt: int, n_tokens: int, repeats: int) -> list[str]:
    """Draft @4 then refine @16 with a longer answer: besides the prompt's loops, the greedy refine decodes by
    self-speculation from the handle's depth following the draft, so its saving depends on how far the depths agree."""
    fresh = refine = 0.0
    reused = produced = 0
    same = True
    for suffix in SUFFIXES:
        ids = scaffold_ids(model, n_prompt) + model.codec.encode(suffix)
        cfg = GenerateConfig(max_tokens=n_tokens)
        t_fresh = t_refine = float("inf")
        for _ in range(repeats):  # interleaved
            t, ref = best_of(lambda: generate(model, ids, GenerateConfig(max_tokens=n_tokens, loops=16)), 1)
            t_fresh = min(t_fresh, t)
            handle = build_resume_handle(model, ids, 4)
            resume_generate(handle, 4, cfg)  # the draft
            t, out = best_of(lambda: resume_generate(handle, 16, cfg), 1)
            t_refine = min(t_refine, t)
        same &= out.tokens == ref.tokens
        fresh, refine = fresh + t_fresh, refine + t_refine
        reused, produced = reused + out.stats.draft_reused_tokens, produced + len(out.tokens)
    return [f"  draft @4 then refine @16 with a {n_tokens}-token answer, {len(SUFFIXES)} prompts ({n_prompt}-token scaffold + "
            f"suffix): fresh generate @16 {fresh:.2f} s, refine via the handle {refine:.2f} s: {1 - refine / fresh:.1%} "
            f"saved; {reused} of the {produced} answer tokens came from accepted drafts; "
            f"equal to generate: {'yes' if same else 'NO'}"]


# --- prefix_cache: automatic prefix caching, 4 scaffolds x N suffixes ---------------------------------------------
ENDINGS = ["\n\n", " ", ": ", "\n    "]  # where the tokenizer merges a scaffold's last token with what follows


def prefix_workload(n_suffixes: int, seed: int = 0) -> tuple[list[str], list[tuple[int, str]]]:
    """4 scaffolds (about 330 tokens of the bundled model each, distinct from the first line, ending in whitespace or
    punctuation) and the prompts scaffold + suffix, n_suffixes per scaffold, in a shuffled order: (scaffold, prompt)."""
    import random

    names = ["Alpha", "Bravo", "Charlie", "Delta"]  # distinct from the first token: no scaffold shares a block
    scaffolds = [f'{name} project conventions.\n' + (SCAFFOLD * 3).rstrip() + end
                 for name, end in zip(names, ENDINGS)]
    forms = ["def task_{j}(x):\n    return x * {j}", "print({j})", "x_{j} = [{j}, {j}]", "class C{j}:\n    pass",
             "import os  # {j}", "\n# step {j}", "    return {j}", "value: int = {j}"]
    suffixes = [forms[j % len(forms)].format(j=j) for j in range(n_suffixes)]
    prompts = [(i, s + x) for i, s in enumerate(scaffolds) for x in suffixes]
    random.Random(seed).shuffle(prompts)
    return scaffolds, prompts


def bench_prefix_cache(model_path: str | None, quick: bool) -> list[str]:
    """Time to first token and hit rate on 4 scaffolds x 64 suffixes: no cache, automatic prefix caching, and the
    scaffolds registered (pinned) with caching off; each prompt runs on all three in turn, so load hits them alike."""
    scaffolds, prompts = prefix_workload(8 if quick else 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a prefill of a few hundred tokens: one thread is steadier on a busy machine
    try:
        return _bench_prefix_cache(model_path, scaffolds, prompts)
    finally:
        torch.set_num_threads(threads)


def _bench_prefix_cache(model_path: str | None, scaffolds: list[str], prompts: list[tuple[int, str]]) -> list[str]:
    models = {"no cache": load_model(model_path, 1024), "automatic": load_model(model_path, 1024, prefix_caching=True),
              "registered": load_model(model_path, 1024)}
    loops = models["no cache"].cfg.default_loops
    pool = create_prefix_pool(len(scaffolds))
    for s in scaffolds:
        register_prefix(pool, models["registered"], s, loops)
    cfg = GenerateConfig(max_tokens=1, loops=loops)
    calls = {"no cache": lambda p: generate(models["no cache"], p, cfg),
             "automatic": lambda p: generate(models["automatic"], p, cfg),
             "registered": lambda p: generate_with_pool(models["registered"], pool, p, cfg)}
    for fn in calls.values():
        fn("import os\n")  # warm up
    ttft = {k: [] for k in calls}
    hits = {k: [0, 0, 0] for k in calls}  # requests with a hit, hit tokens, prompt tokens
    same = 0
    for n, (_, prompt) in enumerate(prompts):
        order = list(calls)[n % 3:] + list(calls)[:n % 3]  # rotate who runs first
        out = {}
        for k in order:
            t = time.perf_counter()
            out[k] = calls[k](prompt)
            ttft[k].append((time.perf_counter() - t) * 1000)
            st = out[k].stats
            hits[k][0] += st.prefix_hit_tokens > 0
            hits[k][1] += st.prefix_hit_tokens
            hits[k][2] += st.prompt_tokens
        same += out["automatic"].tokens == out["no cache"].tokens == out["registered"].tokens
    n_scaffold = [len(models["no cache"].codec.encode(s)) for s in scaffolds]
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    base = sum(ttft["no cache"]) / len(prompts)
    lines = [f"prefix caching: {len(scaffolds)} scaffolds ({min(n_scaffold)}-{max(n_scaffold)} tokens, ending in "
             f"{', '.join(repr(e) for e in ENDINGS)}) x {len(prompts) // len(scaffolds)} suffixes, shuffled, loops {loops}, "
             f"cache {models['no cache'].cache_mode}, 1 thread; time to first token (ms, whole call, max_tokens=1)",
             f"  {'':<11} {'requests hit':>12} {'prompt tokens hit':>17} {'mean':>7} {'p50':>7} {'p99':>7} {'vs no cache':>11}"]
    for k in calls:
        mean = sum(ttft[k]) / len(prompts)
        lines.append(f"  {k:<11} {hits[k][0] / len(prompts):>12.0%} {hits[k][1] / hits[k][2]:>17.0%} {mean:>7.1f} "
                     f"{pct(ttft[k], 0.5):>7.1f} {pct(ttft[k], 0.99):>7.1f} {base / mean:>10.1f}x")
    tree = models["automatic"].prefixes
    lines.append(f"  outputs equal on all three: {same}/{len(prompts)}; automatic cache: {tree.nodes} blocks of 16 "
                 f"tokens held, {tree.evictions} evicted")
    return lines
