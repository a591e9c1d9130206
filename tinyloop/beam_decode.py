"""Beam search: several hypotheses of one request, each a Sequence in a lane of the runner (tinyloop/engine/beam.py
has the search itself, which runs beside any other request in a batch).

generate_stream dispatches here when beam_size > 1.
"""
from __future__ import annotations

import time

from .engine.beam import LENGTH_PENALTY, BeamGroup, Hypothesis, length_normalised  # noqa: F401 (public names)
from .engine.calls import checked, engine
from .engine.sequence import Sequence
from .request import GenerateConfig, GenerateResult, OnToken


def beam_search(model, prompt, cfg: GenerateConfig, on_token: OnToken | None = None) -> GenerateResult:
    """Best hypothesis as tokens/text/stats, and the n-best list (best first) in result.n_best."""
    cfg = checked(model, cfg, "single")
    with model.busy():
        ids = model.encode_prompt(prompt)
        with engine(model, [ids], [cfg], n_lanes=cfg.beam_size, what="beam hypothesis") as (runner, client):
            root = Sequence(model, ids, cfg, on_token, time.perf_counter())
            root.beam = BeamGroup(root)  # also at beam_size 1: greedy decode, with its hypothesis and score
            return runner.run([root], client=client)[0]
