"""`kvlab predict`'s table and its plot (TTFT against prompt length, one line per tier)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


def table(ans: dict[str, Any]) -> str:
    m = ans["model"]
    lines = [
        f"{m['name']} ({m['attention'].upper()}, KV {m['kv_dtype']}), TP {ans['tp']}: "
        f"{ans['kv_bytes_per_token']:,} B/token one copy, {ans['kv_bytes_per_token_per_gpu']:,} B/token per GPU",
        f"node {ans['node']['name']}; recompute: {ans['recompute']['source']}; "
        f"restore fixed cost {ans['restore_fixed_s']:g} s"
        + ("" if ans["restore_fixed_s"] else " (physics only: calibrate for the fixed costs)"),
    ]
    tiers = list(ans["points"][0]["restore"]) if ans["points"] else []
    head = f"{'tokens':>9} {'KV (copy)':>10} {'per GPU':>10} {'recompute':>10} " + " ".join(
        f"{t:>10}" for t in tiers
    )
    lines += ["", head + "   limit (first tier)"]
    for p in ans["points"]:
        lim = p["restore"][tiers[0]]["limit"] if tiers else ""
        lines.append(
            f"{p['tokens']:>9,} {_gb(p['kv_bytes']):>10} {_gb(p['kv_bytes_per_gpu']):>10} "
            f"{p['recompute_s']:>9.3f}s "
            + " ".join(f"{p['restore'][t]['ttft_s']:>9.3f}s" for t in tiers)
            + f"   {lim}"
        )
    if "bill" in ans:
        b = ans["bill"]
        lines += [
            "",
            "bill:",
            f"  GPU cache holds {b['gpu_cache_tokens']:,} tokens ({b['gpu_cache_note']})",
            f"  working set {b['working_set_tokens']:,} tokens = {_gb(b['working_set_bytes'])}: "
            f"DRAM {b['dram_share_of_node'] or 0:.0%} of the node's, NVMe {b['nvme_share_for_working_set'] or 0:.1%}"
            f" of {_gb(b['nvme_capacity_bytes'])}",
            f"  staging ring {_gb(b['staging_ring_bytes'])}",
            f"  saving {b['save_tokens_s']:,.0f} tokens/s writes {b['drive_write_bytes_per_day'] / 1e12:.1f} TB/day:"
            f" {b['drive_writes_per_day_needed'] or 0:.2f} drive writes/day against {b['drive_writes_per_day_rated']}"
            f" rated; {b['drive_write_gbps_needed']:.2f} of {b['drive_write_gbps_available']:.1f} GB/s",
        ]
        if b.get("drive_rated_life_years") is not None:
            lines.append(f"  the drives' rated writes last {b['drive_rated_life_years']:.2f} years at this rate")
        for k in ("dram_cost", "nvme_cost_for_working_set"):
            if k in b:
                lines.append(f"  {k.replace('_', ' ')}: {b[k]:,.2f}")
    return "\n".join(lines)


def cells_table(cells: list[dict[str, Any]], title: str) -> str:
    lines = [
        title,
        f"{'setup':<16} {'tier':<9} {'tokens':>8} {'predicted':>10} {'interval':>17} {'measured':>9} {'error':>7}",
    ]
    for c in cells:
        iv = c.get("interval_s")
        ivs = f"{iv[0]:.3f}-{iv[1]:.3f}" if iv else "-"
        m = c.get("measured_ttft_s")
        ms = f"{m:.3f}s" if m is not None else "-"
        err = f"{c['error']:+.0%}" if "error" in c else "-"
        lines.append(
            f"{c['setup']:<16} {c.get('tier', ''):<9} {c['tokens']:>8,} {c['predicted_ttft_s']:>9.3f}s "
            f"{ivs:>17} {ms:>9} {err:>7}"
        )
    return "\n".join(lines)


def plot(ans: dict[str, Any], path: Path, cells: list[dict[str, Any]] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["tokens"] for p in ans["points"]]
    if xs:
        ax.plot(xs, [p["recompute_s"] for p in ans["points"]], "k--", marker="o", label="recompute")
        for tier in ans["points"][0]["restore"]:
            ax.plot(xs, [p["restore"][tier]["ttft_s"] for p in ans["points"]], marker="o", label=tier)
    by: dict[str, list[dict[str, Any]]] = {}
    for c in cells or []:
        by.setdefault(f"{c['setup']} ({c.get('tier', '')})", []).append(c)
    for name, cs in by.items():
        cs.sort(key=lambda c: c["tokens"])
        line = ax.plot(
            [c["tokens"] for c in cs],
            [c["predicted_ttft_s"] for c in cs],
            marker="o",
            label=f"{name} predicted",
        )[0]
        meas = [(c["tokens"], c["measured_ttft_s"]) for c in cs if "measured_ttft_s" in c]
        if meas:
            ax.plot(*zip(*meas, strict=True), "x", color=line.get_color(), label=f"{name} measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, s")
    ax.set_title(f"TTFT against prompt length: {ans['model']['name']}, TP {ans['tp']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
