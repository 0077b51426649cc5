"""Printing (vLLM's result block per cell, one summary matrix), JSON and the TTFT/TPOT plot."""
from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys

_W = 50  # width of vLLM's result block


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("deepinfer", "torch", "transformers", "numpy", "httpx", "matplotlib"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:  # deepinfer runs from a checkout here; the commit says which code was measured
        out["deepinfer_git"] = subprocess.run(
            ["git", "-C", repo, "describe", "--always", "--dirty"], capture_output=True, text=True,
            timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["deepinfer_git"] = None
    return out


def fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def result_block(rec: dict) -> str:
    lines = [f"{' Serving Benchmark Result ':=^{_W}}"]

    def row(label, value):
        lines.append(f"{label:<40} {value:<10}")

    row("Cell:", f"{rec['backend']} in={rec['input_len']} out={rec['output_len']} c={rec['concurrency']}"
                 f" nextn={rec.get('nextn', 0)}")
    row("Successful requests:", rec["completed"])
    row("Failed requests:", rec["failed"])
    row("Maximum request concurrency:", rec["max_concurrency"])
    row("Benchmark duration (s):", fmt(rec["duration"]))
    row("Total input tokens:", rec["total_input_tokens"])
    row("Total generated tokens:", rec["total_output_tokens"])
    row("Request throughput (req/s):", fmt(rec["request_throughput"]))
    row("Output token throughput (tok/s):", fmt(rec["output_throughput"]))
    row("Total token throughput (tok/s):", fmt(rec["total_token_throughput"]))
    row("Output tokens per decode step:", fmt(rec["mean_tokens_per_decode_step"]))
    spec = rec.get("spec_decode")
    if spec and spec.get("draft_tokens"):
        row("Engine tokens per decode step:", fmt(spec["tokens_per_decode_step"]))
        row("Draft acceptance rate:", fmt(spec["draft_accept_rate"]))
        row("Acceptance per depth:", " ".join(fmt(a) for a in spec["accept_rate_per_depth"]))
        row("Drafts verified per step:", fmt(spec.get("verified_per_step")))
        row("Confidence error:", fmt(spec.get("confidence_error")))
    for key, name, header in (("ttft", "TTFT", "Time to First Token"),
                              ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                              ("itl", "ITL", "Inter-token Latency"),
                              ("e2el", "E2EL", "End-to-end Latency")):
        lines.append(f"{header:-^{_W}}")
        row(f"Mean {name} (ms):", fmt(rec[f"mean_{key}_ms"]))
        row(f"Median {name} (ms):", fmt(rec[f"median_{key}_ms"]))
        row(f"P99 {name} (ms):", fmt(rec[f"p99_{key}_ms"]))
    if rec.get("speedup_vs_transformers"):
        s = rec["speedup_vs_transformers"]
        lines.append(f"{'vs transformers (x, >1: deepinfer better)':-^{_W}}")
        for k in ("output_throughput", "mean_ttft", "mean_tpot", "mean_e2el"):
            row(f"{k}:", fmt(s[k]))
    lines.append("=" * _W)
    return "\n".join(lines)


def platform_label(p: dict) -> str:
    name = p.get("name") or "unknown"
    return name + "-host" if p.get("is_host_mode") else name


def summary_matrix(records: list[dict]) -> str:
    head = (f"{'backend':<18} {'platform':<12} {'in':>5} {'out':>5} {'conc':>4} {'nextn':>5} {'ok':>4} {'fail':>4} "
            f"{'TTFT ms':>9} {'p99':>9} {'TPOT ms':>9} {'p99':>9} {'E2EL ms':>9} {'tok/s':>8} {'req/s':>7} "
            f"{'tok/step':>8} {'xTF tok/s':>9}")
    lines = [head, "-" * len(head)]
    for r in records:
        s = (r.get("speedup_vs_transformers") or {}).get("output_throughput")
        lines.append(
            f"{r['backend']:<18} {platform_label(r['platform']):<12} "
            f"{r['input_len']:>5} {r['output_len']:>5} {r['concurrency']:>4} {r.get('nextn', 0):>5} "
            f"{r['completed']:>4} {r['failed']:>4} {fmt(r['mean_ttft_ms'], 1):>9} {fmt(r['p99_ttft_ms'], 1):>9} "
            f"{fmt(r['mean_tpot_ms'], 1):>9} {fmt(r['p99_tpot_ms'], 1):>9} {fmt(r['mean_e2el_ms'], 1):>9} "
            f"{fmt(r['output_throughput'], 1):>8} {fmt(r['request_throughput'], 2):>7} "
            f"{fmt(r['mean_tokens_per_decode_step']):>8} {fmt(s):>9}")
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def plot(path: str, records: list[dict]) -> None:
    """Mean TTFT and TPOT against concurrency: one line per (backend, input, output) series."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple, list[dict]] = {}
    for r in records:
        series.setdefault((r["backend"], r["input_len"], r["output_len"]), []).append(r)
    # One colour per (input, output) shape, one line style per backend.
    shapes = sorted({(n_in, n_out) for _, n_in, n_out in series})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for (backend, n_in, n_out), recs in sorted(series.items()):
        recs = sorted(recs, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in recs]
        style = "--" if backend == "transformers" else "-"
        color = colors[shapes.index((n_in, n_out)) % len(colors)]
        for ax, key in zip(axes, ("mean_ttft_ms", "mean_tpot_ms")):
            ys = [r[key] if r[key] is not None else float("nan") for r in recs]
            ax.plot(xs, ys, style, color=color, marker="o", label=f"{backend} in={n_in} out={n_out}")
    concurrencies = sorted({r["concurrency"] for r in records})
    for ax, title in zip(axes, ("TTFT (mean, ms)", "TPOT (mean, ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{os.path.basename(records[0]['config']['model'].rstrip('/'))} on "
                 f"{platform_label(records[0]['platform'])}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def say(text: str) -> None:
    print(text, flush=True)
    sys.stdout.flush()
