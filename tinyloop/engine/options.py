"""The engine's switches, read from the environment once per runner (tests and benches pass their own).

TINYLOOP_DEPTH_STEPS  1 | 0  1: decode rows at different depths, or exiting early, advance by loop iterations
                             (continuous-depth batching, docs/engine.md); 0: by whole tokens
TINYLOOP_RUN_AHEAD    1 | 0  1: greedy rows draw their next tokens inside the C passes; 0: every token returns to the
                             sampler
TINYLOOP_COALESCE     1 | 0  1: a greedy row whose token ended may wait a pass or two to share its head with
                             batch-mates' (in C calls of cpu_block.COALESCE_FROM_ROWS rows or more); 0: every head
                             runs in the pass its token ends
"""
from __future__ import annotations

from dataclasses import dataclass

from ..env import env_choice


@dataclass(frozen=True)
class EngineOptions:
    depth_steps: bool = True
    run_ahead: bool = True
    coalesce: bool = True

    @classmethod
    def from_env(cls) -> "EngineOptions":
        on = {name: env_choice(f"TINYLOOP_{name.upper()}", ("1", "0"), "1") == "1"
              for name in ("depth_steps", "run_ahead", "coalesce")}
        return cls(**on)
