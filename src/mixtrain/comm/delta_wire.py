"""How local SGD's exchange travels: a window's weighted delta and per-step statistics in one fp32 buffer, summed
over the ranks by one all-reduce (in fp32, or a narrower copy: bf16/fp16), or, with int8/int4, quantized with
error feedback and all-gathered, every rank adding every rank's dequantized delta in rank order, so the replicas
stay equal bit for bit."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mixtrain.comm import replicas
from mixtrain.comm.compress import QUANTIZED_BITS, ErrorFeedback, quantized_nbytes, wire_dtype
from mixtrain.comm.link_measure import all_gather_probe, all_reduce_probe, exchange_seconds


class DeltaWire:
    """The collective of an exchange, started (`launch`) and landed (`receive`) apart, so it may overlap compute."""

    def __init__(self, compress: str) -> None:
        bits = QUANTIZED_BITS.get(compress)
        self.dtype = torch.float32 if bits else (wire_dtype(compress) or torch.float32)
        """What an all-reduce carries (fp32 when quantized: the codes travel by all-gather)."""
        self.feedback = ErrorFeedback(bits) if bits else None  # int8/int4 deltas: an all-gather, not a sum

    def launch(self, buf: torch.Tensor, n: int, async_op: bool) -> tuple[Any, Any, int]:
        """Start the collective over `buf` (the weighted delta: n values, then the statistics). Returns its handle
        (None when it ran to the end), what travels, and the bytes this rank sent."""
        if self.feedback is not None:
            codes = self.feedback.encode(buf[:n])
            mine = torch.cat([codes, buf[n:].contiguous().view(torch.uint8)]).to(replicas.comm_device())
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            return dist.all_gather(everyone, mine, async_op=async_op), (everyone, codes.numel()), mine.numel()
        wire = buf if self.dtype == torch.float32 and replicas.comm_device().type == "cpu" else None
        if wire is None:
            wire = buf.to(self.dtype).to(replicas.comm_device())
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, async_op=async_op)
        return work, wire, wire.numel() * wire.element_size()

    def receive(self, buf: torch.Tensor, n: int, wire: Any, work: Any) -> None:
        """Wait for the collective `launch` started and put the sum over the ranks into `buf`."""
        if work is not None:
            work.wait()
        if self.feedback is not None:
            self._sum_quantized(buf, n, *wire)
        elif wire is not buf:
            buf.copy_(wire)

    def _sum_quantized(self, buf: torch.Tensor, n: int, everyone: list[torch.Tensor], size: int) -> None:
        """int8/int4: quantized sums do not add up across ranks (each block has its own scale), so every rank
        gathers every rank's codes and scales (plus its fp32 statistics) and adds them up itself, in rank
        order: the same sum, bit for bit, on every rank. Writes the sum into `buf`."""
        assert self.feedback is not None
        for rank, theirs in enumerate(everyone):  # (the first copied, not added to zeros: the same sum)
            theirs = theirs.to("cpu")
            self.feedback.quantizer.add_decoded(theirs[:size], buf[:n], first=rank == 0)
            stats = theirs[size:].view(torch.float32)
            if rank == 0:
                buf[n:].copy_(stats)
            else:
                buf[n:].add_(stats)

    def nbytes(self, n: int, stats: int) -> int:
        """Bytes one exchange of `n` delta values and `stats` statistics sends."""
        if self.feedback is not None:  # codes and scales, then the statistics in fp32
            return quantized_nbytes(n, self.feedback.bits) + 4 * stats
        return (n + stats) * self.dtype.itemsize

    def measure(self, nbytes: int, size: int, pieces: int, repeats: int) -> float:
        """Seconds of one exchange of `nbytes`: `pieces` all-reduces of a `size`-value buffer (or, quantized,
        every rank's codes to every rank)."""
        if self.feedback is not None:
            return exchange_seconds(all_gather_probe(nbytes), all_gather_probe, nbytes, repeats)
        buf = torch.zeros(size, dtype=self.dtype, device=replicas.comm_device())

        def exchange() -> None:
            for _ in range(pieces):
                dist.all_reduce(buf, op=dist.ReduceOp.SUM)

        return exchange_seconds(exchange, all_reduce_probe, nbytes, repeats)
