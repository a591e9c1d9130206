"""tinyloop/kernels/cpu_block.c: a decode step's blocks as one C call each, against model.block through torch (the
same decode with the C blocks switched off), in every weight format and the model variants real checkpoints bring;
batch and thread invariance; which steps take the path."""
from __future__ import annotations

import pytest
import torch

from tinyloop.cache import KVCache
from tinyloop.config import ModelConfig
from tinyloop.kernels import cpu_block
from tinyloop.engine import forward as paged
from tinyloop.model import LoopedLM, fused_weights, quantize_weights

from test_cpu_kernels import needs_kernels

pytestmark = needs_kernels

BASE = dict(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_prelude=1, n_core=2, n_coda=1,
            max_loops=3)
VARIANTS = {
    "plain": {},
    "gqa4_untied": dict(n_heads=8, n_kv_heads=2, d_model=128, tie_embeddings=False, ffn_hidden=136),
    "mha_hd32": dict(n_heads=2, n_kv_heads=2),
    "hd8": dict(d_model=32, n_heads=4, n_kv_heads=2),  # one 8-wide vector per head
    "qk_bias": dict(qk_bias=True),  # Ouro-style biases on q and k
    "sandwich": dict(sandwich_norm=True),
    "huginn": dict(sandwich_norm=True, sandwich_residual=True, n_kv_heads=4, injection="adapter"),
}


def make_net(cfg: ModelConfig, weights: str = "fp32", act_quant: bool = False) -> LoopedLM:
    torch.manual_seed(0)
    net = LoopedLM(cfg, 128).eval().requires_grad_(False)
    with torch.no_grad():  # biases are zero at init: give them values, so a dropped bias shows
        for name, p in net.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    quantize_weights(net, weights, 32, act_quant=act_quant)
    return net


def decode(net: LoopedLM, lengths: list[int], steps: int, native: bool | str, monkeypatch, loops: int = 3,
           lanes: list[int] | None = None) -> tuple[torch.Tensor, list[bool]]:
    """Per-lane prefill of random prompts, then greedy decode rows of `lanes` (default: all) for `steps` steps:
    logits [steps, len(lanes), V], and whether each step ran in C. native: True, the whole step in one C call
    (DecodeStep) where it can, else the C blocks; "blocks", the C blocks under model.forward; False, torch."""
    cfg = net.cfg
    with monkeypatch.context() as m:
        if not native:
            m.setattr(cpu_block, "supported", lambda *a: False)
        if native == "blocks":
            m.setattr(cpu_block, "decode_step", lambda *a: None)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, cfg.vocab_size, (1, n), generator=gen) for n in lengths]
        tokens = torch.randint(0, cfg.vocab_size, (len(lengths), 1), generator=gen)
        lanes = list(range(len(lengths))) if lanes is None else lanes
        cache = KVCache(cfg, len(lengths), 128, "fp16").reserve_all()
        took, out = [], []
        real_context, real_run = paged.context, cpu_block.DecodeStep.run
        m.setattr(paged, "context", lambda *a: (ctx := real_context(*a), took.append(ctx.native is not None))[0])
        m.setattr(cpu_block.DecodeStep, "run", lambda *a, **k: (took.append("step"), real_run(*a, **k))[1])
        with torch.inference_mode():
            for lane, ids in enumerate(prompts):  # (through torch in every arm: the same cells for the decode rows)
                paged.chunk_loops(net, net.make_step(torch.arange(ids.shape[1]).unsqueeze(0)), cache.lane_view(lane),
                                   0, loops, paged.Latent.empty(1, ids.shape[1], net), ids)
            view = cache.select(lanes)
            pos = torch.tensor([lengths[i] for i in lanes]).unsqueeze(1)
            tok = tokens[lanes]
            took.clear()
            for _ in range(steps):
                logits = paged.forward(net, tok, loops, net.make_step(pos, int(pos.max()) + 1), view)
                out.append(logits[:, 0])
                tok, pos = logits.argmax(-1), pos + 1
    assert len(took) == steps
    return torch.stack(out), took


