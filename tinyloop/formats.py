"""Weight formats: how a weight matrix is stored, and the one product every forward multiplies it by.

  fp32  a plain torch tensor [N, K] (the model's own parameter)
  bf16  data bf16 [N, K]; each value widens exactly to fp32
  int8  data int8 [N, K], scale fp32 [N]: one scale per output row (channel), w ~ q * scale, scale = max|w_row| / 127
  int4  data uint8 [N, K / 2], scale fp32 [N, K / group]: one scale per `group` consecutive values of a row,
        w ~ (q - 8) * scale with q in 0..15, scale = max|w_group| / 7 (q = clamp(round(w / scale), -8, 7) + 8).
        Nibbles are packed per block of 32 values: byte j of block b holds value 32 b + j in its low nibble and
        value 32 b + j + 16 in its high nibble, so a SIMD unit unpacks 32 values with one mask and one shift.
        group is a multiple of 32; a width K that group does not divide is stored zero-padded to the next multiple
        (`padded_width`), and the products pad x with zeros to match (QMatrix.pad).

Every product returns fp32. Activations (the product's input rows) stay fp32, except that an int8 or int4 matrix
with `act_quant` set quantises them to int8 per block of 32 values first (`quantize_activations`), as llama.cpp does
for its Q8_0 / Q4_0 products: the CPU kernels then multiply on integers, faster than widening every weight to fp32
(docs/kernels.md), and the bundled model's held-out loss moves by at most 0.0003 nats. load_model sets it for int8 /
int4 weights on the CPU (act_quant=False or TINYLOOP_ACT_QUANT=off: weight-only). `linear(x, w)` picks the
fastest product for the weight's format and the device (tinyloop/kernels: a CPU kernel for few rows, Triton on
CUDA); `reference_linear` is the definition they are tested against: quantize_activations(x) @ dequantize(w).T in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import ConfigError

FORMATS = ("fp32", "bf16", "int8", "int4")
INT4_BLOCK = 32  # values per nibble block; an int4 group is a multiple of it
DEFAULT_GROUP = 32
ACT_BLOCK = 32  # activation values per int8 scale (act_quant)


@dataclass
class QMatrix:
    """A weight matrix [N, K] in a format other than fp32 (see the module doc for each layout)."""
    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None
    group: int = 0  # int4 only
    width: int = 0  # int4 only: the matrix's own K (data holds padded_width values per row)
    act_quant: bool = False  # int8 / int4 only: its products quantise their input rows (quantize_activations)

    @property
    def shape(self) -> tuple[int, int]:
        n = self.data.shape[0]
        return (n, self.width) if self.fmt == "int4" else (n, self.data.shape[1])

    @property
    def padded_width(self) -> int:
        return self.data.shape[1] * 2 if self.fmt == "int4" else self.data.shape[1]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] with zeros appended up to the stored width (the padded columns hold zeros)."""
        extra = self.padded_width - x.shape[-1]
        return F.pad(x, (0, extra)) if extra > 0 else x

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + \
            (0 if self.scale is None else self.scale.numel() * self.scale.element_size())

    def rows(self, start: int, stop: int) -> "QMatrix":
        """Rows start..stop-1 as a view (the fused q|k|v matrix gives its k|v rows this way)."""
        scale = None if self.scale is None else self.scale[start:stop]
        return QMatrix(self.fmt, self.data[start:stop], scale, self.group, self.width, self.act_quant)

    def to(self, device: torch.device | str) -> "QMatrix":
        scale = None if self.scale is None else self.scale.to(device)
        return QMatrix(self.fmt, self.data.to(device), scale, self.group, self.width, self.act_quant)


Matrix = torch.Tensor | QMatrix


def check_format(fmt: str, group: int = DEFAULT_GROUP) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"weight format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "int4" and (group <= 0 or group % INT4_BLOCK):
        raise ConfigError(f"int4 group size {group} is not a positive multiple of {INT4_BLOCK}")


def parse_spec(spec: str) -> tuple[str, int]:
    """'int8', 'int4' or 'int4:64' (a group size) -> (format, group), as the command line's --weights takes it."""
    fmt, _, group = spec.partition(":")
    if group and not group.isdigit():
        raise ConfigError(f"--weights {spec!r}: the group size after ':' must be a number, e.g. int4:64")
    if group and fmt != "int4":
        raise ConfigError(f"--weights {spec!r}: only int4 takes a group size")
    check_format(fmt, int(group or DEFAULT_GROUP))
    return fmt, int(group or DEFAULT_GROUP)


