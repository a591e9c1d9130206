"""Single-request generation: generate and generate_stream (beam search and grammar ride the same engine)."""
from __future__ import annotations

from .engine.calls import checked, engine
from .engine.sequence import Sequence
from .request import GenerateConfig, GenerateResult, GenerateStats, OnToken  # noqa: F401 (the public names live here too)


def generate_stream(model, prompt, cfg: GenerateConfig | None = None, on_token: OnToken | None = None) -> GenerateResult:
    """Generate from one prompt; on_token(token, index) gets each token as it is final, False cancels."""
    cfg = checked(model, cfg, "single")
    if cfg.beam_size > 1:
        from .beam_decode import beam_search  # beam search steps several hypotheses of one request
        return beam_search(model, prompt, cfg, on_token)
    with model.busy():
        ids = model.encode_prompt(prompt)
        with engine(model, [ids], [cfg]) as (runner, client):
            return runner.run([Sequence(model, ids, cfg, on_token)], client=client)[0]


def generate(model, prompt, cfg: GenerateConfig | None = None) -> GenerateResult:
    return generate_stream(model, prompt, cfg, None)
