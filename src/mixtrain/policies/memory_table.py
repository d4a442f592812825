"""The text of a memory plan (MemoryPlan.table()): the model's figures, then each option with what each device
would hold, by part, in GB (2**30 bytes), or MB (2**20) when every part is under 1 GB."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixtrain.policies.memory_plan import GIB, MIB, gb

if TYPE_CHECKING:
    from mixtrain.policies.memory_plan import DevicePlan, MemoryPlan, Option

PARTS = ("weights", "frozen", "grads", "optimizer", "gathered", "transient", "activations", "process")
HEADS = ("weights", "frozen", "grads", "optim", "gathered", "transient", "act(b=1)", "process")


def render(plan: MemoryPlan) -> str:
    s = plan.shape
    largest = max(v for o in plan.options for d in o.devices for k, v in d.parts.items() if k != "process")
    unit, name = (GIB, "GB") if largest >= GIB else (MIB, "MB")
    lines = [
        f"model: {s.describe()}; weights {gb(s.trainable_bytes)} GB trainable + {gb(s.frozen_bytes)} GB frozen, "
        f"optimizer state {gb(s.optimizer_bytes)} GB, largest block {gb(s.block_bytes)} GB, outside the blocks "
        f"{gb(s.root_bytes)} GB",
        f"activations {(s.activation_bytes(1) - s.activation_bytes(0)) / MIB:.1f} MB per sample "
        f"(+{s.activation_bytes(0) / MIB:.1f} MB), {s.flops / 1e9:.3g} GFLOP per sample (forward and backward)",
        f"link {plan.link_bytes_per_s * 8 / 1e9:g} Gbit/s, global batch {plan.global_batch}; parts in {name} "
        f"(2**{30 if unit == GIB else 20} bytes)",
        "",
        f"{'option':<34} {'fits':<5} {'step s':>8}  {'largest model':<24} {'time':<40}",
        "  " + f"{'device':<12}" + "".join(f"{h:>10}" for h in HEADS) + f"{'total/memory':>16} {'micro-batch':>12}",
    ]
    for o in plan.options:
        mark = "  <- picked" if o is plan.pick else ""
        lines.append(
            f"{o.label:<34} {'yes' if o.fits else 'no':<5} {o.step_s:>8.3g}  {_model(o, plan):<24} {o.timing()}{mark}"
        )
        lines += [_device_line(d, unit) for d in o.devices]
    lines.append("")
    lines.append(f"pick: {plan.pick.label if plan.pick else 'none'}: {plan.reason}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _model(o: Option, plan: MemoryPlan) -> str:
    if o.max_blocks is None:
        return "-"
    bigger = plan.shape.scaled(o.max_blocks) if o.max_blocks else None
    params = f"{bigger.num_parameters / 1e9:.2f}B" if bigger else "0"
    return f"{o.max_blocks} blocks, {params} params"


def _device_line(d: DevicePlan, unit: int) -> str:
    cells = "".join(f"{d.parts[p] / unit:>10.3f}" for p in PARTS)
    digits = 2 if unit == GIB else 0
    total = f"{d.total / unit:.{digits}f}/{d.device.memory_bytes / unit:.{digits}f}"
    micro = str(d.max_micro_batch) if d.fits else "-"
    return f"  {d.device.label:<12}{cells}{total:>16} {micro:>12}"
