"""The bundled family: TinyLoop's own .tinyloop artifacts (the default model, `tinyloop train`'s output).

Its config is the ModelConfig the artifact stores, with the defaults of tinyloop/config.py as its shape (prelude 1,
core 2, coda 1, adapter injection, SwiGLU, tied head; docs/model.md); its tensor names are the looped core's own,
so it needs no mapping (tinyloop/artifact.py reads and checks them). Its exit rule is the runtime's relative latent
change ("latent"); a token that exits copies its last loop's K/V into the loops it skipped ("copy"). It has no
config.json directory form: `claims` is False for every checkpoint directory.
"""
from __future__ import annotations

NAME = "bundled"
KIND = None
ABOUT = {"checkpoints": "tinyloop/data/default.tinyloop (`load_model()`)", "licence": "the project's",
         "reference": "this runtime (trained by `tinyloop train`)", "loops": "8 (1..16)",
         "exit": "latent change", "kv": "one slot per (loop, layer); skipped loops copy the last"}


def claims(raw: dict) -> bool:
    return False
