"""The looped transformer of DESIGN section 2: its weights and its forward, written once.

ids -> embed -> prelude -> e;  s0 = init(e);  s_k = core(inject(s_{k-1}, e)) for k = 1..L;  coda(s_L) -> logits

Every forward (training, full recompute, prefill, decode rows, speculative drafts and verification, early exit)
runs the functions of this file over a chunk of T tokens per lane, as token rows [B*T, d]. What differs between
them is the chunk's *context*: where attention finds its keys (`Dense` here: within the chunk; the cached step of
tinyloop/engine/forward.py: the paged KV cache, through torch or Triton) and the weight layout the products use.
With a cache, each layer writes its K/V for the chunk into its slot (core layers own one slot per loop) and
attends over everything the slot holds for that lane.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from . import formats
from .config import ModelConfig
from .errors import ConfigError, ModeError
from .exits import ExitRule, Track, exit_stops
from .rotary import rope_factors, rope_tables, rotate


class _SkipInit(TorchFunctionMode):
    """torch.nn.init calls on meta tensors return them untouched (others, like the initial noise, run)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Modules built inside have parameters on the meta device, not initialised: their shapes, for weights that
    are about to be replaced or only counted. Initialising meta tensors would run torch's Python decompositions,
    whose first use imports torch._dynamo (seconds in every process that loads a model). For the same reason the
    functions that fuse and quantise weights compute nothing on meta tensors (_cat, formats.quantize): torch.cat and
    arithmetic on meta tensors run in Python too (factories, views and dtype casts do not)."""
    with torch.device("meta"), _SkipInit():
        yield


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat by rows; for meta tensors (shapes_only) an empty tensor of the result's shape, with no meta op."""
    if parts[0].is_meta:
        return parts[0].new_empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
    return torch.cat(parts)


class RMSNorm(nn.Module):
    """An RMSNorm's weight (the math is `rms_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one call, composed in C++ of the same ops as below (same bits in fp32)
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@dataclass
class Step:
    """Where a chunk of tokens sits: absolute positions [B, T] and rotary factors for them.

    `end` is 1 + the largest position in the chunk, as a Python int so reading the cache needs no host sync.
    """
    pos: torch.Tensor
    end: int
    table_cos: torch.Tensor
    table_sin: torch.Tensor
    window: int = 0  # sliding-window width for the cache-free path (the cache applies its own window)
    # Tree chunks (speculative decoding): positions repeat across branches, so each token gets its own cache
    # cell, the cells read carry their positions, and attention follows an explicit ancestor mask [B, T, end].
    # `end` is then 1 + the largest cell read. All None on the plain paths: cell = position, causal mask.
    cells: torch.Tensor | None = None
    key_pos: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @functools.cached_property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary factors at the chunk's positions, gathered on first use (a decode step in one C call reads the
        tables itself)."""
        return self.rope_at(self.pos)

    @property
    def cos(self) -> torch.Tensor:
        return self.rope[0]

    @property
    def sin(self) -> torch.Tensor:
        return self.rope[1]

    def rope_at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary factors [B, N, 1, hd/2] at positions pos [B, N]."""
        return self.table_cos[pos].unsqueeze(2), self.table_sin[pos].unsqueeze(2)


class Attention(nn.Module):
    """Attention's weights (the math is `block` below)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wq = nn.Linear(cfg.d_model, cfg.q_dim, bias=cfg.qk_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_dim, bias=cfg.qk_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.q_dim, cfg.d_model, bias=False)


class MLP(nn.Module):
    """SwiGLU's weights (relu2: no gate)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False) if cfg.mlp == "swiglu" else None
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)


# Parcae's value-embedding gate reads this many leading channels of the attention input.
VE_GATE_CHANNELS = 32


class DiagonalDecay(nn.Module):
    """Diagonal injection's per-channel parameters: dt = softplus(dt_bias), decay = exp(-dt exp(a_log))."""

    def __init__(self, dim: int):
        super().__init__()
        self.a_log = nn.Parameter(torch.zeros(dim))
        self.dt_bias = nn.Parameter(torch.zeros(dim))