@pytest.mark.parametrize("variant", VARIANTS)
def test_c_blocks_match_torch_blocks(variant, monkeypatch):
    """Ragged lanes whose keys cross blocks of 16 cells and are not a multiple of 8 (the softmax tails)."""
    net = make_net(ModelConfig(**{**BASE, **VARIANTS[variant]}))
    lengths = [37, 5, 20]
    got, took = decode(net, lengths, 6, "blocks", monkeypatch)
    want, took_torch = decode(net, lengths, 6, False, monkeypatch)
    assert took == [True] * 6 and not any(took_torch)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    whole, took = decode(net, lengths, 6, True, monkeypatch)
    assert took == ["step"] * 6 and torch.equal(whole, got)


# Loop structures beyond VARIANTS: every injection, state init and norm placement the model family has.
STEP_VARIANTS = {
    "add_zeros": dict(injection="add", state_init="zeros"),
    "none_embed": dict(injection="none", state_init="embed"),
    "adapter_noise": dict(injection="adapter", state_init="normal", init_trunc=3.0, embed_scale=8.0),
    "ouro": dict(injection="none", state_init="embed", loop_norm=True, final_norm=False, n_prelude=0, n_coda=0,
                 qk_bias=True),
    "huginn": dict(injection="adapter", state_init="normal", coda_norm=True, sandwich_norm=True,
                   sandwich_residual=True, embed_scale=8.0),
}


@pytest.mark.parametrize("variant", STEP_VARIANTS)
def test_the_whole_step_in_c_has_the_bits_of_the_step_through_python(variant, monkeypatch):
    """DecodeStep calls the same C pieces as model.forward over the C blocks, in the same order: the same bits, for
    every loop structure; and it decodes what torch decodes."""
    net = make_net(ModelConfig(**{**BASE, **STEP_VARIANTS[variant]}))
    lengths = [21, 3]
    got, took = decode(net, lengths, 5, True, monkeypatch)
    want, took_blocks = decode(net, lengths, 5, "blocks", monkeypatch)
    assert took == ["step"] * 5 and took_blocks == [True] * 5
    assert torch.equal(got, want)
    torch_logits, _ = decode(net, lengths, 5, False, monkeypatch)
    torch.testing.assert_close(got, torch_logits, atol=2e-5, rtol=1e-5)


def test_the_whole_step_follows_the_models_tables(monkeypatch):
    """A DecodeStep is kept per model and weights (every loop count), and built again when the position tables grow
    (the old ones are freed) or the weights change."""
    net = make_net(ModelConfig(**{**BASE, **STEP_VARIANTS["adapter_noise"]}))
    first = cpu_block.decode_step(net, fused_weights(net))
    assert first is cpu_block.decode_step(net, fused_weights(net)) and first.positions == 128
    net.set_max_seq_len(256)
    grown = cpu_block.decode_step(net, fused_weights(net))
    assert grown is not first and grown.positions == 256
    got, took = decode(net, [40], 3, True, monkeypatch)
    want, _ = decode(net, [40], 3, "blocks", monkeypatch)
    assert took == ["step"] * 3 and torch.equal(got, want)
    quantize_weights(net, "int8", 32)
    assert cpu_block.decode_step(net, fused_weights(net)) is not grown


def test_the_whole_step_copies_a_shared_block_before_writing_it():
    """DecodeStep skips checking blocks while its lanes stay in the blocks it checked and the pool changed nothing
    (its epoch). A block shared meanwhile (a handle or the prefix cache retains it) changes the epoch: a forward into
    it raises (forwards take and copy no block), and once the blocks are taken again the lane writes its own copy, so
    what the sharer holds stays as it was."""
    from tinyloop.cache import UnreservedBlock
    cfg = ModelConfig(**BASE)
    net = make_net(cfg)
    cache = KVCache(cfg, 1, 128, "fp16")
    tok = torch.tensor([[7]])
    with torch.inference_mode():
        for p in range(3):  # cells 0..2 of the first block of 16
            cache.reserve([0], [p], [p], 2)
            paged.forward(net, tok, 2, net.make_step(torch.tensor([[p]]), p + 1), cache)
        written = [s for s in range(len(cache.held)) if cache.held[s][0]]
        assert len(written) == cfg.n_prelude + 2 * cfg.n_core + cfg.n_coda
        span = cache.share(written, 3)
        before = {s: cache.pool.store["k"][ids[0]].clone() for s, ids in span.blocks.items()}
        with pytest.raises(UnreservedBlock, match="cells 3..3 of lane 0"):
            paged.forward(net, tok, 2, net.make_step(torch.tensor([[3]]), 4), cache)
        cache.reserve([0], [3], [3], 2)  # copy-on-write: what a step's schedule does
        paged.forward(net, tok, 2, net.make_step(torch.tensor([[3]]), 4), cache)
    for s, ids in span.blocks.items():
        assert torch.equal(cache.pool.store["k"][ids[0]], before[s])  # the shared block: untouched
        assert cache.held[s][0][0] != ids[0]  # the lane writes its own copy
        assert cache.pool.store["k"][cache.held[s][0][0], 3].abs().sum() > 0


