"""`--plot FILE.png` of `tinyloop bench` and `tinyloop loadtest`: pictures of their JSON results (matplotlib, an
optional extra: `pip install matplotlib`, or `pip install -e '.[peers]'`). No torch import here."""
from __future__ import annotations

import sys


class PlotError(Exception):
    """Nothing to draw, or matplotlib is missing."""


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[peers]')") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_bench(results: dict, path: str) -> None:
    """Decode tok/s per runtime and format, grouped by batch size, one panel per config; a dashed line per batch
    marks the tok/s at which fp32 weights would stream at the measured memory bandwidth."""
    sections = [s["data"] for s in results.get("sections", {}).values() if s.get("data", {}).get("rows")]
    if not sections:
        raise PlotError("nothing to plot: no section measured decode rows (run with --peers)")
    plt = _pyplot()
    configs = [(d, c) for d in sections for c in d["configs"]]
    fig, axes = plt.subplots(1, len(configs), figsize=(7 * len(configs), 5), squeeze=False)
    for ax, (data, config) in zip(axes[0], configs):
        rows = [r for r in data["rows"] if r["config"] == config]
        batches = sorted({r["batch"] for r in rows})
        series = list(dict.fromkeys(f"{r['system']} {r['format']}" for r in rows))
        width = 0.8 / len(series)
        for i, name in enumerate(series):
            xs, ys = [], []
            for j, b in enumerate(batches):
                hit = [r for r in rows if f"{r['system']} {r['format']}" == name and r["batch"] == b]
                if hit:
                    xs.append(j + (i - (len(series) - 1) / 2) * width)
                    ys.append(hit[0]["tok_s"])
            bars = ax.bar(xs, ys, width, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        fp32_bytes = data["configs"][config]["weights_read_per_step"] * 4
        for j, b in enumerate(batches):
            roof = data["bandwidth_Bps"] / fp32_bytes * b
            ax.hlines(roof, j - 0.45, j + 0.45, colors="k", linestyles="dashed",
                      label="fp32 weights at the measured bandwidth" if j == 0 else None)
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{config}: {data['threads']} threads, bandwidth {data['bandwidth_Bps'] / 1e9:.1f} GB/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_loadtest(results: dict, path: str) -> None:
    """Throughput (output tok/s, requests/s) and latency percentiles (end to end and first token, p50 and p99)
    against concurrency (closed loop) or arrival rate (open loop)."""
    runs = results.get("sweep", [results])
    if not all("latency_ms" in r for r in runs):
        raise PlotError("nothing to plot: --plot draws a closed- or open-loop load (not --soak or --side-by-side)")
    plt = _pyplot()
    key = "concurrency" if runs[0]["mode"] == "closed" else "rate"
    xs = [r[key] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    left.plot(xs, [r["output_tokens_per_s"] for r in runs], "o-", label="output tokens/s")
    left.plot(xs, [r["request_throughput"] for r in runs], "s-", label="requests/s")
    left.set_xlabel(key)
    left.set_ylabel("throughput")
    left.legend()
    for stat, style in (("latency_ms", "-"), ("ttft_ms", "--")):
        for q in ("p50", "p99"):
            ys = [r[stat][q] for r in runs]
            if all(y is not None for y in ys):
                left_name = "end to end" if stat == "latency_ms" else "first token"
                right.plot(xs, ys, "o" + style, label=f"{left_name} {q}")
    right.set_xlabel(key)
    right.set_ylabel("latency (ms)")
    right.legend()
    fig.suptitle(f"tinyloop loadtest, {runs[0]['mode']} loop, op {runs[0]['op']}, max_tokens {runs[0]['max_tokens']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_results(results: dict, json_path: str | None, plot_path: str | None, kind: str) -> None:
    """--json and --plot of `bench` and `loadtest` (PlotError when there is nothing to draw or no matplotlib)."""
    if json_path:
        import json
        from pathlib import Path

        Path(json_path).write_text(json.dumps(results, indent=2))
        print(f"results written to {json_path}", file=sys.stderr)
    if plot_path:
        (plot_bench if kind == "bench" else plot_loadtest)(results, plot_path)
        print(f"plot written to {plot_path}", file=sys.stderr)