class Block(nn.Module):
    """A pre-norm block's weights: attention + SwiGLU, with optional sandwich norms on each branch's output.
    `layer` numbers prelude, core and coda layers in that order (ModelConfig.value_embeds)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.sandwich, self.on_sum = cfg.sandwich_norm, cfg.sandwich_residual
        if self.sandwich:
            self.attn_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.mlp_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.value_embed = self.ve_gate = None
        if layer in cfg.value_embeds:  # Parcae: a per-token value vector added to V, gated per KV head
            self.value_embed = nn.Embedding(cfg.vocab_size, cfg.kv_dim)
            self.ve_gate = nn.Linear(VE_GATE_CHANNELS, cfg.n_kv_heads, bias=False)
        self.kernels = not cfg.torch_only()


# --- the weights a forward multiplies by ------------------------------------------------------------------
@dataclass
class BlockWeights:
    attn_norm: torch.Tensor
    wqkv: formats.Matrix  # [d + 2 kv_dim, d]: rows of wq, wk, wv
    wkv: formats.Matrix   # the wk|wv rows, unpacked (the int4 store-h cache recomputes K and V from h)
    wo: formats.Matrix
    mlp_norm: torch.Tensor
    wgu: formats.Matrix   # [2 ffn, d]: rows of w_gate, w_up
    w_down: formats.Matrix
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    bqkv: torch.Tensor | None = None  # qk_bias: biases of the q|k|v rows (v's part zero)
    on_sum: bool = False              # sandwich_residual: the out-norms normalise the residual sums
    # what the CPU block kernel (tinyloop/kernels/cpu_block.py) knows of these weights, built at its first use
    native: object = dataclasses.field(default=None, repr=False, compare=False)
    value_embed: torch.Tensor | None = None  # value_embeds: [vocab, kv_dim] table, and its gate [KV, VE_GATE_CHANNELS]
    ve_gate: torch.Tensor | None = None
    kernels: bool = True  # False: the model has fields the C blocks lack (ModelConfig.torch_only)

    def __post_init__(self):
        if not self.kernels:  # kernels/cpu_block.weights_struct then refuses the block: the torch path runs it
            self.native = False


@dataclass
class Weights:
    """Every matrix and norm weight of a forward and the operations that use them: linear(x, w) for every
    product, norm(x, w, eps) for every RMSNorm. `name` is the weight format (tinyloop/formats.py): the matrices are
    fp32 tensors or formats.QMatrix. `fused_weights` gives the model's own; the cached step
    (tinyloop/engine/forward.py) multiplies the same matrices through faster products."""
    name: str
    prelude: list[BlockWeights]
    core: list[BlockWeights]
    coda: list[BlockWeights]
    adapter: formats.Matrix | None
    final_norm: torch.Tensor
    head: formats.Matrix
    # F.linear over fp32 tensors; formats.linear (any format) when the matrices are QMatrix
    linear: Callable[[torch.Tensor, formats.Matrix], torch.Tensor] = F.linear  # type: ignore[assignment]
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm
    inject_decay: torch.Tensor | None = None  # diagonal injection: exp(-dt A) and dt per channel (B is `adapter`)
    inject_dt: torch.Tensor | None = None
    prelude_norm: torch.Tensor | None = None
    readout: formats.Matrix | None = None      # the d x d map of s_L before the coda


def _fuse(linears: list[nn.Linear | None], rebind: bool) -> torch.Tensor:
    """The linears' weights concatenated by rows. rebind: each linear's weight becomes a view of its rows of the
    result, so the fused matrix is the only copy (plan_memory counts the weights once)."""
    present = [lin for lin in linears if lin is not None]  # (relu2 has no gate)
    fused = _cat([lin.weight for lin in present])
    if rebind:
        row = 0
        for lin in present:
            n = lin.weight.shape[0]
            lin.weight = nn.Parameter(fused[row:row + n], requires_grad=lin.weight.requires_grad)
            row += n
    return fused


def _block_weights(block: Block, rebind: bool) -> BlockWeights:
    a, m = block.attn, block.mlp
    wqkv = _fuse([a.wq, a.wk, a.wv], rebind)
    bqkv = None if a.wq.bias is None else _cat([a.wq.bias, a.wk.bias, torch.zeros_like(a.wk.bias)])
    return BlockWeights(block.attn_norm.weight, wqkv, wqkv[a.wq.weight.shape[0]:], a.wo.weight, block.mlp_norm.weight,
                        _fuse([m.w_gate, m.w_up], rebind), m.w_down.weight,
                        block.attn_out_norm.weight if block.sandwich else None,
                        block.mlp_out_norm.weight if block.sandwich else None, bqkv, block.on_sum,
                        value_embed=None if block.value_embed is None else block.value_embed.weight,
                        ve_gate=None if block.ve_gate is None else block.ve_gate.weight, kernels=block.kernels)


def _all_weights(net: "LoopedLM", rebind: bool) -> Weights:
    prelude, core, coda = ([_block_weights(cast(Block, b), rebind) for b in part] for part in (net.prelude, net.core, net.coda))
    head = net.embed.weight if net.lm_head is None else net.lm_head.weight
    decay = dt = None
    if net.decay is not None and net.decay.dt_bias.is_meta:  # shapes only (shapes_only: no meta op)
        dt, decay = torch.empty_like(net.decay.dt_bias), torch.empty_like(net.decay.dt_bias)
    elif net.decay is not None:  # the reference's order of operations: dt = softplus(dt_bias), exp(-dt * exp(A_log))
        dt = F.softplus(net.decay.dt_bias)
        decay = torch.exp(-dt * torch.exp(net.decay.a_log))
    return Weights("fp32", prelude, core, coda, None if net.adapter is None else net.adapter.weight, net.norm.weight, head,
                   inject_decay=decay, inject_dt=dt,
                   prelude_norm=None if net.prelude_norm is None else net.prelude_norm.weight,
                   readout=None if net.readout is None else net.readout.weight)


_fused: "weakref.WeakKeyDictionary[LoopedLM, tuple]" = weakref.WeakKeyDictionary()
_params: "weakref.WeakKeyDictionary[LoopedLM, list]" = weakref.WeakKeyDictionary()


def weights_version(net: "LoopedLM") -> tuple[int, ...]:
    """The parameters' version counters: they move on any in-place change (load_state_dict, training). The
    parameter list is kept (walking the modules every step would cost a noticeable part of a decode step)."""
    params = _params.get(net)
    if params is None:
        params = _params[net] = list(net.parameters())
    return tuple(p._version for p in params)


def fused_weights(net: "LoopedLM") -> Weights:
    """The model's weights as a forward multiplies by them: [q|k|v] and [gate|up] fused into one matrix each.

    Inference: built once (and again after an in-place change of the parameters), the model's own linear
    weights becoming views of the fused matrices, so nothing is held twice. Training (gradients on): fused
    afresh in every forward, so the gradients reach the parameters. A model in another weight format holds its
    matrices only in that format (quantize_weights)."""
    if net.quantized is not None:
        return net.quantized
    if torch.is_grad_enabled() and any(p.requires_grad for p in net.parameters()):
        return _all_weights(net, rebind=False)
    cached = _fused.get(net)
    if cached is None or cached[0] != weights_version(net):
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: they keep version counters
            weights = _all_weights(net, rebind=True)
        _params.pop(net, None)  # rebinding made new parameters
        cached = _fused[net] = (weights_version(net), weights)
    return cached[1]


def _linears(net: "LoopedLM") -> list[nn.Linear]:
    """The linear layers whose weights the forward's matrices are made of (the exit gate, a [1, d] row, is not)."""
    blocks = [*net.prelude, *net.core, *net.coda]
    mods = [m for b in blocks for m in (b.attn.wq, b.attn.wk, b.attn.wv, b.attn.wo, b.mlp.w_gate, b.mlp.w_up, b.mlp.w_down)
            if m is not None]
    return mods + [m for m in (net.adapter, net.readout, net.lm_head) if m is not None]


