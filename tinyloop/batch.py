"""Static lockstep batching (seed page, "Static batched generation").

1. Per-lane prefill, one prompt at a time, each into its own lane of one N-lane KVCache.
2. Lockstep decode: all N lanes step one token at a time through one batched forward. A lane that stopped
   (EOS, stop sequence, grammar complete, max_tokens, cancelled) stays in the kernel shape, fed its last
   token at a frozen position; its outputs are discarded.
3. Per-lane host-side sampling: repetition penalty, grammar mask, sampler and stop matching per lane.

The per-lane logic (Lane) mirrors generate.run_decode step for step, so greedy output equals `generate` on
each prompt alone; the same engine serves single-lane grammar decode (decoding.generate_special).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .cache import KVCache
from .errors import ConfigError
from .generate import (Decoder, GenerateConfig, GenerateResult, GenerateStats, check_length, make_generator)
from .grammar import GrammarState
from .kernels.lean import decode_forward
from .modes import check_modes
from .runtime import Model
from .sampling import apply_repetition_penalty, sample_token
from .stops import StopMatcher

# on_token(lane, token, index) -> bool; False cancels that lane only.
OnLaneToken = Callable[[int, int, int], bool]

# Settings that shape the batched kernel or the shared sampler: every lane must agree (seed table; early exit
# added because one threshold drives the batched adaptive-depth loop).
SHARED_FIELDS = ("loops", "temperature", "top_k", "top_p", "repetition_penalty", "early_exit_threshold")


class Lane:
    """Host-side state of one sequence: what run_decode keeps in local variables, per lane."""

    def __init__(self, model: Model, index: int, prompt_ids: list[int], cfg: GenerateConfig,
                 on_token: OnLaneToken | None, t_call: float):
        self.model, self.index, self.cfg, self.on_token, self.t_call = model, index, cfg, on_token, t_call
        self.gen = make_generator(cfg.seed)
        self.seen = torch.tensor(prompt_ids, device=model.device)
        self.matcher = StopMatcher(model.codec.decode, cfg.stop_sequences)
        self.grammar = GrammarState.for_model(model, cfg.grammar) if cfg.grammar is not None else None
        self.stats = GenerateStats(prompt_tokens=len(prompt_ids), cache_mode=model.cache_mode)
        self.pos = len(prompt_ids)  # where the next fed token goes
        self.step_i = 0
        self.emitted = 0
        self.token = prompt_ids[-1]
        self.done, self.stop_reason = False, "max_tokens"
        self.loop_counts: list[int] = []
        self.t_prefilled = t_call

    def _emit(self, tokens: list[int]) -> bool:
        for t in tokens:
            keep = self.on_token(self.index, t, self.emitted) if self.on_token is not None else True
            self.emitted += 1
            if keep is False:
                return False
        return True

    def step(self, logits: torch.Tensor) -> None:
        """Sample the next token from this lane's logits [V]; afterwards either self.done or self.token is fed."""
        cfg, i = self.cfg, self.step_i
        logits = apply_repetition_penalty(logits, self.seen, cfg.repetition_penalty)
        if self.grammar is not None:
            logits = self.grammar.mask(logits)
        token = sample_token(logits, cfg.temperature, cfg.top_k, cfg.top_p, self.gen)
        if i == 0:
            self.stats.first_token_ms = (time.perf_counter() - self.t_call) * 1000
        self.step_i += 1
        if self.grammar is not None:
            self.grammar.accept(token)
        if token == self.model.eos_id:  # under a grammar EOS is only allowed once the output is complete
            return self._finish("grammar_complete" if self.grammar is not None else "eos")
        ready, stopped = self.matcher.push(token)
        if not self._emit(ready):
            return self._finish("cancelled")
        if stopped:
            return self._finish("stop_sequence")
        if self.grammar is not None and self.grammar.must_end():
            return self._finish("grammar_complete")
        if i == cfg.max_tokens - 1:
            return self._finish("max_tokens")
        if cfg.repetition_penalty != 1.0:
            self.seen = torch.cat((self.seen, torch.tensor([token], device=self.seen.device)))
        self.token = token

    def _finish(self, reason: str) -> None:
        self.done, self.stop_reason = True, reason
        if reason in ("eos", "max_tokens", "grammar_complete") and not self._emit(self.matcher.flush()):
            self.stop_reason = "cancelled"
        self.t_end = time.perf_counter()

    def result(self, loops: int) -> GenerateResult:
        m, st = self.matcher, self.stats
        tokens = m.tokens[:self.emitted] if self.stop_reason == "cancelled" else m.tokens
        text = self.model.codec.decode(tokens) if self.stop_reason != "stop_sequence" or not m.strings else m.text
        st.generated_tokens, st.stop_reason = len(tokens), self.stop_reason
        st.decode_ms = (self.t_end - self.t_prefilled) * 1000
        st.total_ms = (self.t_end - self.t_call) * 1000
        st.loops_mean = sum(self.loop_counts) / len(self.loop_counts) if self.loop_counts else float(loops)
        return GenerateResult(tokens, text, st)


