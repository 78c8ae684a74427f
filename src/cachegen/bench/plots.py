"""PNG plots of benchmark results (matplotlib, Agg backend) and plain-text tables."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

# one colour and marker per codec family, stable across plots
_STYLE = {
    "cachegen": ("tab:red", "o"),
    "cachegen-released": ("tab:purple", "s"),
    "fp16": ("tab:gray", "D"),
    "bf16": ("tab:gray", "d"),
    "uniform8": ("tab:blue", "^"),
    "uniform4": ("tab:blue", "v"),
    "kivi4": ("tab:green", "^"),
    "kivi2": ("tab:green", "v"),
    "recompute": ("black", "x"),
}


def _style(name: str) -> tuple[str, str]:
    return _STYLE.get(name, ("tab:orange", "P"))


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _groups(rows: Sequence[dict], key: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


def quality_plot(result: dict, path: str | Path, kl_floor: float = 1e-7) -> Path:
    """Bits/value (x) against KL (y, log) per codec; levels of one codec are joined by a line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for name, rows in _groups(result["rows"], "codec").items():
        rows = sorted(rows, key=lambda r: r["bits_per_value"])
        xs = [r["bits_per_value"] for r in rows]
        ys = [max(r["kl"], kl_floor) for r in rows]
        color, marker = _style(name)
        ax.plot(
            xs, ys, marker=marker, color=color, label=name, linestyle="-" if len(rows) > 1 else "none", markersize=7
        )
        for r, x, y in zip(rows, xs, ys):
            if r.get("level") is not None:
                ax.annotate(
                    f"L{r['level']}", (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8, color=color
                )
    ax.set_yscale("log")
    ax.set_xlabel("bits per KV value (side information included)")
    ax.set_ylabel("KL divergence to the unmodified cache (nats/token)")
    ax.set_title(
        f"{result.get('model', '')}: size vs quality, {result.get('context_tokens')} context tokens "
        f"of {Path(str(result.get('text', ''))).name}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def ttft_plot(result: dict, path: str | Path) -> Path:
    """Bandwidth (x, log) against TTFT (y, log) per method; one line per method and level."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    series: dict[tuple[str, object], list[dict]] = {}
    for r in result["rows"]:
        series.setdefault((r["method"], r.get("level")), []).append(r)
    cmaps = {"cachegen": "Reds", "cachegen-released": "Purples"}
    levels: dict[str, list] = {}
    color: str | tuple[float, float, float, float]
    for name, level in series:
        levels.setdefault(name, []).append(level)
    for (name, level), rows in series.items():
        rows = sorted(rows, key=lambda r: r["bandwidth_gbps"])
        color, marker = _style(name)
        lv = levels[name]
        if len(lv) > 1:  # one shade per level, darker = higher level number
            import matplotlib

            i = sorted(lv, key=lambda x: (x is None, x)).index(level)
            color = matplotlib.colormaps[cmaps.get(name, "Greys")](0.4 + 0.55 * i / (len(lv) - 1))
        lab = name if level is None else f"{name} L{level}"
        ax.plot(
            [r["bandwidth_gbps"] for r in rows],
            [r["ttft_s"] for r in rows],
            marker=marker,
            color=color,
            linestyle="-",
            label=lab,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth (Gbit/s)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(
        f"{result.get('model', '')}: TTFT, {result.get('context_tokens')} context tokens, link {result.get('link')}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best", ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def needle_plot(result: dict, path: str | Path) -> Path:
    """Accuracy with its 95% Wilson interval against bits/value (recompute drawn as a band)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for r in result["rows"]:
        if r.get("bits_per_value") is None:
            ax.axhspan(r["ci_low"], r["ci_high"], color="black", alpha=0.08)
            ax.axhline(
                r["accuracy"],
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"{r['codec']} (uncompressed) {r['accuracy']:.2f}",
            )
    for name, rows in _groups([r for r in result["rows"] if r.get("bits_per_value") is not None], "codec").items():
        rows = sorted(rows, key=lambda r: r["bits_per_value"])
        color, marker = _style(name)
        xs = [r["bits_per_value"] for r in rows]
        ys = [r["accuracy"] for r in rows]
        err = [[y - r["ci_low"] for y, r in zip(ys, rows)], [r["ci_high"] - y for y, r in zip(ys, rows)]]
        ax.errorbar(
            xs,
            ys,
            yerr=err,
            marker=marker,
            color=color,
            label=name,
            capsize=3,
            linestyle="-" if len(rows) > 1 else "none",
        )
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("bits per KV value")
    ax.set_ylabel("needle accuracy (95% Wilson interval)")
    ax.set_title(
        f"{result.get('model', '')}: needle, {result.get('cases')} cases, {result.get('context_tokens')} tokens",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


# -- tables -----------------------------------------------------------------------


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
            return f"{v:.2e}"
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.2f}"
    return str(v)


def table(rows: Sequence[dict], cols: Sequence[str], markdown: bool = False) -> str:
    """A fixed-width (or Markdown) table of ``cols`` from ``rows``."""
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    if markdown:
        out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        out += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(out)
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(row) for row in cells])
