"""Reports: JSON (everything), Markdown table, PNG stacked phase bars."""
from __future__ import annotations

import json
import os

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
    png = _plot(report, prefix + ".png")
    if png:
        paths["png"] = png
    paths["markdown_text"] = table
    return paths


def _plot(report: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
