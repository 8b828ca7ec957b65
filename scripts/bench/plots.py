"""The benchmark's PNG plots (matplotlib, optional: without it there are none)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from scripts.bench.report import log


def make_plots(cfg, result: dict, out_dir: Path) -> list:
    """Speedup vs K, acceptance per draft position, predicted vs achieved and (with both
    methods) block vs token tokens per round, as PNG files in ``out_dir``; their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install matplotlib): no plots")
        return []
    spec = [r for r in result["speculative"] if r["k"] != "auto"]  # per-K plots
    auto = [r for r in result["speculative"] if r["k"] == "auto"]  # k=auto: a point right of the Ks
    files = []
    label = f"{result['model']['name'][:40]} / draft {result['draft']['spec']}"

    # 1. speedup vs K, one panel per batch size, one line per (method, temperature)
    bs = list(cfg.batch_sizes)
    fig, axes = plt.subplots(1, len(bs), figsize=(5 * len(bs), 4), squeeze=False)
    for ax, b in zip(axes[0], bs):
        ks = sorted({r["k"] for r in spec if r["batch_size"] == b})
        x_auto = (max(ks) if ks else 0) + 1
        for m in cfg.methods:
            for t in cfg.temperatures:
                rows = sorted([r for r in spec if r["batch_size"] == b and r["method"] == m and r["temperature"] == t],
                              key=lambda r: r["k"])
                ra = [r for r in auto if r["batch_size"] == b and r["method"] == m and r["temperature"] == t]
                if not rows and not ra:
                    continue
                x = [r["k"] for r in rows]
                y = [r["speedup"]["median"] for r in rows]
                lo = [r["speedup"]["median"] - r["speedup"]["min"] for r in rows]
                hi = [r["speedup"]["max"] - r["speedup"]["median"] for r in rows]
                line = ax.errorbar(x, y, yerr=[lo, hi], marker="o" if m == "token" else "s", capsize=2,
                                   linestyle="-" if m == "token" else "--", label=f"{m} T={t:g}")
                for r in ra:  # same colour as its method and temperature's fixed-K line
                    sp = r["speedup"]
                    ax.errorbar([x_auto], [sp["median"]], yerr=[[sp["median"] - sp["min"]], [sp["max"] - sp["median"]]],
                                marker="*", markersize=9, capsize=2, linestyle="none", color=line[0].get_color(),
                                label=None if rows else f"{m} T={t:g}")
        if auto and any(r["batch_size"] == b for r in auto):
            ax.set_xticks(ks + [x_auto], [str(k) for k in ks] + ["auto"])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("K (draft tokens per round; auto: k=auto, stars)")
        ax.set_ylabel("speedup over autoregressive")
        ax.legend(fontsize=7)
    fig.suptitle(f"speedup vs K (median, bars min-max)\n{label}", fontsize=9)
    fig.tight_layout()
    files.append(out_dir / "speedup_vs_k.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    # 2. acceptance per draft position at batch size bs[0], one panel per temperature
    temps = list(cfg.temperatures)
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for m in cfg.methods:
            for r in sorted([r for r in spec if r["batch_size"] == bs[0] and r["method"] == m and r["temperature"] == t],
                            key=lambda r: r["k"]):
                y = [np.nan if a is None else a for a in r["acceptance_per_position"]]
                ax.plot(range(1, r["k"] + 1), y, marker=".", linestyle="-" if m == "token" else ":",
                        label=f"{m} K={r['k']}")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"T={t:g}, batch {bs[0]}")
        ax.set_xlabel("draft position i")
        ax.set_ylabel("P(accept x_i | reached)")
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"acceptance per draft position: {label}", fontsize=9)
    fig.tight_layout()
    files.append(out_dir / "acceptance_per_position.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    # 3. predicted vs achieved
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), squeeze=False)
    names = [("basic", "(1-a^(K+1))/((1-a)(cK+1))"), ("with_verify", "(1-a^(K+1))/((1-a)(cK+v_K))"),
             ("measured_rounds", "batch tok/round / (c_prop K + f v_K + 1 - f)")]
    for ax, (n, title) in zip(axes[0], names):
        mx = 0.0
        for b, mk in zip(bs, "o^sDv"):
            pts = [(r["predicted_speedup"].get(n), r.get("decode_speedup", r["speedup"])["median"])
                   for r in spec if r["batch_size"] == b]
            pts = [(p, a) for p, a in pts if p is not None and math.isfinite(p)]
            if pts:
                ax.scatter([p for p, _ in pts], [a for _, a in pts], marker=mk, s=18, label=f"batch {b}")
                mx = max(mx, max(max(p, a) for p, a in pts))
        mx = max(mx * 1.05, 1.2)
        ax.plot([0, mx], [0, mx], color="grey", lw=0.8)
        ax.plot([0, mx], [0, 0.9 * mx], color="grey", lw=0.6, ls=":")
        ax.set_xlim(0, mx)
        ax.set_ylim(0, mx)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("predicted speedup")
        ax.set_ylabel("achieved decode speedup")
        ax.legend(fontsize=7)
    fig.suptitle(f"predicted vs achieved (dotted: 0.9 x predicted): {label}", fontsize=9)
    fig.tight_layout()
    files.append(out_dir / "predicted_vs_achieved.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    # 4. block vs token: tokens per round at batch bs[0]
    if len(cfg.methods) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for t in temps:
            for m in cfg.methods:
                rows = sorted([r for r in spec if r["batch_size"] == bs[0] and r["method"] == m and r["temperature"] == t],
                              key=lambda r: r["k"])
                ax.plot([r["k"] for r in rows], [r["tokens_per_round"] for r in rows], marker="o" if m == "token" else "s",
                        linestyle="-" if m == "token" else "--", label=f"{m} T={t:g}")
        ax.set_xlabel("K")
        ax.set_ylabel("tokens per round")
        ax.set_title(f"block vs token verification, batch {bs[0]}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(out_dir / "block_vs_token.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return [str(f) for f in files]
