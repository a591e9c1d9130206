"""tinyloop bench logprobs: what asking for log-probabilities costs a request, side by side in one run.

Four ways to answer the same greedy requests (the bundled model, 8 loops): plain; with GenerateConfig.logprobs=5,
where each token's log-probability and its 5 most likely alternatives come from the logits the step chose it from;
the same with the prompt's too (prompt_logprobs=5, the service's `echo`: from the prefill's rows); and the way the
service answered before, generating plainly and then scoring prompt + output in a second, uncached forward
(tinyloop.scoring.token_logprobs). At batch 1 and as a 16-prompt batch; best of the rounds, in turns.
"""
from __future__ import annotations

from scripts.bench.timing import timed
from tinyloop.generation import GenerateConfig, generate
from tinyloop.loader import load_model
from tinyloop.scoring import token_logprobs

PROMPTS = [f"def f{i}(x):\n    return x * {i}\n" for i in range(16)]


def bench_logprobs(model_path: str | None, quick: bool) -> list[str]:
    from tinyloop.batch import generate_batch

    model = load_model(model_path, 512)
    n, rounds = (16, 2) if quick else (64, 3)
    plain, asking = GenerateConfig(max_tokens=n, loops=8), GenerateConfig(max_tokens=n, loops=8, logprobs=5)
    echo = GenerateConfig(max_tokens=n, loops=8, logprobs=5, prompt_logprobs=5)

    def rescored(prompts: list[str]) -> None:  # generate, then a second forward over prompt + output
        outs = generate_batch(model, prompts, plain) if len(prompts) > 1 else [generate(model, prompts[0], plain)]
        for p, r in zip(prompts, outs):
            token_logprobs(model, model.encode_prompt(p), r.tokens, 8, 5, score_context=True)

    lines = [f"logprobs: a request asking each token's log-probability and 5 alternatives against a plain one "
             f"(greedy, 8 loops, {n} tokens; seconds, best of {rounds}; ratio = / plain)"]
    for prompts in (PROMPTS[:1], PROMPTS):
        run = (lambda cfg: lambda: generate(model, prompts[0], cfg)) if len(prompts) == 1 else \
            (lambda cfg: lambda: generate_batch(model, prompts, cfg))
        best = dict.fromkeys(("plain", "step", "echo", "rescored"), float("inf"))
        run(plain)(), run(asking)(), run(echo)(), rescored(prompts)  # warm-up: the first call of each shape pays for it
        for _ in range(rounds):
            best["plain"] = min(best["plain"], timed(run(plain)))
            best["step"] = min(best["step"], timed(run(asking)))
            best["echo"] = min(best["echo"], timed(run(echo)))
            best["rescored"] = min(best["rescored"], timed(lambda: rescored(prompts)))
        lines.append(f"  batch {len(prompts):>2}: plain {best['plain']:.3f} s, from the step's logits "
                     f"{best['step']:.3f} s ({best['step'] / best['plain']:.2f}x), with the prompt's from its prefill "
                     f"{best['echo']:.3f} s ({best['echo'] / best['plain']:.2f}x), generate then rescore prompt and "
                     f"output {best['rescored']:.3f} s ({best['rescored'] / best['plain']:.2f}x)")
    return lines
