"""The bench's scaling picture: latency and cost per request against concurrency.

One PNG beside `results.json`: p50 and p99 latency per layout (left), and the server's CPU
per request and the wall time per request, 1/throughput (right), for every concurrency the
run measured — how each layout's cost grows as load does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

SHOWN = ("bare", "collapsed", "layered")


def plot_scaling(results: Mapping[str, Any], out: Path) -> Path | None:
    """Write the PNG; None when there is less than two concurrencies to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results["runs"] if r["mode"] == "unary" and r["layout"] in SHOWN]
    if len({r["concurrency"] for r in runs}) < 2:
        return None
    figure, (latency, cost) = plt.subplots(1, 2, figsize=(11, 4.2))
    for layout in SHOWN:
        mine = sorted((r for r in runs if r["layout"] == layout), key=lambda r: r["concurrency"])
        if not mine:
            continue
        x = [r["concurrency"] for r in mine]
        line = latency.plot(x, [r["p50_ms"] for r in mine], marker="o", label=f"{layout} p50")[0]
        latency.plot(x, [r["p99_ms"] for r in mine], marker="x", linestyle="--", color=line.get_color(),
                     label=f"{layout} p99")
        cost.plot(x, [1000.0 / r["rps"] if r["rps"] else float("nan") for r in mine], marker="o",
                  color=line.get_color(), label=f"{layout} wall ms/request (1/rps)")
        cpu = [r.get("cpu_ms_per_request") for r in mine]
        if all(value is not None for value in cpu):
            cost.plot(x, cpu, marker="s", linestyle=":", color=line.get_color(), label=f"{layout} CPU ms/request")
    for axes, title, unit in ((latency, "latency", "ms"), (cost, "cost per request", "ms per request")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("concurrency (closed-loop clients)")
        axes.set_ylabel(unit)
        axes.set_title(title)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=7)
    machine = results.get("machine", {})
    figure.suptitle(f"unary Generate, max_tokens={results['settings']['max_tokens']} — "
                    f"{machine.get('cpu_count', '?')} CPUs, load average at start {machine.get('loadavg_start')}",
                    fontsize=9)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
