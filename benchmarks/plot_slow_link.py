"""Plot a slow-link sweep: samples/s against link speed, the ceiling and one worker alone as lines, and the
break-even speed (the slowest measured link where the best pair row beats one worker alone).

Command lines (after `benchmarks/slow_link.py --rates ... --json FILE`; needs matplotlib: `pip install -e
.[report]`):
    python benchmarks/plot_slow_link.py bench_results/slow_link_curve_chars.json \\
        bench_results/slow_link_curve_chars_large.json --png docs/img/slow-link-curve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

YARDSTICKS = ("ceiling", "ceiling-full", "alone")
"""The rows that send nothing (slow_link.ceiling: the pair's halves with no exchange; each half on the whole batch)."""


def _family(row: dict) -> str:
    """The row's curve: its strategy with the advisor's H left out (it changes with the rate)."""
    asked = row.get("asked", row["strategy"])
    return asked.replace("local-sgd:adv", "local-sgd:H")


def curves(rows: list[dict]) -> dict:
    """{family: {Mbit/s: samples/s}} for the pair rows; the yardsticks as the mean of their runs; the
    break-even Mbit/s (None: the best pair row beat alone at no measured rate, or at every one: the lowest)."""
    by: dict[str, dict[float, float]] = {}
    for r in rows:
        if r.get("skipped") or r["strategy"] in YARDSTICKS:
            continue
        by.setdefault(_family(r), {})[r["rate_mbit"]] = r["samples_per_s"]
    mean = {y: _avg([r["samples_per_s"] for r in rows if r["strategy"] == y]) for y in YARDSTICKS}
    rates = sorted({r["rate_mbit"] for r in rows})
    best = {rate: max((c[rate] for c in by.values() if rate in c), default=0.0) for rate in rates}
    alone = mean["alone"] or 0.0
    # the slowest measured rate where the best pair row beats alone (and the faster ones where none does)
    ahead = [rate for rate in rates if best[rate] > alone]
    break_even = ahead[0] if ahead else None
    behind = [rate for rate in rates if break_even is not None and rate > break_even and best[rate] <= alone]
    return {"rows": by, **mean, "best": best, "break_even": break_even, "behind_above": behind}


def table(c: dict, rows: list[dict]) -> str:
    """Markdown: one line per row family, one column per rate, samples/s and (the fraction of the ceiling);
    then auto's pick against the best row at each rate."""
    rates = sorted(c["best"], reverse=True)
    head = "| row | " + " | ".join(f"{r:g} Mbit/s" for r in rates) + " |"
    lines = [head, "|---|" + "---:|" * len(rates)]
    for name in YARDSTICKS:
        if c[name]:
            lines.append(f"| {name} (mean of its runs) | " + " | ".join(f"{c[name]:.1f}" for _ in rates) + " |")
    for family, points in sorted(c["rows"].items()):
        cells = []
        for rate in rates:
            if rate not in points:
                skipped = next((r for r in rows if r.get("skipped") and r["rate_mbit"] == rate
                                and _family(r) == family), None)  # fmt: skip
                cells.append(f"≤ {skipped['bound_samples_per_s']:.1f} (not run)" if skipped else "-")
                continue
            frac = f" ({points[rate] / c['ceiling']:.2f})" if c["ceiling"] else ""
            cells.append(f"{points[rate]:.1f}{frac}")
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    for family in sorted(c["rows"]):
        if family.startswith("local-sgd:H"):
            hs = {r["rate_mbit"]: r["strategy"].split("+")[0].split(":")[1] for r in rows
                  if _family(r) == family and not r.get("skipped")}  # fmt: skip
            lines.append(f"| {family}: the advisor's H | " + " | ".join(hs.get(r, "-") for r in rates) + " |")
    picks = {r["rate_mbit"]: _pick(r) for r in rows if r["strategy"] == "auto"}
    lines.append("| auto picked | " + " | ".join(picks.get(r, "-") for r in rates) + " |")
    auto = c["rows"].get("auto", {})
    lines.append("| auto / best row | " + " | ".join(
        f"{auto[r] / c['best'][r]:.2f}" if r in auto and c["best"][r] else "-" for r in rates) + " |")  # fmt: skip
    return "\n".join(lines)


def _pick(row: dict) -> str:
    """What `--strategy auto` adopted, from its start-of-run line."""
    text = row.get("advice", "")
    if not text.startswith("auto chose "):
        return "?"
    return text.removeprefix("auto chose ").split(":")[0].replace(" on the wire", "")


def _avg(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "json",
        nargs="+",
        help="sweeps from benchmarks/slow_link.py, one per workload; A.json+B.json joins two sweeps of one workload "
        "(a row measured in both: B's figure; the ceiling and alone: the mean of every run)",
    )
    parser.add_argument("--png", default="docs/img/slow-link-curve.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.json), figsize=(6.5 * len(args.json), 4.6), squeeze=False)
    for ax, path in zip(axes[0], args.json):
        rows = [row for part in path.split("+") for row in json.loads(Path(part).read_text())]
        c = curves([r for r in rows if not r.get("rtt_ms")])  # the curve is of speed alone; added round trips aside
        rates = sorted(c["best"])
        for family, points in sorted(c["rows"].items()):
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=family)
        labels = {"ceiling": "ceiling: 2 workers, no exchange", "ceiling-full": "the same, each on the whole batch",
                  "alone": "one worker alone"}  # fmt: skip
        for name, style in zip(YARDSTICKS, ("k-", "k:", "k--")):
            if c[name]:
                ax.plot([rates[0], rates[-1]], [c[name]] * 2, style, label=labels[name], linewidth=1.2)
        if c["break_even"]:
            ax.axvline(c["break_even"], color="grey", linestyle=":", label=f"break-even {c['break_even']:g} Mbit/s")
        workload = Path(path.split("+")[0]).stem.removeprefix("slow_link_curve_")
        ax.set(xscale="log", xlabel="link speed, Mbit/s (each way, tbf)", ylabel="samples/s", title=workload)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        print(table(c, rows))
        print(f"{workload}: ceiling {c['ceiling']:.1f}, alone {c['alone']:.1f}, break-even {c['break_even']} Mbit/s"
              f" (the slowest measured rate where the best pair row beats alone); above it, behind alone at "
              f"{c['behind_above'] or 'none'}")  # fmt: skip
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