def test_decode_rows_is_forward_of_those_rows(monkeypatch):
    """engine.forward.decode_rows (the engine's decode, token lists in, no tensors built on the C path) gives
    forward's logits, on the C path and, with it off, through torch."""
    cfg = ModelConfig(**{**BASE, **STEP_VARIANTS["adapter_noise"]})
    net = make_net(cfg)
    for native in (True, False):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(cpu_block, "supported", lambda *a: False)
            caches = [KVCache(cfg, 2, 128, "fp16").reserve_all() for _ in range(2)]
            with torch.inference_mode():
                for p in range(3):
                    tokens, positions = [5 + p, 60 - p], [p, p]
                    rows = paged.decode_rows(net, tokens, positions, 2, caches[0])
                    ids, pos = torch.tensor(tokens).view(2, 1), torch.tensor(positions).view(2, 1)
                    full = paged.forward(net, ids, 2, net.make_step(pos, p + 1), caches[1])[:, -1]
                    assert rows.shape == (2, cfg.vocab_size) and torch.equal(rows, full)


def test_the_whole_step_refuses_what_it_cannot_index():
    """C indexes the embedding and the position tables by the step's tokens and positions: out-of-range ones are
    an IndexError naming them, as torch's embedding would raise, not a read outside the tables."""
    cfg = ModelConfig(**BASE)
    net = make_net(cfg)
    cache = KVCache(cfg, 1, 128, "fp16").reserve_all()
    with torch.inference_mode():
        for ids, pos, what in (([[96]], [[3]], "token id 96"), ([[-1]], [[3]], "token id -1"),
                               ([[5]], [[128]], "position 128")):
            with pytest.raises(IndexError, match=what):
                paged.forward(net, torch.tensor(ids), 2, net.make_step(torch.tensor(pos), pos[0][0] + 1), cache)


def test_an_iteration_step_refuses_what_it_cannot_index():
    """DecodeStep.iterate (rows at their own loop indices, engine/iteration.py) checks what C indexes by: tokens,
    positions, loop indices, the latent rows it writes."""
    cfg = ModelConfig(**BASE)
    net = make_net(cfg)
    step, cache = cpu_block.decode_step(net, fused_weights(net)), KVCache(cfg, 2, 128, "fp16").reserve_all()
    e, s = torch.zeros(2, cfg.d_model), torch.zeros(2, cfg.d_model)
    with torch.inference_mode():
        for cells, loop, tokens, err, what in (([0, 0], [0, 0], [96, 1], IndexError, "token id 96"),
                                               ([0, 128], [0, 0], [1, 1], IndexError, "position 128"),
                                               ([0, 0], [0, 3], [1, None], ValueError, "loop index 3 is outside"),
                                               ([0, 0], [0, 1], [1, 2], ValueError, "starts a token at loop index 1"),
                                               ([0, 0], [0], [1, 2], ValueError, "1 loops")):
            with pytest.raises(err, match=what):
                step.iterate(cache, cells, loop, tokens, [True, True], e, s)
        with pytest.raises(ValueError, match="latent rows"):
            step.iterate(cache, [0, 0], [0, 0], [1, 2], [True, True], e[:1], s)
        with pytest.raises(IndexError, match="lane -1"):
            step.iterate(cache, [0, 0], [0, 0], [1, 2], [True, True], e, s, lanes=[0, -1])
        logits = step.iterate(cache, [0, 0], [0, 0], [1, 2], [False, True], e, s)
    assert logits.shape == (1, cfg.vocab_size)


@pytest.mark.parametrize("fmt,act_quant", [("bf16", False), ("int8", False), ("int4", False), ("int8", True),
                                           ("int4", True)])