def matrices(W: Weights) -> dict[str, formats.Matrix]:
    """The forward's matrices by name (prelude.0.wqkv, ..., adapter, head): what a quantised artifact stores."""
    out: dict[str, formats.Matrix] = {}
    for part in ("prelude", "core", "coda"):
        for i, w in enumerate(getattr(W, part)):
            for name in ("wqkv", "wo", "wgu", "w_down"):
                out[f"{part}.{i}.{name}"] = getattr(w, name)
    if W.adapter is not None:
        out["adapter"] = W.adapter
    if W.readout is not None:
        out["readout"] = W.readout
    out["head"] = W.head
    return out


def quantized_matrices(W: Weights | None) -> dict[str, formats.QMatrix]:
    """matrices() of a model holding its matrices in a weight format (net.quantized, not None): each a QMatrix."""
    assert W is not None
    out = {}
    for name, m in matrices(W).items():
        assert isinstance(m, formats.QMatrix)
        out[name] = m
    return out


def quantize_weights(net: "LoopedLM", fmt: str, group: int = formats.DEFAULT_GROUP,
                     stored: dict[str, formats.QMatrix] | None = None, act_quant: bool = False) -> None:
    """Hold every matrix of the forward (the linear layers and the head) in weight format `fmt` and release the
    linear layers' own weights, so each matrix is held once. The embedding table stays in the model's dtype (a
    decode step reads one row of it); a tied head gets its own quantised copy. stored: an artifact's quantised
    matrices by matrices()'s names, used instead of quantising the current weights. act_quant (int8 / int4): the
    products quantise their input rows (formats.QMatrix.act_quant). fp32 changes nothing."""
    formats.check_format(fmt, group)
    if net.quantized is not None:
        raise ConfigError(f"the model already holds {net.quantized.name} weights; load the fp32 model to re-quantise")
    if fmt == "fp32":
        return
    with torch.no_grad():
        W = fused_weights(net) if stored is None else _all_weights(net, rebind=False)  # norms and biases from net
        if stored is not None:
            mats = stored
        else:
            mats = {}
            for k, w in matrices(W).items():
                assert isinstance(w, torch.Tensor)  # the fp32 model's own matrices (net.quantized is None)
                q = formats.quantize(w, fmt, group)
                assert isinstance(q, formats.QMatrix)  # (fmt is not fp32)
                mats[k] = q
        if fmt in ("int8", "int4"):
            mats = {k: dataclasses.replace(m, act_quant=act_quant) for k, m in mats.items()}
        q_rows = net.cfg.n_heads * net.cfg.head_dim

        def blocks(part: str) -> list[BlockWeights]:
            out = []
            for i, w in enumerate(getattr(W, part)):
                qkv = mats[f"{part}.{i}.wqkv"]
                out.append(dataclasses.replace(w, native=None, wqkv=qkv, wkv=qkv.rows(q_rows, qkv.shape[0]), wo=mats[f"{part}.{i}.wo"],
                                               wgu=mats[f"{part}.{i}.wgu"], w_down=mats[f"{part}.{i}.w_down"]))
            return out

        quantized = Weights(fmt, blocks("prelude"), blocks("core"), blocks("coda"), mats.get("adapter"), W.final_norm,
                            mats["head"], formats.linear, inject_decay=W.inject_decay, inject_dt=W.inject_dt,
                            prelude_norm=W.prelude_norm, readout=mats.get("readout"))
        release_linears(net)
        net.quantized = quantized


