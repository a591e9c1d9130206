"""The model families TinyLoop runs, one module each, as configurations of the one looped core (tinyloop/model.py).

A family module holds what its checkpoints need, and nothing runs elsewhere that asks which family it is:
  NAME, KIND, ABOUT       its name, the kind of checkpoint directory it reads (config.json's model_type; None:
                          none), and what docs/hf.md's table says of it (checkpoints, licence, loops, exit, KV)
  claims(raw)             whether a checkpoint directory's config.json (a dict) is this family's
  config(c: family.Raw)   the ModelConfig fields of that config.json: the block's differences from the shared core,
                          the loop's injection and initial state, the exit rule and the KV policy across loops
  tensors(name, cfg)      a checkpoint tensor -> [(TinyLoop name, transform)]; [] for one not read, None if unknown
Adding a family is one new module here and one line in FAMILIES.
"""
from __future__ import annotations

from types import ModuleType

from . import bundled, huginn, llama, nanbeige, ouro, parcae

FAMILIES: tuple[ModuleType, ...] = (bundled, ouro, huginn, parcae, nanbeige, llama)


def family_of(raw: dict) -> ModuleType | None:
    """The family whose checkpoints have this config.json, or None."""
    return next((f for f in FAMILIES if f.claims(raw)), None)


def loadable() -> list[str]:
    """The config.json kinds a checkpoint directory may be, for error messages."""
    return [f.KIND for f in FAMILIES if f.KIND]