@torch.inference_mode()
def decode_lanes(model: Model, prompts: list[list[int]], cfgs: list[GenerateConfig], cache: KVCache,
                 on_token: OnLaneToken | None = None) -> list[GenerateResult]:
    """Prefill each lane of `cache` in turn, then decode all lanes in lockstep (configs already checked)."""
    t_call = time.perf_counter()
    net, dev = model.net, model.device
    loops, early_exit = cfgs[0].resolved_loops(model), cfgs[0].early_exit_threshold
    adaptive = early_exit > 0 or net.exit_gate is not None
    lanes = [Lane(model, i, p, c, on_token, t_call) for i, (p, c) in enumerate(zip(prompts, cfgs))]
    rows = []
    for lane, ids in zip(lanes, prompts):
        cache.lane_view(lane.index).reset()
        t = time.perf_counter()
        decoder = Decoder(model, loops, cache.lane_view(lane.index), early_exit)
        rows.append(decoder.forward(ids, 0)[-1])  # the same call generate makes, so lanes match it exactly
        lane.stats.prefill_ms = (time.perf_counter() - t) * 1000
        lane.loop_counts += decoder.loop_counts
    logits = torch.stack(rows)
    t_decode = time.perf_counter()
    for lane in lanes:
        lane.t_prefilled = t_decode
    while True:
        for lane in lanes:
            if not lane.done:
                lane.step(logits[lane.index])
        live = [not lane.done for lane in lanes]
        if not any(live):
            break
        ids = torch.tensor([[lane.token] for lane in lanes], device=dev)
        pos = torch.tensor([[lane.pos] for lane in lanes], device=dev)
        step = net.make_step(pos, max(lane.pos for lane in lanes) + 1)
        if adaptive:
            out, used = net.forward_adaptive(ids, loops, step, cache, early_exit)
        else:
            out, used = decode_forward(net, ids, loops, step, cache), None  # generate's one-token path, batched
        logits = out[:, -1]
        for lane in lanes:
            if live[lane.index]:  # a stopped lane keeps its frozen position: its writes land past its output
                lane.pos += 1
                lane.loop_counts.append(int(used[lane.index]) if used is not None else loops)
    return [lane.result(loops) for lane in lanes]


def lane_configs(prompts, cfg) -> list[GenerateConfig]:
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError("generate_batch: prompts must be a non-empty list of prompts (strings or token-id lists)")
    if cfg is None or isinstance(cfg, GenerateConfig):
        return [cfg or GenerateConfig()] * len(prompts)
    if not isinstance(cfg, (list, tuple)) or len(cfg) != len(prompts) or not all(isinstance(c, GenerateConfig) for c in cfg):
        raise ConfigError(f"generate_batch: cfg must be one GenerateConfig or a list of one per prompt "
                          f"({len(prompts)} prompts)")
    return list(cfg)


def check_batch(model: Model, cfgs: list[GenerateConfig]) -> None:
    """The seed table's call-entry constraints that do not need the prompts."""
    for c in cfgs:
        c.validate(model)
        check_modes("batch", model.cache_mode, c)  # cache_window > 0 and beam_size > 1 are rejected here
    first = cfgs[0]
    for i, c in enumerate(cfgs[1:], 1):
        for name in SHARED_FIELDS:
            a, b = (first.resolved_loops(model), c.resolved_loops(model)) if name == "loops" else (getattr(first, name), getattr(c, name))
            if a != b:
                raise ConfigError(f"generate_batch: all lanes must share {', '.join(SHARED_FIELDS)}; "
                                  f"lane {i} has {name}={b!r} but lane 0 has {name}={a!r}")