def release_linears(net: "LoopedLM") -> None:
    """Empty the linear layers' weights (a quantised model's matrices live in net.quantized), on the embedding's
    device: a model built on the meta device may then move."""
    empty = torch.empty(0, dtype=net.norm.weight.dtype, device=net.norm.weight.device)
    for lin in _linears(net):
        lin.weight = nn.Parameter(empty.clone(), requires_grad=False)
    _fused.pop(net, None)
    _params.pop(net, None)


def weight_format(net: "LoopedLM") -> str:
    """The format the forward's matrices are held in: fp32 (the model's own tensors, whatever their dtype) or a
    quantised one."""
    return "fp32" if net.quantized is None else net.quantized.name


def weight_bytes(net: "LoopedLM") -> int:
    """Bytes of every weight the model holds: its parameters and, in a quantised format, the quantised matrices."""
    held = sum(p.numel() * p.element_size() for p in net.parameters())
    return held + (0 if net.quantized is None else sum(formats.nbytes(m) for m in matrices(net.quantized).values()))


# --- the math ---------------------------------------------------------------------------------------------
def block(cfg: ModelConfig, w: BlockWeights, x: torch.Tensor, ctx, slot: int) -> torch.Tensor:
    """One pre-norm block over the chunk's token rows x [B*T, d]. The context `ctx` says where the chunk sits
    (ctx.B lanes of ctx.T tokens), rotates q and k (ctx.rope) and attends (ctx.attend: within the chunk, or
    over the paged cache of layer slot `slot`); ctx.weights brings the products and norms."""
    lin, norm, eps = ctx.weights.linear, ctx.weights.norm, cfg.norm_eps
    B, T, H, KV, hd = ctx.B, ctx.T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = norm(x, w.attn_norm, eps)
    qkv = lin(h, w.wqkv)  # [B*T, d + 2 kv]
    if w.bqkv is not None:
        qkv = qkv + w.bqkv
    qk = ctx.rope(qkv[:, :(H + KV) * hd].view(B, T, H + KV, hd))
    if cfg.qk_norm:  # Parcae: each q and k head RMS-normalised (no weight, the dtype's eps) after RoPE
        qk = F.rms_norm(qk, (hd,))
    v = qkv[:, (H + KV) * hd:].view(B, T, KV, hd)
    if w.value_embed is not None:
        v = v + value_embedding(w, h, ctx).view(B, T, KV, hd)
    out = ctx.attend(w, slot, qk[:, :, :H], h.view(B, T, -1), qk[:, :, H:], v)  # [B, H, T, hd]
    a = lin(out.transpose(1, 2).reshape(B * T, H * hd), w.wo)
    if w.on_sum:  # Huginn: the sandwich norms normalise the residual sums
        x = norm(x + a, w.attn_out_norm, eps)
    else:
        x = x + (norm(a, w.attn_out_norm, eps) if w.attn_out_norm is not None else a)
    if cfg.mlp == "relu2":  # Parcae: w_down(relu(w_up h)^2 / 2), no gate
        m = lin(F.relu(lin(norm(x, w.mlp_norm, eps), w.wgu)).square() * 0.5, w.w_down)
    else:
        gate, up = lin(norm(x, w.mlp_norm, eps), w.wgu).chunk(2, dim=-1)
        m = lin(F.silu(gate) * up, w.w_down)
    if w.on_sum:
        return norm(x + m, w.mlp_out_norm, eps)
    return x + (norm(m, w.mlp_out_norm, eps) if w.mlp_out_norm is not None else m)


