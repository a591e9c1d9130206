"""ModelConfig: every architectural choice of a looped model, stored in the artifact."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError
from .fields import EXIT_RULES, is_int

INJECTIONS = ("none", "add", "adapter", "diagonal")
STATE_INITS = ("zeros", "embed", "normal")
EXIT_KV = ("copy", "compute")
MLPS = ("swiglu", "relu2")
# Fields the fast decode paths (the C step of kernels/cpu_block.c) do not implement, with the value they do: a model
# that sets another decodes through the torch path (torch_only; model.BlockWeights refuses the C blocks).
FAST_PATH_VALUES = {"mlp": "swiglu", "qk_norm": False, "value_embeds": (), "prelude_norm": False, "readout": False,
                    "logit_scale": 1.0, "logit_softcap": 0.0}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 688
    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    max_loops: int = 16
    default_loops: int = 8
    injection: str = "adapter"
    state_init: str = "zeros"
    init_sigma: float = 1.0
    init_seed: int = 0
    sandwich_norm: bool = False
    tie_embeddings: bool = True
    exit_gate: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    bos_id: int = 0
    eos_id: int = 0
    # What real checkpoints (Ouro, Huginn; tinyloop/hf.py) bring. The defaults are the family as it was before them.
    embed_scale: float = 1.0        # embeddings are multiplied by this (Huginn: sqrt(d_model))
    qk_bias: bool = False           # the query and key projections have biases (Huginn)
    sandwich_residual: bool = False  # sandwich norms normalise the residual sum (Huginn) instead of the branch output (Ouro)
    loop_norm: bool = False         # the final norm is applied to the state after every loop, and that feeds the next (Ouro)
    coda_norm: bool = False         # the final norm is also applied to s_L before the coda (Huginn uses it twice)
    final_norm: bool = True         # the final norm before the head (off when loop_norm already normalised s_L)
    init_trunc: float = 0.0         # "normal" state init truncated at +-init_trunc sigma (Huginn: 3); 0: untruncated
    exit_rule: str = "latent"       # a request's rule when it names none (tinyloop/exits.py): latent, cdf (Ouro), entropy, kl, argmax
    exit_kv: str = "copy"           # copy: skipped loops are not run, their K/V copied | compute: loops run on for K/V, logits from the exit loop
    # What Parcae brings (tinyloop/models/parcae.py); injection "diagonal": x = s * exp(-dt A) + dt * B e per channel.
    mlp: str = "swiglu"             # swiglu: w_down(silu(w_gate h) * w_up h) | relu2: w_down(relu(w_up h)^2 / 2), no gate
    qk_norm: bool = False           # q and k RMS-normalised per head (no weight) after RoPE
    value_embeds: tuple[int, ...] = ()  # layers (prelude, core, coda numbered in that order) whose V adds a per-token
                                        # value embedding, gated per KV head by the first channels of the input
    prelude_norm: bool = False      # an RMSNorm on the prelude's output e
    readout: bool = False           # a d x d linear map of s_L before the coda (Parcae's C)
    logit_scale: float = 1.0        # logits are multiplied by this
    logit_softcap: float = 0.0      # > 0: logits = c * tanh(logits / c)
    # What Nanbeige brings (tinyloop/models/nanbeige.py)
    head_size: int = 0              # each head's width when it is not d_model / n_heads (q is n_heads * head_size wide)

    @property
    def dense(self) -> bool:
        """A model whose layers run once per token (max_loops 1: a Llama-shaped model, tinyloop/models/llama.py): the
        one-loop case of the family, with no depth to vary, exit early from or draft at."""
        return self.max_loops == 1

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def n_slots(self, loops: int | None = None) -> int:
        """KV slots for a given loop count: one per prelude/coda layer, one per core layer per loop."""
        loops = self.max_loops if loops is None else loops
        return self.n_prelude + self.n_core * loops + self.n_coda

    def slots_written(self, loops: int) -> list[int]:
        """The slots a token's forward of `loops` loops writes: the prelude's, loops 0..loops-1 of the core's, the
        coda's."""
        return [*range(self.n_prelude + self.n_core * loops), *(self.coda_slot(j) for j in range(self.n_coda))]

    def core_slot(self, loop: int, layer: int) -> int:
        """Slot of core layer `layer` at loop `loop` (0-based). Coda slots follow all core slots."""
        return self.n_prelude + loop * self.n_core + layer

    def coda_slot(self, layer: int) -> int:
        return self.n_prelude + self.max_loops * self.n_core + layer

    def torch_only(self) -> list[str]:
        """The fields this config sets that the C decode step does not implement (FAST_PATH_VALUES, and an injection
        other than none / add / adapter): with any, decode rows run through the torch path."""
        off = [name for name, value in FAST_PATH_VALUES.items() if getattr(self, name) != value]
        off += ["injection"] if self.injection == "diagonal" else []
        return off + (["head_size"] if self.q_dim != self.d_model else [])  # the C blocks take q as wide as d

    def validate(self) -> "ModelConfig":
        def need(ok: object, msg: str) -> None:  # (ok: anything with a truth value)
            if not ok:
                raise ConfigError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "n_core", "max_loops"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        for name in ("n_prelude", "n_coda"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 0, f"{name} must be a non-negative integer, got {v!r}")
        need(is_int(self.head_size) and self.head_size >= 0, f"head_size must be an integer >= 0, got {self.head_size!r}")
        need(self.head_size or self.d_model % self.n_heads == 0,
             f"d_model {self.d_model} not divisible by n_heads {self.n_heads}")
        need(self.n_heads % self.n_kv_heads == 0, f"n_heads {self.n_heads} not divisible by n_kv_heads {self.n_kv_heads}")
        need(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE")
        need(1 <= self.default_loops <= self.max_loops, f"default_loops {self.default_loops} outside 1..{self.max_loops}")
        need(self.injection in INJECTIONS, f"injection {self.injection!r} not one of {INJECTIONS}")
        need(self.state_init in STATE_INITS, f"state_init {self.state_init!r} not one of {STATE_INITS}")
        need(self.init_sigma >= 0, f"init_sigma must be >= 0, got {self.init_sigma}")
        need(self.init_trunc >= 0, f"init_trunc must be >= 0, got {self.init_trunc}")
        need(self.embed_scale > 0, f"embed_scale must be > 0, got {self.embed_scale}")
        need(self.exit_rule in EXIT_RULES, f"exit_rule {self.exit_rule!r} not one of {EXIT_RULES}")
        need(self.exit_kv in EXIT_KV, f"exit_kv {self.exit_kv!r} not one of {EXIT_KV}")
        need(self.exit_rule != "cdf" or self.exit_gate, "exit_rule 'cdf' needs exit_gate")
        need(self.mlp in MLPS, f"mlp {self.mlp!r} not one of {MLPS}")
        layers = self.n_prelude + self.n_core + self.n_coda
        need(isinstance(self.value_embeds, tuple) and all(is_int(i) and 0 <= i < layers for i in self.value_embeds)
             and list(self.value_embeds) == sorted(set(self.value_embeds)),
             f"value_embeds must be increasing layer indices in 0..{layers - 1}, got {self.value_embeds!r}")
        need(self.logit_scale > 0 and self.logit_softcap >= 0, "logit_scale must be > 0 and logit_softcap >= 0")
        need(0 <= self.bos_id < self.vocab_size and 0 <= self.eos_id < self.vocab_size, "bos_id/eos_id outside the vocabulary")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"ModelConfig: expected an object, got {type(d).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"ModelConfig: unknown field(s) {unknown}")
        d = dict(d)
        if isinstance(d.get("value_embeds"), list):  # JSON has no tuples
            d["value_embeds"] = tuple(d["value_embeds"])
        for k, v in d.items():
            want = str(known[k].type)  # (the annotation as written: `from __future__ import annotations`)
            ok = {"int": is_int(v), "float": is_int(v) or isinstance(v, float),
                  "bool": isinstance(v, bool), "str": isinstance(v, str),
                  "tuple[int, ...]": isinstance(v, tuple) and all(is_int(i) for i in v)}[want]
            if not ok:
                raise ConfigError(f"ModelConfig: field {k} must be {want}, got {v!r}")
        return cls(**d).validate()