def quantize(w: torch.Tensor, fmt: str, group: int = DEFAULT_GROUP) -> Matrix:
    """w [N, K] (any float dtype) in format fmt; fp32 gives a plain fp32 tensor."""
    check_format(fmt, group)
    w = w.detach().float()
    if fmt == "fp32":
        return w.contiguous()
    if fmt == "bf16":
        return QMatrix("bf16", w.to(torch.bfloat16).contiguous(), None)
    N, K = w.shape
    if w.is_meta:  # shapes only (model.shapes_only, no meta op): the layout of one zero row, repeated N times
        row = quantize(torch.zeros(1, K, device="cpu"), fmt, group)
        assert isinstance(row, QMatrix) and row.scale is not None  # (int8 and int4 have one)
        return QMatrix(fmt, row.data.new_empty((N, *row.data.shape[1:]), device="meta"),
                       row.scale.new_empty((N, *row.scale.shape[1:]), device="meta"), row.group, row.width)
    if fmt == "int8":
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return QMatrix("int8", q.contiguous(), scale.contiguous())
    Kp = -(-K // group) * group
    g = F.pad(w, (0, Kp - K)).view(N, Kp // group, group)
    scale = (g.abs().amax(dim=2) / 7.0).clamp_min(1e-12)
    q = (torch.round(g / scale[:, :, None]).clamp(-8, 7) + 8).to(torch.uint8).view(N, Kp // INT4_BLOCK, 2, 16)
    packed = q[:, :, 0, :] | (q[:, :, 1, :] << 4)  # low nibble: value j of the block, high: value j + 16
    return QMatrix("int4", packed.reshape(N, Kp // 2).contiguous(), scale.contiguous(), group, K)


def dequantize(w: Matrix) -> torch.Tensor:
    """The fp32 matrix [N, K] that w stands for."""
    if isinstance(w, torch.Tensor):
        return w.float()
    if w.fmt == "bf16":
        return w.data.float()
    assert w.scale is not None  # (int8 and int4 have one)
    if w.fmt == "int8":
        return w.data.float() * w.scale[:, None]
    (N, K), Kp = w.shape, w.padded_width
    b = w.data.view(N, Kp // INT4_BLOCK, 16)
    q = torch.stack((b & 0x0F, b >> 4), dim=2).view(N, Kp // w.group, w.group).float() - 8.0
    return (q * w.scale[:, :, None]).view(N, Kp)[:, :K]


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] in fp32 with each block of 32 values rounded to int8 at its own scale max|block| / 127 (the values
    q * scale; a last partial block stays as it is): what an act_quant product multiplies. As the CPU kernel computes
    it (cpu_gemv.c: quant_x): q = round-half-even(x * (127 / max)), an all-zero block stays zero."""
    x = x.float()
    K = x.shape[-1]
    full = K - K % ACT_BLOCK
    blocks = x[..., :full].reshape(*x.shape[:-1], full // ACT_BLOCK, ACT_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # a tensor divided, not `127.0 / amax`: torch computes a scalar over a tensor as reciprocal() * 127, which rounds
    # differently from the kernel's IEEE division and, at a near-tie, moves q by one (x * inv = -46.500004 vs -46.5)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv) * (amax / 127.0)
    return torch.cat([q.reshape(*x.shape[:-1], full), x[..., full:]], dim=-1)


def reference_linear(x: torch.Tensor, w: Matrix) -> torch.Tensor:
    """x [..., K] @ dequantize(w).T in fp32, x first through quantize_activations for an act_quant matrix: the
    definition every kernel is tested against."""
    if isinstance(w, QMatrix) and w.act_quant:  # int4 quantises the zero-padded row, as its kernels see it
        x = quantize_activations(w.pad(x) if w.fmt == "int4" else x)[..., :w.shape[1]]
    return F.linear(x.float(), dequantize(w))


def nbytes(w: Matrix) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def linear(x: torch.Tensor, w: Matrix) -> torch.Tensor:
    """The product of the model layer (no cache: training, scoring): F.linear for fp32 weights, the reference
    otherwise. The cached step multiplies through tinyloop/kernels/linear.py's faster products."""
    return F.linear(x, w) if isinstance(w, torch.Tensor) else reference_linear(x, w)