def test_c_blocks_multiply_in_every_weight_format(fmt, act_quant, monkeypatch):
    """The C blocks agree with torch's to fp32 rounding. With act_quant that holds only while no activation lies
    within rounding of a quantisation step's midpoint (norm outputs agree to rounding, not bit for bit, and one
    flipped int8 value moves the logits by ~1e-3): lanes of 9 and 30 tokens meet one such value, 10 and 31 none."""
    cfg = ModelConfig(**{**BASE, **VARIANTS["qk_bias"]})
    net = make_net(cfg, fmt, act_quant)
    got, took = decode(net, [10, 31], 4, True, monkeypatch)
    want, _ = decode(net, [10, 31], 4, False, monkeypatch)
    assert took == ["step"] * 4
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(got, decode(net, [10, 31], 4, "blocks", monkeypatch)[0])
    fp32, _ = decode(make_net(cfg), [10, 31], 4, True, monkeypatch)
    assert (got[0] - fp32[0]).abs().max() > 1e-4  # the format's matrices, not fp32 ones, were multiplied
    if act_quant:  # and the activations were quantised: not the weight-only product
        weight_only, _ = decode(make_net(cfg, fmt), [10, 31], 4, True, monkeypatch)
        assert (got[0] - weight_only[0]).abs().max() > 1e-4


@pytest.mark.parametrize("threads", (1, 2))
def test_a_lane_gets_the_same_bits_alone_or_batched(threads, monkeypatch):
    """Batch invariance: each lane's logits alone equal, bit for bit, its logits in a batch of lanes of other
    lengths; and 1 or 2 threads give the same bits."""
    net = make_net(ModelConfig(**{**BASE, **VARIANTS["gqa4_untied"]}))
    lengths = [33, 7, 18, 2]
    monkeypatch.setenv("TINYLOOP_DECODE_THREADS", str(threads))
    batched, _ = decode(net, lengths, 5, True, monkeypatch)
    for lane in range(len(lengths)):
        alone, _ = decode(net, lengths, 5, True, monkeypatch, lanes=[lane])
        assert torch.equal(alone[:, 0], batched[:, lane]), lane
    monkeypatch.setenv("TINYLOOP_DECODE_THREADS", str(3 - threads))
    other, _ = decode(net, lengths, 5, True, monkeypatch)
    assert torch.equal(other, batched)


def test_which_steps_take_the_c_blocks(monkeypatch):
    """Decode rows of the fp16 cache mode in fp32 do; prefill chunks, quantised caches, rings, head sizes the kernel
    does not take (12: not a multiple of 8), and TINYLOOP_CPU_KERNELS=0 run torch, and still decode the same."""
    cfg = ModelConfig(**BASE)
    net = make_net(cfg)
    pos, ids = torch.tensor([[0]]), torch.tensor([[3]])

    def native(cache: KVCache, pos=pos, net=net) -> bool:
        return paged.context(net, net.make_step(pos, int(pos.max()) + 1), cache).native is not None

    assert native(KVCache(cfg, 1, 32, "fp16"))
    assert not native(KVCache(cfg, 1, 32, "fp16"), torch.arange(4).unsqueeze(0))  # a prefill chunk
    assert not native(KVCache(cfg, 1, 32, "int8"))
    assert not native(KVCache(cfg, 1, 32, "fp16", window=8))
    monkeypatch.setenv("TINYLOOP_CPU_KERNELS", "0")
    assert not native(KVCache(cfg, 1, 32, "fp16"))
    monkeypatch.delenv("TINYLOOP_CPU_KERNELS")
    odd = ModelConfig(**{**BASE, "d_model": 48, "n_heads": 4})  # head size 12: not a multiple of 8
    odd_net = make_net(odd)
    assert not native(KVCache(odd, 1, 32, "fp16"), net=odd_net)
    got, took = decode(odd_net, [5], 3, True, monkeypatch)
    assert not any(took)


def test_int4_widths_the_group_does_not_divide(monkeypatch):
    """An FFN of 104 in int4 groups of 32 is held zero-padded to 128 (like the bundled model's 688): the C block
    pads its input rows to match."""
    net = make_net(ModelConfig(**{**BASE, "ffn_hidden": 104}), "int4")
    assert net.quantized.core[0].w_down.padded_width == 128
    got, took = decode(net, [9, 30], 4, True, monkeypatch)
    want, _ = decode(net, [9, 30], 4, False, monkeypatch)
    assert took == ["step"] * 4
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


