"""Train a looped model from scratch on the Python standard library's source (present on every machine).

Each step samples its loop count, so the model learns to use extra loops: loss at 8 loops ends well
below loss at 1. Backprop runs through at most `grad_loops` loops (truncated, as Huginn does) to keep a
step cheap on two CPU cores.
"""
from __future__ import annotations

import math
import random
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tinyloop.config import ModelConfig
from tinyloop.model import LoopedLM
from tinyloop.tokenizer import TextCodec, train_tokenizer

EVAL_LOOPS = (1, 2, 4, 8, 12, 16)
EVAL_SEQ_LEN = 256  # the sequence length of train's default --seq-len, which its held-out table is measured at
HELD_OUT_EVERY = 50  # one file in this many is held out


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts]
    return files


def read_corpus(files: list[Path]) -> list[str]:
    out = []
    for p in files:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def to_ids(codec: TextCodec, texts: list[str]) -> torch.Tensor:
    """The texts' tokens, each text followed by eos, as one stream."""
    ids: list[int] = []
    for enc in codec.tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(codec.eos_id)
    return torch.tensor(ids, dtype=torch.long)


def held_out_ids(codec: TextCodec) -> torch.Tensor:
    """The held-out split's tokens: the standard library files train() set aside (one in HELD_OUT_EVERY)."""
    return to_ids(codec, read_corpus(stdlib_files())[::HELD_OUT_EVERY])


def sample_loops(rng: random.Random, max_train_loops: int) -> int:
    """Mostly moderate depths with a tail to the maximum; every depth from 1 is seen."""
    return rng.choice(list(range(1, max_train_loops + 1)) + [max_train_loops // 2] * 2)


@torch.no_grad()
def evaluate(model: LoopedLM, data: torch.Tensor, seq_len: int, loops_list=EVAL_LOOPS, n_batches: int = 8,
             batch_size: int = 8) -> dict[int, float]:
    model.eval()
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, len(data) - seq_len - 1, (n_batches, batch_size), generator=g)
    table = {}
    for L in loops_list:
        losses = []
        for row in starts:
            x = torch.stack([data[s:s + seq_len] for s in row])
            y = torch.stack([data[s + 1:s + seq_len + 1] for s in row])
            logits = model(x, L)
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).item())
        table[L] = sum(losses) / len(losses)
    model.train()
    return table


@torch.no_grad()
def measure_beta(model: LoopedLM, data: torch.Tensor, seq_len: int = 128, n_seqs: int = 8) -> float:
    """Median over tokens of |s_L - s_{L-1}| / |s_{L-1} - s_{L-2}| at the default loop count."""
    model.eval()
    L = max(model.cfg.default_loops, 2)  # s_{L-2} exists from L = 2 (s_0 is the initial state)
    g = torch.Generator().manual_seed(99)
    starts = torch.randint(0, len(data) - seq_len, (n_seqs,), generator=g)
    x = torch.stack([data[s:s + seq_len] for s in starts])
    _, states = model(x, L, return_states=True)
    last = (states[L] - states[L - 1]).float().norm(dim=-1)
    prev = (states[L - 1] - states[L - 2]).float().norm(dim=-1).clamp_min(1e-12)
    return float((last / prev).median())


def train(out_path: str, steps: int = 2000, seq_len: int = 256, batch_size: int = 16, lr: float = 3e-3,
          max_train_loops: int = 12, grad_loops: int = 4, vocab_size: int = 4096, seed: int = 0,
          cfg_overrides: dict | None = None, init_from: str | None = None, log=print) -> dict:
    """Train and write a .tinyloop artifact. `init_from` continues from a checkpoint (.ckpt) written by an
    earlier run (its tokenizer and weights), with `cfg_overrides` applied to its config: the bundled model is
    two stages, the second switching to Huginn-style random state init (see docs/model.md)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    t_start = time.time()
    files = stdlib_files()
    texts = read_corpus(files)
    held_out = texts[::HELD_OUT_EVERY]
    train_texts = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY]
    log(f"corpus: {len(texts)} files, {sum(map(len, texts)) / 1e6:.1f} MB of Python source")
    start = torch.load(init_from, weights_only=True) if init_from else None
    codec = TextCodec.from_json(start["tokenizer"]) if start else TextCodec(train_tokenizer(train_texts, vocab_size))
    eos = codec.eos_id

    train_ids, eval_ids = to_ids(codec, train_texts), to_ids(codec, held_out)
    log(f"tokens: {len(train_ids) / 1e6:.2f}M train, {len(eval_ids) / 1e6:.2f}M held out "
        f"({time.time() - t_start:.0f}s)")
    base = start["cfg"] if start else dict(vocab_size=codec.vocab_size, bos_id=eos, eos_id=eos)
    cfg = ModelConfig(**{**base, **(cfg_overrides or {})}).validate()
    model = LoopedLM(cfg, max_seq_len=max(seq_len, 2048))
    if start:
        model.load_state_dict(start["state"])
    log(f"model: {model.num_params() / 1e6:.2f}M parameters, config {cfg.to_dict()}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    model.train()
    for it in range(steps):
        frac = it / steps
        cur_lr = lr * min(1.0, (it + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = cur_lr
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch_size,))
        x = torch.stack([train_ids[s:s + seq_len] for s in starts])
        y = torch.stack([train_ids[s + 1:s + seq_len + 1] for s in starts])
        L = sample_loops(rng, max_train_loops)
        logits = model(x, L, grad_loops=grad_loops)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if it % 50 == 0 or it == steps - 1:
            log(f"step {it}/{steps} loops {L:2d} loss {loss.item():.3f} lr {cur_lr:.2e} ({time.time() - t_start:.0f}s)")
    torch.save({"cfg": cfg.to_dict(), "state": model.state_dict(), "tokenizer": codec.to_json()}, out_path + ".ckpt")
    # Figures are measured on the weights as shipped (the artifact stores float16).
    model = model.half().float()
    table = evaluate(model, eval_ids, seq_len)
    beta = measure_beta(model, eval_ids)
    log("held-out loss by loops: " + ", ".join(f"L={k}: {v:.3f}" for k, v in table.items()) + f"; beta {beta:.3f}")
    provenance = {"script": "tinyloop train", "init_from": init_from or "scratch",
                  "stage_config": cfg_overrides or {}, "corpus": "Python standard library source (*.py), 1 file in 50 held out",
                  "steps": steps, "seq_len": seq_len, "batch_size": batch_size, "lr": lr,
                  "max_train_loops": max_train_loops, "grad_loops": grad_loops, "seed": seed,
                  "train_tokens": int(len(train_ids)), "seconds": round(time.time() - t_start),
                  "torch": torch.__version__, "threads": torch.get_num_threads()}
    from tinyloop.artifact import save_artifact

    save_artifact(out_path, model, codec, beta=beta, loss_vs_loops=table, provenance=provenance)
    log(f"wrote {out_path}")
    return {"loss_vs_loops": table, "beta": beta}
