"""The mode matrix of the seed page, as data. Guards, tests and docs all read MATRIX.

Rows are runtime modes, columns are call kinds. "yes": supported and tested; "no": rejected with ModeError.
"""
from __future__ import annotations

from .errors import ModeError

CALLS = ("single", "batch", "speculative", "tree_speculative", "prefix", "warm_start")
CALL_TITLES = {"single": "Single decode", "batch": "Batched decode", "speculative": "Speculative",
               "tree_speculative": "Tree-speculative", "prefix": "Prefix reuse", "warm_start": "Warm-start"}
MODES = ("fp16", "int8", "int4", "grammar", "cache_window", "beam")
MODE_TITLES = {"fp16": "FP16 cache", "int8": "INT8 cache", "int4": "INT4 cache (store-h INT4)",
               "grammar": "Grammar", "cache_window": "cache_window > 0", "beam": "Beam search (beam_size > 1)"}

_ROWS = {
    #                single  batch  spec   tree   prefix warm
    "fp16":         ("yes", "yes", "yes", "yes", "yes", "yes"),
    "int8":         ("yes", "yes", "yes", "yes", "yes", "yes"),
    "int4":         ("yes", "yes", "yes", "yes", "yes", "yes"),
    "grammar":      ("yes", "yes", "no",  "no",  "yes", "yes"),
    "cache_window": ("yes", "yes", "yes", "no",  "no",  "yes"),
    "beam":         ("yes", "yes", "no",  "no",  "no",  "no"),
}
MATRIX: dict[tuple[str, str], str] = {(m, c): _ROWS[m][i] for m in MODES for i, c in enumerate(CALLS)}


def active_modes(cache_mode: str, cfg) -> list[str]:
    """The matrix rows a call exercises, from the model's cache mode and a GenerateConfig."""
    modes = [cache_mode]
    if getattr(cfg, "grammar", None) is not None:
        modes.append("grammar")
    if getattr(cfg, "cache_window", 0) > 0:
        modes.append("cache_window")
    if getattr(cfg, "beam_size", 1) > 1:
        modes.append("beam")
    return modes


def check_modes(call: str, cache_mode: str, cfg) -> None:
    """Raise ModeError naming both sides when the matrix rejects a mode for this kind of call."""
    for mode in active_modes(cache_mode, cfg):
        if MATRIX[(mode, call)] == "no":
            raise ModeError(f"{MODE_TITLES[mode]} cannot be combined with {CALL_TITLES[call]} "
                            f"(mode matrix: {mode} x {call} is rejected)")


# Elastic depth (a depth range: GenerateConfig.min_loops below loops at a fixed depth, or max_loss_increase; the
# worker's load controller picks each token's loops in it, docs/engine.md) against the modes where the range means
# nothing. Each row: what it is, whether a config (or the model) has it, and why the range is meaningless there.
DEPTH_RANGE = "depth range (min_loops below loops, or max_loss_increase)"
DEPTH_RANGE_ROWS: dict[str, tuple[str, str]] = {
    "beam": ("Beam search (beam_size > 1)", "its hypotheses are ranked by scores at one depth"),
    "early_exit": ("early exit (early_exit_threshold > 0, an exit_rule, or the model's exit gate)",
                   "its rule chooses each token's depth (min_loops is then the rule's floor)"),
    "exit_schedule": ("exit_schedule", "it forces every token's depth itself"),
    "exit_kv_compute": ("exit_kv 'compute' (this model's family)", "a token below its loops still runs them all "
                        "for their K/V, so fewer loops save nothing"),
    "speculative": ("speculative decoding", "its drafts and verification run at depths of their own"),
}


def depth_range_conflicts(model, cfg, speculative: bool = False) -> list[str]:
    """The DEPTH_RANGE_ROWS a config (on this model) has."""
    has = {"beam": cfg.beam_size > 1,
           "early_exit": cfg.max_loss_increase is not None and cfg.exits_early(model),
           "exit_schedule": bool(cfg.exit_schedule), "exit_kv_compute": model.cfg.exit_kv == "compute",
           "speculative": speculative}
    return [name for name in DEPTH_RANGE_ROWS if has[name]]


def check_depth_range(model, cfg, speculative: bool = False) -> None:
    """ModeError naming both sides when a config asks a depth range where it means nothing."""
    for name in depth_range_conflicts(model, cfg, speculative):
        title, why = DEPTH_RANGE_ROWS[name]
        raise ModeError(f"a {DEPTH_RANGE} cannot be combined with {title}: {why}")


def depth_range_table() -> str:
    lines = ["| Mode | Depth range |", "|---|---|"]
    lines += [f"| {title} | ❌ {why} |" for title, why in DEPTH_RANGE_ROWS.values()]
    return "\n".join(lines)


def markdown_table() -> str:
    mark = {"yes": "✅", "partial": "⚠ partial", "no": "❌"}
    lines = ["| Mode | " + " | ".join(CALL_TITLES[c] for c in CALLS) + " |",
             "|---|" + "---|" * len(CALLS)]
    for m in MODES:
        lines.append(f"| {MODE_TITLES[m]} | " + " | ".join(mark[MATRIX[(m, c)]] for c in CALLS) + " |")
    return "\n".join(lines)