# --- the forward over a loop range (engine/forward.py: forward_loops), the speculative rounds' one driver ----------
def prefilled(net: LoopedLM, n: int, lanes: int = 1) -> KVCache:
    cache = KVCache(net.cfg, lanes, 128, "fp16").reserve_all()
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for lane in range(lanes):
            ids = torch.randint(0, net.cfg.vocab_size, (1, n), generator=gen)
            paged.forward(net, ids, 3, net.make_step(torch.arange(n).unsqueeze(0)), cache.lane_view(lane))
    return cache


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("variant", ["adapter_noise", "ouro", "huginn"])
def test_a_loop_range_is_the_forward_split_in_two(variant, native, monkeypatch):
    """forward_loops from 0 to L with the head gives forward's logits bit for bit (C step and torch), and running 0..D
    then D..L from the latent it left gives the same bits and the same cache."""
    if not native:
        monkeypatch.setattr(cpu_block, "supported", lambda *a: False)
    net = make_net(ModelConfig(**{**BASE, **STEP_VARIANTS[variant]}))
    ids, step = torch.tensor([[11], [40]]), net.make_step(torch.tensor([[20], [20]]), 21)
    with torch.inference_mode():
        caches = [prefilled(net, 20, 2) for _ in range(3)]
        want = paged.forward(net, ids, 3, step, caches[0])
        whole = paged.forward_loops(net, step, caches[1], 0, 3, paged.Latent.empty(2, 1, net), ids)
        lat = paged.Latent.empty(2, 1, net)
        assert paged.forward_loops(net, step, caches[2], 0, 1, lat, ids, head=False) is None
        split = paged.forward_loops(net, step, caches[2], 1, 3, lat)
    assert torch.equal(whole, want) and torch.equal(split, want)
    assert torch.equal(caches[2].dense("k"), caches[0].dense("k"))


def test_a_chunk_of_rows_is_its_tokens_decoded_one_at_a_time(monkeypatch):
    """The C step runs a chunk of one lane (consecutive cells, each row attending up to its own) with the bits of
    those tokens decoded one after another: the logits a speculative verification compares are plain decode's."""
    net = make_net(ModelConfig(**{**BASE, **VARIANTS["huginn"]}))
    toks, P = [5, 17, 60, 2, 33], 19
    with torch.inference_mode():
        one, chunk = prefilled(net, P), prefilled(net, P)
        alone = torch.stack([paged.decode_rows(net, [t], [P + i], 3, one)[0] for i, t in enumerate(toks)])
        step = net.make_step(torch.arange(P, P + len(toks)).unsqueeze(0))
        lat = paged.Latent.empty(1, len(toks), net)
        paged.forward_loops(net, step, chunk, 0, 2, lat, torch.tensor([toks]), head=False)
        rows = paged.forward_loops(net, step, chunk, 2, 3, lat)[0]
    assert torch.equal(rows, alone)
    assert torch.equal(chunk.dense("k"), one.dense("k")) and torch.equal(chunk.dense("v"), one.dense("v"))
    monkeypatch.setattr(cpu_block, "supported", lambda *a: False)  # torch over the chunk agrees to rounding
    with torch.inference_mode():
        torch_rows = paged.forward_loops(net, step, prefilled(net, P), 0, 3, lat, torch.tensor([toks]))[0]
    torch.testing.assert_close(torch_rows, alone, atol=2e-5, rtol=1e-5)