def generate_batch(model: Model, prompts: Sequence, cfg: GenerateConfig | Sequence[GenerateConfig] | None = None,
                   on_token: OnLaneToken | None = None) -> list[GenerateResult]:
    """Static lockstep generation over N = len(prompts) lanes; one GenerateResult per prompt, in order.

    cfg: one GenerateConfig for all lanes, or one per lane (stop_sequences, grammar, seed and max_tokens may
    differ; the SHARED_FIELDS may not). on_token(lane, token, index) streams; returning False cancels that lane.
    """
    model.check_alive()
    cfgs = lane_configs(prompts, cfg)
    check_batch(model, cfgs)
    with model.busy():
        ids = [model.encode_prompt(p) for p in prompts]
        for i, (p, c) in enumerate(zip(ids, cfgs)):
            check_length(model, len(p), c, f"generate_batch lane {i}: prompt")
        max_len = max(len(p) + c.max_tokens for p, c in zip(ids, cfgs))
        cache = model.new_cache(len(ids), max_len)
        return decode_lanes(model, ids, cfgs, cache, on_token)


# --- benchmark (tinyloop bench batch) --------------------------------------------------------------------
BENCH_PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
                 "for i in range(10):\n    ", "def read_file(path):\n    with open(path) as f:\n", "if __name__ == '__main__':\n",
                 "    return sorted(items, key=", "try:\n    import json\nexcept ImportError:\n", "def __repr__(self):\n        return",
                 "x = [i * i for i in", "while True:\n    line = f.readline()\n", "@property\ndef name(self):\n",
                 "raise ValueError(", "def test_add():\n    assert", "with open(path, 'w') as out:\n", "self.items.append("]


def bench_batch(model_path: str | None, quick: bool) -> list[str]:
    """generate_batch over 16 lanes vs 16 sequential generate calls, and the cost of one lane running 8x longer.

    The runs alternate in rounds and each keeps its best time, so a load change on the machine hits all alike.
    """
    from .generate import generate
    from .runtime import load_model

    n, rounds = (16, 2) if quick else (48, 3)
    model = load_model(model_path, 1024)
    prompts = BENCH_PROMPTS
    cfg = GenerateConfig(max_tokens=n)
    long_cfgs = [GenerateConfig(max_tokens=8 * n)] + [cfg] * (len(prompts) - 1)  # lane 0 runs 8x longer
    generate_batch(model, prompts[:2], GenerateConfig(max_tokens=2))  # warm up allocator and kernels
    # Both sides run as the product does: torch's threads, with the lean decode step's thread policy (one thread
    # for a batch-1 step, all for a 16-lane step). On a busy machine, pass TINYLOOP_DECODE_THREADS=1 and run
    # with torch.set_num_threads(1) to measure batching rather than the load.
    threads = torch.get_num_threads()
    runs = {
        "seq": lambda: [generate(model, p, cfg) for p in prompts],
        "b4": lambda: [r for i in range(0, len(prompts), 4) for r in generate_batch(model, prompts[i:i + 4], cfg)],
        "b16": lambda: generate_batch(model, prompts, cfg),
        "div_seq": lambda: [generate(model, p, c) for p, c in zip(prompts, long_cfgs)],
        "div": lambda: generate_batch(model, prompts, long_cfgs),
    }
    best = {k: float("inf") for k in runs}
    out: dict[str, list[GenerateResult]] = {}
    for _ in range(rounds):
        for k, fn in runs.items():
            t = time.perf_counter()
            out[k] = fn()
            best[k] = min(best[k], time.perf_counter() - t)
    tps = {k: sum(r.stats.generated_tokens for r in out[k]) / best[k] for k in runs}
    lines = [f"static batching, {len(prompts)} prompts, greedy, up to {n} tokens each (cache {model.cache_mode}, "
             f"loops {cfg.resolved_loops(model)}), {threads} torch threads, best of {rounds} alternating rounds",
             f"  {'lanes':>5} {'tok/s':>9} {'vs sequential':>14}"]
    for key, label in (("seq", "seq"), ("b4", "4"), ("b16", "16")):
        same = [r.tokens for r in out[key]] == [r.tokens for r in out["seq"]]
        lines.append(f"  {label:>5} {tps[key]:>9.1f} {tps[key] / tps['seq']:>13.2f}x"
                     f"{'' if same else '  (outputs differ from sequential!)'}")
    steps = max(r.stats.generated_tokens for r in out["div"])
    useful = sum(r.stats.generated_tokens for r in out["div"]) / (steps * len(prompts))
    lines.append(f"  divergence (lane 0 runs {8 * n} tokens, the other 15 lanes {n}): batch {tps['div']:.1f} useful tok/s "
                 f"= {best['div_seq'] / best['div']:.2f}x its sequential calls; {best['div'] / best['b16']:.2f}x the time "
                 f"of the uniform batch; {useful:.0%} of lane-steps useful")
    return lines