def value_embedding(w: BlockWeights, h: torch.Tensor, ctx) -> torch.Tensor:
    """What a value-embedding layer adds to V, [B*T, KV, hd]: the chunk's tokens' rows of its table, each KV head
    gated by 2 sigmoid(ve_gate h[:VE_GATE_CHANNELS]) in (0, 2). The tokens are the chunk's (ctx.ids, set by encode)."""
    ids = getattr(ctx, "ids", None)
    if ids is None:
        raise ModeError("this model's value embeddings need every token's id in every layer, and a forward that "
                        "continues latent states (speculative verification, warm start) does not carry them: "
                        "use plain decode for this model")
    assert w.ve_gate is not None and w.value_embed is not None  # (a value-embedding layer's)
    gate = 2 * torch.sigmoid(F.linear(h[:, :VE_GATE_CHANNELS], w.ve_gate))  # [B*T, KV]
    table = F.embedding(ids, w.value_embed)
    return gate.unsqueeze(-1) * table.view(*gate.shape, -1)


def blocks(cfg: ModelConfig, ws: list[BlockWeights], x: torch.Tensor, ctx, slots: list[int]) -> torch.Tensor:
    """`block` over consecutive blocks ws writing layer slots `slots`; the cached step's decode rows run them as
    one C call (kernels/cpu_block.py)."""
    if ctx.native is not None:
        return ctx.native.blocks(ws, x, slots)
    for w, slot in zip(ws, slots):
        x = block(cfg, w, x, ctx, slot)
    return x


class Dense:
    """The context of a forward without a cache (training, full recompute): causal attention within the chunk,
    or within a sliding window when step.window is set (the reference for the ring buffer)."""

    native = None  # no C block kernel: that is for the cached step's decode rows
    ids = None  # the chunk's token ids [B*T], set by encode for value embeddings

    def __init__(self, weights: Weights, step: Step):
        self.weights, self.step = weights, step
        self.B, self.T = step.pos.shape
        self.cos, self.sin = rope_factors(step.cos, step.sin)

    def rope(self, qk: torch.Tensor) -> torch.Tensor:
        return rotate(qk, self.cos, self.sin)

    def attend(self, w: BlockWeights, slot: int, q, h, k, v) -> torch.Tensor:
        mask, causal = None, True
        if self.step.window:
            qp, kp = self.step.pos.unsqueeze(-1), self.step.pos.unsqueeze(1)
            mask, causal = ((kp <= qp) & (kp > qp - self.step.window)).unsqueeze(1), False
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, is_causal=causal, enable_gqa=True)