def test_a_tree_chunk_sees_its_own_branch(monkeypatch):
    """A speculative tree (branches sharing positions, each token in its own cell, an ancestor mask) through the C
    step agrees with the same tree through torch."""
    from tinyloop.engine.forward import TreeShape
    net = make_net(ModelConfig(**{**BASE, **VARIANTS["gqa4_untied"]}))
    P, w, n = 21, 2, 2
    tree = TreeShape(P, w, n, torch.device("cpu"))
    cells = list(range(P, P + 1 + w * n))
    pos = [P] + [P + (i - 1) // w + 1 for i in range(1, len(cells))]
    toks = torch.tensor([[9, 4, 70, 12, 3]])
    out = {}
    for native in (True, False):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(cpu_block, "supported", lambda *a: False)
            with torch.inference_mode():
                cache = prefilled(net, P)
                out[native] = paged.forward_loops(net, tree.step(net, pos, cells), cache, 0, 3,
                                                   paged.Latent.empty(1, len(cells), net), toks)
    torch.testing.assert_close(out[True], out[False], atol=2e-5, rtol=1e-5)


# --- prefill chunks of many rows (cpu_block.c: tl_block_chunk, the tiled GEMM between its row steps) ---------------
def prefill_chunks(net: LoopedLM, sizes: list[int], starts: list[int], c_chunks: bool, monkeypatch
                   ) -> tuple[torch.Tensor, list[bool]]:
    """Logits of two lanes' prompts fed in chunks of `sizes` tokens (lane b's from starts[b], its earlier cells one
    chunk through torch), and whether each chunk ran as C blocks."""
    cfg, gen = net.cfg, torch.Generator().manual_seed(4)
    B = len(starts)
    cache = KVCache(cfg, B, 256, "fp16").reserve_all()
    out, took, at = [], [], torch.tensor(starts).unsqueeze(1)
    with monkeypatch.context() as m, torch.inference_mode():
        for b, s in enumerate(starts):
            if s:
                ids = torch.randint(0, cfg.vocab_size, (1, s), generator=gen)
                paged.forward(net, ids, 3, net.make_step(torch.arange(s).unsqueeze(0)), cache.lane_view(b))
        if not c_chunks:
            m.setattr(cpu_block, "chunk_supported", lambda *a: False)
        for n in sizes:
            ids = torch.randint(0, cfg.vocab_size, (B, n), generator=gen)
            step = net.make_step(at + torch.arange(n))
            took.append(isinstance(paged.context(net, step, cache).native, cpu_block.Chunk))
            out.append(paged.forward(net, ids, 3, step, cache))
            at = at + n
    return torch.cat(out, 1), took


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_prefill_chunk_in_c_matches_torch_blocks(variant, monkeypatch):
    """Chunks past the C step's 32 rows (two lanes at different starts, cells crossing blocks of 16) run their
    blocks as C calls, and give torch's logits to fp32 rounding; a chunk of up to 32 rows stays on torch's path."""
    net = make_net(ModelConfig(**{**BASE, **VARIANTS[variant]}))
    got, took = prefill_chunks(net, [41, 17, 23], [0, 23], True, monkeypatch)
    want, took_torch = prefill_chunks(net, [41, 17, 23], [0, 23], False, monkeypatch)
    assert took == [True, True, True] and not any(took_torch)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    _, took_one = prefill_chunks(net, [32, 33], [5], True, monkeypatch)
    assert took_one == [False, True]


@pytest.mark.parametrize("fmt,act_quant", [("bf16", False), ("int8", False), ("int4", False), ("int8", True),
                                           ("int4", True)])
def test_a_prefill_chunk_in_c_multiplies_in_every_weight_format(fmt, act_quant, monkeypatch):
    """In every format the chunk's products are the format's (not fp32's) and agree with torch's blocks to fp32
    rounding; with act_quant a norm output within rounding of a quantisation midpoint may round the other way
    (see test_c_blocks_multiply_in_every_weight_format), so there the logits agree to that flip's size."""
    cfg = ModelConfig(**{**BASE, **VARIANTS["qk_bias"]})
    net = make_net(cfg, fmt, act_quant)
    got, took = prefill_chunks(net, [40], [0, 9], True, monkeypatch)
    want, _ = prefill_chunks(net, [40], [0, 9], False, monkeypatch)
    assert took == [True]
    torch.testing.assert_close(got, want, atol=5e-3 if act_quant else 2e-5, rtol=1e-5)
    fp32, _ = prefill_chunks(make_net(cfg), [40], [0, 9], True, monkeypatch)
    assert (got - fp32).abs().max() > 1e-4


def test_a_prefill_chunk_skips_int4_widths_the_group_does_not_divide(monkeypatch):
    """A padded FFN width is taken (its input rows padded as for decode rows), but a padded attention width is not:
    cpu_attention.c writes the heads' outputs unpadded, so that chunk runs through torch."""
    net = make_net(ModelConfig(**{**BASE, "ffn_hidden": 104}), "int4")
    got, took = prefill_chunks(net, [40], [0, 9], True, monkeypatch)
    want, _ = prefill_chunks(net, [40], [0, 9], False, monkeypatch)
    assert took == [True]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    narrow = make_net(ModelConfig(**{**BASE, "d_model": 48, "n_heads": 6, "n_kv_heads": 2}), "int4")
    assert narrow.quantized.core[0].wo.padded_width == 64
    assert prefill_chunks(narrow, [40], [0], True, monkeypatch)[1] == [False]
