"""Compressed communication: what gradients and deltas travel as.

bf16 keeps fp32's range with 8 bits of mantissa; fp16 keeps 11 bits but overflows above
65504. Through Ray's object store tensors move as numpy buffers (a pickled torch tensor is
about 10x slower to put and get); numpy has no bfloat16, so bf16 travels as its raw 16 bits.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

WIRE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_dtype(compress: str) -> torch.dtype | None:
    """The dtype a collective runs in, or None for the tensors' own dtype."""
    return WIRE_DTYPES[compress]


def encode(t: torch.Tensor, compress: str) -> np.ndarray:
    """A CPU numpy buffer holding `t` (any float dtype, any device) at the wire precision."""
    dtype = WIRE_DTYPES[compress]
    host = t.detach().to("cpu")
    if dtype is None:
        return host.to(torch.float32).numpy()
    narrow = host.to(dtype)
    return narrow.view(torch.int16).numpy() if dtype == torch.bfloat16 else narrow.numpy()


def decode(a: np.ndarray, compress: str) -> torch.Tensor:
    """The float32 CPU tensor an `encode` buffer stands for. It may share the buffer's memory, which the
    object store hands out read-only: read it, never write to it."""
    with warnings.catch_warnings():  # "the given NumPy array is not writable": nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.ascontiguousarray(a))
    if WIRE_DTYPES[compress] == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(torch.float32)


# ---- quantized deltas (local SGD): int8 / int4 with a scale per block, and error feedback -------------

QUANTIZED_BITS: dict[str, int] = {"int8": 8, "int4": 4}
BLOCK = 256
"""Values per scale: one fp32 scale per 256 values adds 1.6% to the codes."""


def _levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1  # int8: -127..127, int4: -7..7 (symmetric: zero stays exact)


def quantized_nbytes(n: int, bits: int) -> int:
    """Bytes of `quantize`'s codes and scales for `n` values."""
    blocks = -(-n // BLOCK)
    return blocks * BLOCK * bits // 8 + blocks * 4


def quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A flat fp32 CPU tensor as one uint8 buffer: the codes (int4: two to a byte), then one fp32 scale per
    block of BLOCK values (the block's largest magnitude over the largest code). A NaN or Inf makes its
    block's scale non-finite, so the receiver sees a non-finite delta, as with an fp32 exchange."""
    n, levels = x.numel(), _levels(bits)
    blocks = -(-n // BLOCK)
    padded = torch.nn.functional.pad(x, (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    scales = padded.abs().amax(dim=1) / levels
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / divisor[:, None]).clamp_(-levels, levels).to(torch.int16).add_(levels + 1)
    codes = codes.to(torch.uint8).view(-1)  # 1..255 (int8) or 1..15 (int4)
    if bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    return torch.cat([codes, scales.to(torch.float32).view(torch.uint8)])


def dequantize(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The fp32 tensor of `n` values a `quantize` buffer stands for."""
    levels, blocks = _levels(bits), -(-n // BLOCK)
    ncodes = blocks * BLOCK * bits // 8
    codes, scales = buf[:ncodes], buf[ncodes : ncodes + 4 * blocks].view(torch.float32)
    if bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=1).view(-1)
    values = codes.to(torch.float32).sub_(levels + 1).view(blocks, BLOCK).mul_(scales[:, None])
    return values.view(-1)[:n]


class ErrorFeedback:
    """What quantization dropped from one exchange is added to the next (EF-SGD, as in 1-bit Adam and
    Streaming DiLoCo's 4-bit outer gradients): the error carried never exceeds one exchange's rounding, so
    over many exchanges the deltas sent add up to the deltas made, less that one bounded residual."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.residual = torch.zeros(0)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize `x` plus the carried residual (`x` is overwritten with that sum) and keep the new residual."""
        if self.residual.numel() != x.numel():
            self.residual = torch.zeros_like(x)
        x.add_(self.residual)
        buf = quantize(x, self.bits)
        self.residual = x - dequantize(buf, x.numel(), self.bits)
        if not bool(torch.isfinite(self.residual.sum())):  # a non-finite delta: skipped everywhere, not carried
            self.residual.zero_()
        return buf

    def reset(self) -> None:
        self.residual = torch.zeros(0)