def inject(kind: str, W: Weights, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """What a loop's core reads, from the state s and the prelude output e (rows [N, d]); ModelConfig.injection."""
    if kind == "none":
        return s
    if kind == "add":
        return s + e
    assert W.adapter is not None  # (the adapter and diagonal injections have one)
    if kind == "adapter":
        return W.linear(torch.cat((s, e), dim=-1), W.adapter)
    assert W.inject_decay is not None and W.inject_dt is not None
    return s * W.inject_decay + W.inject_dt * W.linear(e, W.adapter)  # diagonal (Parcae): per-channel decay of s


class LoopedLM(nn.Module):
    rope_cos: torch.Tensor  # buffers (register_buffer)
    rope_sin: torch.Tensor
    init_noise: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_seq_len: int = 2048):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        P, R, d = cfg.n_prelude, cfg.n_core, cfg.d_model
        self.prelude = nn.ModuleList(Block(cfg, i) for i in range(P))
        self.core = nn.ModuleList(Block(cfg, P + j) for j in range(R))
        self.coda = nn.ModuleList(Block(cfg, P + R + i) for i in range(cfg.n_coda))
        # the injection's matrix: W of adapter's W [s ; e], B of diagonal's s * decay + dt * B e
        self.adapter = nn.Linear(2 * d if cfg.injection == "adapter" else d, d, bias=False) \
            if cfg.injection in ("adapter", "diagonal") else None
        self.decay = DiagonalDecay(d) if cfg.injection == "diagonal" else None
        self.prelude_norm = RMSNorm(d, cfg.norm_eps) if cfg.prelude_norm else None
        self.readout = nn.Linear(d, d, bias=False) if cfg.readout else None
        self.exit_gate = nn.Linear(cfg.d_model, 1) if cfg.exit_gate else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.quantized: Weights | None = None  # the matrices in a weight format other than fp32 (quantize_weights)
        self.set_max_seq_len(max_seq_len)
        self.apply(self._init_weights)

    def set_max_seq_len(self, max_seq_len: int) -> None:
        """Position tables (RoPE, the per-position initial noise) for positions 0..max_seq_len-1. Growing them keeps
        every existing entry's value (both are functions of the position alone), so a sliding-window sequence
        may run past the length the model was loaded with (ensure_positions)."""
        cos, sin = rope_tables(self.cfg.head_dim, max_seq_len, self.cfg.rope_theta)
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)
        if self.cfg.state_init == "normal":  # one fixed noise vector per position: cached == recomputed
            g = torch.Generator().manual_seed(self.cfg.init_seed)
            noise = torch.randn(max_seq_len, self.cfg.d_model, generator=g, device="cpu")
            if self.cfg.init_trunc:  # Huginn: a truncated normal (values outside +-init_trunc sigma redrawn)
                t = self.cfg.init_trunc
                noise = nn.init.trunc_normal_(noise, 0.0, 1.0, -t, t, generator=g)
            noise = noise * self.cfg.init_sigma
            self.register_buffer("init_noise", noise.to(device), persistent=False)
        self.max_seq_len = max_seq_len

    def ensure_positions(self, n: int) -> None:
        """Position tables reach at least n positions (doubling, so a long windowed run grows them rarely)."""
        if n > self.max_seq_len:
            self.set_max_seq_len(max(n, 2 * self.max_seq_len))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    # --- pieces: each takes the chunk's context (Dense, or the cached step of tinyloop/engine/forward.py) -----
    def make_step(self, pos: torch.Tensor, end: int | None = None, window: int = 0) -> Step:
        if end is None:
            end = int(pos.max()) + 1
        return Step(pos, end, self.rope_cos, self.rope_sin, window)

    def dense(self, step: Step) -> Dense:
        return Dense(fused_weights(self), step)

    def encode(self, ids: torch.Tensor, ctx) -> torch.Tensor:
        """Embedding and prelude of ids [B, T]: e [B, T, d], the input every loop is injected with."""
        x = self.embed(ids.reshape(-1))
        if self.cfg.embed_scale != 1:
            x = x * self.cfg.embed_scale
        if self.cfg.value_embeds:  # the layers' value embeddings read the tokens (value_embedding)
            ctx.ids = ids.reshape(-1)
        prelude = ctx.weights.prelude
        x = blocks(self.cfg, prelude, x, ctx, list(range(len(prelude))))
        if self.cfg.prelude_norm:  # Parcae: e is the normalised prelude output
            x = ctx.weights.norm(x, ctx.weights.prelude_norm, self.cfg.norm_eps)
        return x.view(ctx.B, ctx.T, -1)

    def init_state(self, e: torch.Tensor, step: Step) -> torch.Tensor:
        if self.cfg.state_init == "zeros":
            return torch.zeros_like(e)
        if self.cfg.state_init == "embed":
            return e
        return self.init_noise[step.pos].to(e.dtype)

    def loop(self, s: torch.Tensor, e: torch.Tensor, k: int, ctx) -> torch.Tensor:
        """One pass of the shared core at loop k (0-based): s_{k+1} = core(inject(s_k, e)); s, e [B, T, d]."""
        W, d = ctx.weights, s.shape[-1]
        x = inject(self.cfg.injection, W, s.reshape(-1, d), e.reshape(-1, d))
        x = blocks(self.cfg, W.core, x, ctx, [self.cfg.core_slot(k, j) for j in range(len(W.core))])
        if self.cfg.loop_norm:  # Ouro: every loop ends with the final norm, and the normalised state loops on
            x = W.norm(x, W.final_norm, self.cfg.norm_eps)
        return x.view(ctx.B, ctx.T, d)

    def exit_prob(self, s: torch.Tensor) -> torch.Tensor | None:
        return None if self.exit_gate is None else torch.sigmoid(self.exit_gate(s)).squeeze(-1)

    def decode_head(self, s: torch.Tensor, ctx, last_only: bool = False) -> torch.Tensor:
        """Coda, final norm and head of states s [B, T, d]: logits [B, T, V] ([B, 1, V]: the last position's
        only, when that is all the caller uses: a prefill's head is then one row, not T)."""
        W, d, cfg = ctx.weights, s.shape[-1], self.cfg
        x = s.reshape(-1, d)
        if W.readout is not None:  # Parcae: a linear map of s_L (its C) before the coda
            x = W.linear(x, W.readout)
        if cfg.coda_norm:  # Huginn: the final norm also before the coda
            x = W.norm(x, W.final_norm, cfg.norm_eps)
        x = blocks(cfg, W.coda, x, ctx, [cfg.coda_slot(i) for i in range(len(W.coda))])
        if last_only:
            x = x.view(ctx.B, ctx.T, d)[:, -1]
        if cfg.final_norm:
            x = W.norm(x, W.final_norm, cfg.norm_eps)
        logits = W.linear(x, W.head)
        if cfg.logit_scale != 1:
            logits = logits * cfg.logit_scale
        if cfg.logit_softcap:
            logits = cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)
        return logits.view(ctx.B, 1 if last_only else ctx.T, -1)

    def run_loops(self, s: torch.Tensor, e: torch.Tensor, ctx, first: int, last: int,
                  exits: "ChunkExits | None" = None) -> torch.Tensor:
        """Loops first..last-1 of states s [B, T, d], injected with the prelude's output e, over every row of the
        context: the one loop driver, under the dense forward, the cached forward of a loop range (engine/forward.py:
        `loop_range`) and each pass of an iteration step (engine/iteration.py). exits: a chunk's exit choice per
        token (the cdf rule), noted after each loop (the chunk still runs every loop: its K/V are all needed)."""
        for k in range(first, last):
            s = self.loop(s, e, k, ctx)
            if exits is not None:
                exits.after(k, s)
        return s

    def chunk_exits(self, s: torch.Tensor, loops: int, exit_threshold: "ExitRule | float") -> "ChunkExits | None":
        """The exit choice of a chunk whose tokens start from states s at loop 0 (Ouro's cdf rule with a threshold:
        each position's logits come from the loop it exits at, as the reference does for every position), or None
        (the chunk's logits are its last loop's)."""
        rule = ExitRule.of(exit_threshold, self.cfg.exit_rule)
        return ChunkExits(self, s, loops, rule) if rule.threshold > 0 and rule.rule == "cdf" else None

    # --- whole forward ------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, loops: int, step: Step | None = None, grad_loops: int | None = None,
                return_states: bool = False, exit_threshold: float = 0.0, last_only: bool = False):
        """Logits [B, T, V] for a chunk ids [B, T]: the plain causal forward over the chunk, with no cache (training,
        full recompute; a forward over the paged cache is tinyloop.engine.forward.forward).

        grad_loops: when training, backpropagate through only the last `grad_loops` loops (the earlier ones
        run without autograd), which bounds memory and compute like truncated backprop through time.
        exit_threshold: under the cdf exit rule (Ouro) each position's logits come from the loop it exits at
        (chunk_exits). last_only: logits of the last position only ([B, 1, V]).
        """
        if step is None:
            T = ids.shape[1]
            step = self.make_step(torch.arange(T, device=ids.device).expand(ids.shape[0], T), T)
        ctx = self.dense(step)
        e = self.encode(ids, ctx)
        s = self.init_state(e, ctx.step)
        states = [s]
        no_grad_until = loops - grad_loops if grad_loops is not None else 0
        exits = self.chunk_exits(s, loops, exit_threshold)
        for k in range(loops):  # (loop by loop: the states are kept, the first loops run without autograd)
            with torch.no_grad() if k < no_grad_until else contextlib.nullcontext():
                s = self.run_loops(s, e, ctx, k, k + 1, exits)
            if return_states:
                states.append(s)
        logits = self.decode_head(s if exits is None else exits.out, ctx, last_only)
        return (logits, states) if return_states else logits

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # --- adaptive depth (early exit, per-lane loop counts) ---------------------------------------------
    def adaptive(self, rule: "ExitRule | float") -> bool:
        """Whether decoding under this exit rule (or the model's rule at this threshold) may exit early: a threshold,
        or (latent rule) an exit gate at 0.5. Under the cdf rule (Ouro) the gate acts only with a threshold: 0 runs
        every loop, like the reference's 1.0."""
        rule = ExitRule.of(rule, self.cfg.exit_rule)
        return rule.threshold > 0 or (self.exit_gate is not None and rule.rule == "latent")

    def exit_mask(self, s_prev: torch.Tensor, s_new: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
        """[B] True where a lane's token may stop looping: small relative latent change (threshold > 0; a float or
        one per lane), or the exit gate fires."""
        B = s_new.shape[0]
        done = torch.zeros(B, dtype=torch.bool, device=s_new.device)
        thr = torch.as_tensor(threshold, dtype=torch.float32, device=s_new.device).expand(B).view(B, 1)
        if bool((thr > 0).any()):
            rel = (s_new - s_prev).float().norm(dim=-1) / s_new.float().norm(dim=-1).clamp_min(1e-12)
            done |= ((rel < thr) & (thr > 0)).all(dim=-1)
        gate = self.exit_prob(s_new)
        if gate is not None:
            done |= (gate >= 0.5).all(dim=-1)
        return done


class ChunkExits:
    """A chunk's exit choice per token under Ouro's cdf rule (LoopedLM.chunk_exits): the loop each token exits at,
    and the states to take logits from. The chunk runs every loop (its K/V are all needed); each token's logits come
    from the state of the loop it exits at. The decision is exits.exit_stops, the one the engine's loop iterations
    make for a decoding token."""

    def __init__(self, net: LoopedLM, s: torch.Tensor, loops: int, rule: ExitRule):
        B, T = s.shape[:2]
        self.net, self.loops, self.rules = net, loops, [rule] * B
        self.out = s.clone()
        self.chosen = torch.zeros(B, T, dtype=torch.bool, device=s.device)  # tokens whose exit loop is decided
        self.track = Track.start(B, T, net.cfg.vocab_size, s.device)

    def after(self, k: int, s: torch.Tensor) -> None:
        """Loop k (0-based) gave the chunk's states s [B, T, d]."""
        B = s.shape[0]
        last = torch.full((B, 1), k == self.loops - 1, device=s.device)
        stop = exit_stops(self.net, self.rules, [k + 1] * B, last, None, s, self.track)
        self.out = torch.where(self.chosen.unsqueeze(-1), self.out, s)
        self.chosen |= stop
