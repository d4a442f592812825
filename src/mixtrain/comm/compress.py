"""Compressed communication: what gradients and deltas travel as.

bf16 keeps fp32's range with 8 bits of mantissa; fp16 keeps 11 bits but overflows above
65504. Through Ray's object store tensors move as numpy buffers (a pickled torch tensor is
about 10x slower to put and get); numpy has no bfloat16, so bf16 travels as its raw 16 bits.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator

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
CHUNK_BLOCKS = 1024
"""Blocks quantized or decoded at a time (256K values, 1 MiB of fp32): each step's temporaries stay in the
cache, and in scratch buffers kept from one exchange to the next. Whole-tensor steps cost a model-sized
temporary each (a 6.4M-parameter int4 exchange made seven of 25 MB), and a worker's allocator maps and
faults in every block of 16 MB or more afresh (devices/host_allocator.py): under that setting, encoding 6.4M
values took 81 ms of the compute thread per exchange, and takes 18 (2026-11-26, this machine's CPU)."""


def _levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1  # int8: -127..127, int4: -7..7 (symmetric: zero stays exact)


def quantized_nbytes(n: int, bits: int) -> int:
    """Bytes of `quantize`'s codes and scales for `n` values."""
    blocks = -(-n // BLOCK)
    return blocks * BLOCK * bits // 8 + blocks * 4


class Quantizer:
    """int8/int4 codes with a scale per block, CHUNK_BLOCKS blocks at a time through scratch buffers of one
    chunk (made once, reused by every call)."""

    def __init__(self, bits: int) -> None:
        self.bits, self.levels = bits, _levels(bits)
        shape = (CHUNK_BLOCKS, BLOCK)
        self._values, self._work = torch.empty(shape), torch.empty(shape)
        self._codes = torch.empty(shape, dtype=torch.uint8)
        self._high = torch.empty(CHUNK_BLOCKS * BLOCK // 2, dtype=torch.uint8)

    def _chunks(self, n: int) -> Iterator[tuple[int, int, int, int]]:
        """(first block, blocks, first value, values) of each chunk of `n` values."""
        blocks = -(-n // BLOCK)
        for b0 in range(0, blocks, CHUNK_BLOCKS):
            nb = min(CHUNK_BLOCKS, blocks - b0)
            yield b0, nb, b0 * BLOCK, min(n, (b0 + nb) * BLOCK) - b0 * BLOCK

    def _parts(self, buf: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and the fp32 scales of a `quantize` buffer of `n` values (views into it)."""
        blocks = -(-n // BLOCK)
        ncodes = blocks * BLOCK * self.bits // 8
        return buf[:ncodes], buf[ncodes : ncodes + 4 * blocks].view(torch.float32)

    def quantize(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """A flat fp32 CPU tensor as one uint8 buffer: the codes (int4: two to a byte, the first value in the
        low half), then one fp32 scale per block of BLOCK values (the block's largest magnitude over the
        largest code). A NaN or Inf makes its block's scale non-finite, so the receiver sees a non-finite
        delta, as with an fp32 exchange. `residual` (as large as `x`): gets what the codes dropped, x - decoded."""
        n, bits, levels = x.numel(), self.bits, self.levels
        out = torch.empty(quantized_nbytes(n, bits), dtype=torch.uint8)
        codes, scales = self._parts(out, n)
        for b0, nb, v0, nv in self._chunks(n):
            vals, work, u8 = self._values[:nb], self._work[:nb], self._codes[:nb]
            flat = vals.view(-1)
            flat[:nv].copy_(x[v0 : v0 + nv])
            flat[nv:].zero_()  # the last block's padding
            sc = scales[b0 : b0 + nb]
            torch.amax(torch.abs(vals, out=work), dim=1, out=sc)
            sc.div_(levels)
            divisor = torch.where(sc > 0, sc, 1.0)
            torch.div(vals, divisor[:, None], out=work).round_().clamp_(-levels, levels)
            if residual is not None:  # x - code * scale: what this block's codes do not carry
                torch.addcmul(vals, work, sc[:, None], value=-1.0, out=vals)
                residual[v0 : v0 + nv].copy_(flat[:nv])
            u8.copy_(work.add_(levels + 1))  # 1..255 (int8) or 1..15 (int4)
            if bits == 8:
                codes[v0 : v0 + nb * BLOCK].copy_(u8.view(-1))
            else:
                pairs, high = u8.view(-1, 2), self._high[: nb * BLOCK // 2]
                torch.bitwise_left_shift(pairs[:, 1], 4, out=high)
                torch.bitwise_or(pairs[:, 0], high, out=codes[v0 // 2 : v0 // 2 + nb * BLOCK // 2])
        return out

    def add_decoded(self, buf: torch.Tensor, out: torch.Tensor, *, first: bool = False) -> None:
        """out += the values a `quantize` buffer stands for (`first`: out = them; out is flat, its length n)."""
        n, bits, levels = out.numel(), self.bits, self.levels
        codes, scales = self._parts(buf, n)
        for b0, nb, v0, nv in self._chunks(n):
            vals, u8 = self._values[:nb], self._codes[:nb]
            if bits == 8:
                u8.view(-1).copy_(codes[v0 : v0 + nb * BLOCK])
            else:
                packed, pairs = codes[v0 // 2 : v0 // 2 + nb * BLOCK // 2], u8.view(-1, 2)
                torch.bitwise_and(packed, 0x0F, out=pairs[:, 0])
                torch.bitwise_right_shift(packed, 4, out=pairs[:, 1])
            vals.copy_(u8).sub_(levels + 1).mul_(scales[b0 : b0 + nb, None])
            target = out[v0 : v0 + nv]
            if first:
                target.copy_(vals.view(-1)[:nv])
            else:
                target.add_(vals.view(-1)[:nv])


@functools.cache
def _quantizer(bits: int) -> Quantizer:
    return Quantizer(bits)


def quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantizer(bits).quantize(x), through scratch buffers this process keeps."""
    return _quantizer(bits).quantize(x)


def dequantize(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The fp32 tensor of `n` values a `quantize` buffer stands for."""
    out = torch.empty(n)
    _quantizer(bits).add_decoded(buf, out, first=True)
    return out


class ErrorFeedback:
    """What quantization dropped from one exchange is added to the next (EF-SGD, as in 1-bit Adam and
    Streaming DiLoCo's 4-bit outer gradients): the error carried never exceeds one exchange's rounding, so
    over many exchanges the deltas sent add up to the deltas made, less that one bounded residual."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.quantizer = _quantizer(bits)  # this process's scratch buffers: exchanges run one at a time
        self.residual = torch.zeros(0)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize `x` plus the carried residual (`x` is overwritten with that sum) and keep the new residual."""
        if self.residual.numel() != x.numel():
            self.residual = torch.zeros_like(x)
        x.add_(self.residual)
        buf = self.quantizer.quantize(x, residual=self.residual)
        if not bool(torch.isfinite(self.residual.sum())):  # a non-finite delta: skipped everywhere, not carried
            self.residual.zero_()
        return buf

    def reset(self) -> None:
        self.residual = torch.zeros(0)
