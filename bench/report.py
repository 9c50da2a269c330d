"""Reports: JSON (everything), Markdown table, PNG stacked phase bars."""
from __future__ import annotations

import json
import os
import sys

PHASES = ("d2h", "serialize", "wire", "deserialize", "h2d")


def transfer_table(report: dict) -> str:
    rows = ["| transport | median ms | p90 ms | Gbit/s | % of reference | " + " | ".join(f"{p} ms" for p in PHASES)
            + " | phases/wall % |", "|---" * (6 + len(PHASES)) + "|"]
    for name, s in report["summary"].items():
        phases = " | ".join(f"{s[p + '_ms']['median']:.2f}" if p + "_ms" in s else "-" for p in PHASES)
        ratio = f"{s['phase_sum_vs_wall_pct']:.1f}" if "phase_sum_vs_wall_pct" in s else "-"
        rows.append(f"| {name} | {s['wall_ms']['median']:.2f} | {s['wall_ms']['p90']:.2f} | {s['gbps']:.2f} | "
                    f"{s['pct_of_reference']:.1f} | {phases} | {ratio} |")
    return "\n".join(rows)


def write_reports(report: dict, prefix: str) -> dict:
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    paths = {"json": prefix + ".json", "markdown": prefix + ".md"}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    table = transfer_table(report)
    with open(paths["markdown"], "w") as f:
        f.write(f"# KV transfer: {report['bytes'] / 1e6:.1f} MB, link {report['link']}\n\n`{report['command']}`\n\n{table}\n")
        if "fp8" in report:
            table += fp8_section(report)
            f.write(fp8_section(report))
    png = _plot(report, prefix + ".png")
    if png:
        paths["png"] = png
    paths["markdown_text"] = table
    return paths


def fp8_section(report: dict) -> str:
    fp8 = {"bytes": report["fp8"]["bytes"], "summary": report["fp8"]["summary"], "link": report["link"]}
    rows = "\n".join(f"| {n} | {s['wall']:.2f}x | {s['wire']:.2f}x |" if "wire" in s else f"| {n} | {s['wall']:.2f}x | |"
                     for n, s in report["fp8_speedup"].items())
    return (f"\n\n## The same KV as FP8 ({fp8['bytes'] / 1e6:.1f} MB), same run, same link\n\n{transfer_table(fp8)}\n\n"
            f"| transport | FP8 faster, end to end | on the wire |\n|---|---:|---:|\n{rows}\n")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _plot(report: dict, path: str) -> str | None:
    plt = _pyplot()
    if plt is None:
        return None
    names = [n for n in report["summary"] if "wire_ms" in report["summary"][n]]
    if not names:
        return None
    fig, ax = plt.subplots(figsize=(2 + 1.5 * len(names), 4))
    bottom = [0.0] * len(names)
    for phase in PHASES:
        values = [report["summary"][n][phase + "_ms"]["median"] for n in names]
        ax.bar(names, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms (median)")
    ax.set_title(f"KV transfer phases, {report['bytes'] / 1e6:.0f} MB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def serve_table(s: dict) -> str:
    rows = ["| metric | p50 | p90 | p99 |", "|---|---|---|---|"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "itl_p99_ms", "stall_ms", "e2e_ms"):
        q = s.get(name) or {}
        if q:
            rows.append(f"| {name} | {q['median']:.2f} | {q['p90']:.2f} | {q['p99']:.2f} |")
    rows.append("")
    rows.append(f"requests {s['requests']}, errors {s['errors']}, {s['request_per_s']:.2f} req/s, "
                f"{s['output_tok_per_s']:.1f} output tok/s, goodput {s['goodput_req_per_s']:.2f} req/s "
                f"({100 * s['goodput_fraction']:.0f}%)" + (f"; prefilled {s['disagg']}" if s.get("disagg") else ""))
    if s.get("workers"):  # a pdserve cluster's engines during the run (``bench.health``)
        from .health import worker_lines

        rows += ["", "Workers during the run:", ""] + [f"- {line}" for line in worker_lines(s["workers"])]
    return "\n".join(rows)


def write_serve_reports(report: dict, prefix: str) -> dict:
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    paths = {"json": prefix + ".json", "markdown": prefix + ".md"}
    with open(paths["json"], "w") as f:
        json.dump(report, f, indent=1)
    table = serve_table(report["summary"])
    with open(paths["markdown"], "w") as f:
        f.write(f"# Serving load against {report['url']}\n\n`{report['command']}`\n\n{table}\n")
    curves = {"ttft": [r["ttft_ms"] for r in report["samples"] if "ttft_ms" in r],
              "e2e": [r["e2e_ms"] for r in report["samples"] if "ttft_ms" in r]}
    png = plot_cdfs({"this run": curves}, prefix + ".png")
    if png:
        paths["png"] = png
    paths["markdown_text"] = table
    return paths


def plot_cdfs(series: dict, path: str) -> str | None:
    """``series``: label -> {metric: [ms, ...]}; one panel per metric."""
    plt = _pyplot()
    if plt is None:
        return None
    metrics = sorted({m for curves in series.values() for m in curves})
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for label, curves in series.items():
            values = sorted(curves.get(metric) or [])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
        ax.set_xlabel(f"{metric} ms")
        ax.set_ylabel("fraction of requests")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def command_line(name: str) -> str:
    """``pdserve bench NAME ...`` as it was run (global options before ``bench`` left out)."""
    argv = sys.argv
    rest = argv[argv.index(name) + 1:] if name in argv[1:] else argv[3:]
    return " ".join(["pdserve", "bench", name, *rest])
