"""int8/int4 deltas for local SGD: a scale per block of 256 values, and error feedback."""

from __future__ import annotations

import pytest
import torch

from mixtrain.comm.compress import BLOCK, CHUNK_BLOCKS, ErrorFeedback, dequantize, quantize, quantized_nbytes


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1, 255, 256, 1000, 65_537, 2 * CHUNK_BLOCKS * BLOCK + 300])
def test_a_round_trip_is_within_half_a_step_of_each_blocks_scale(bits, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)  # blocks of very different magnitudes
    buf = quantize(x, bits)
    assert buf.dtype == torch.uint8 and buf.numel() == quantized_nbytes(n, bits)
    y = dequantize(buf, n, bits)
    levels = 2 ** (bits - 1) - 1
    padded = torch.nn.functional.pad(x, (0, (-n) % BLOCK)).view(-1, BLOCK)
    bound = (padded.abs().amax(dim=1) / levels / 2).repeat_interleave(BLOCK)[:n]  # half a step, per block
    assert ((y - x).abs() <= bound * (1 + 1e-6)).all()
    assert y[x.abs() == x.abs().max()].abs().item() == pytest.approx(x.abs().max().item(), rel=1e-6)  # peak exact


def test_the_bytes_are_a_quarter_and_an_eighth_of_fp32_plus_the_scales():
    n = 1_000_000
    assert quantized_nbytes(n, 8) / (4 * n) == pytest.approx(1 / 4 + 1 / 256, rel=1e-3)
    assert quantized_nbytes(n, 4) / (4 * n) == pytest.approx(1 / 8 + 1 / 256, rel=1e-3)


def test_zeros_stay_zeros_and_a_nan_makes_its_block_non_finite():
    x = torch.zeros(3 * BLOCK)
    assert torch.equal(dequantize(quantize(x, 4), x.numel(), 4), x)
    x[BLOCK + 5] = float("nan")
    y = dequantize(quantize(x, 8), x.numel(), 8)
    assert torch.equal(y[:BLOCK], x[:BLOCK]) and not torch.isfinite(y[BLOCK : 2 * BLOCK]).any()


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_keeps_the_accumulated_error_bounded(bits):
    # 300 exchanges of small deltas with a common drift: what was sent adds up to what was made, less the one
    # residual carried, which never exceeds one exchange's rounding; without feedback the error grows
    g = torch.Generator().manual_seed(0)
    n, rounds = 4 * BLOCK, 300
    ef = ErrorFeedback(bits)
    made, sent, sent_plain = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    worst_residual = 0.0
    for _ in range(rounds):
        delta = 0.01 + torch.randn(n, generator=g) * 0.1
        made += delta
        sent_plain += dequantize(quantize(delta, bits), n, bits)
        sent += dequantize(ef.encode(delta.clone()), n, bits)
        worst_residual = max(worst_residual, ef.residual.abs().max().item())
    assert torch.allclose(sent + ef.residual, made, atol=1e-3)
    bound = 0.6 / (2 ** (bits - 1) - 1) / 2  # half a step of a block peaking at 0.6 (they peak near 0.45)
    assert worst_residual <= bound
    assert (made - sent).abs().max() <= bound < (made - sent_plain).abs().max()


def _whole_tensor_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The quantizer as it was before it went a chunk at a time: one whole-tensor step after another."""
    n, levels = x.numel(), 2 ** (bits - 1) - 1
    blocks = -(-n // BLOCK)
    padded = torch.nn.functional.pad(x, (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    scales = padded.abs().amax(dim=1) / levels
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / divisor[:, None]).clamp_(-levels, levels).to(torch.int16).add_(levels + 1)
    codes = codes.to(torch.uint8).view(-1)
    if bits == 4:
        codes = codes[0::2] | (codes[1::2] << 4)
    return torch.cat([codes, scales.to(torch.float32).view(torch.uint8)])


@pytest.mark.parametrize("bits", [8, 4])
def test_chunk_by_chunk_gives_the_whole_tensor_codes_and_error_feedback_keeps_what_they_drop(bits):
    # three chunks, the last one short and its last block padded: the same bytes as whole-tensor steps
    n = 2 * CHUNK_BLOCKS * BLOCK + 3 * BLOCK + 17
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(n, generator=g) * torch.logspace(2, -4, n)  # falling: stale padding would show
    assert torch.equal(quantize(x, bits), _whole_tensor_quantize(x, bits))
    ef = ErrorFeedback(bits)
    sent = ef.encode(x.clone())
    assert torch.equal(sent, _whole_tensor_quantize(x, bits))  # no residual carried yet
    decoded = dequantize(sent, n, bits)
    assert ((x - decoded - ef.residual).abs() <= 1e-6 * x.abs()).all()  # the residual is what was dropped
    twice = ErrorFeedback(bits).quantizer
    out = torch.full((n,), 1.0)
    twice.add_decoded(sent, out)
    assert torch.equal(out, 1.0 + decoded)  # added to what was there, each value once
