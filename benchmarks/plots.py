"""PNG plots of a benchmark run: throughput and ITL vs RTT, tokens per verify by mode."""

from __future__ import annotations

from pathlib import Path

MODE_ORDER = ("server_ar", "server_sd", "edge_stop_wait", "edge_proactive", "edge_full", "vllm_ar", "vllm_ngram")


def _series(rows: list[dict], x: str, fixed: str, y: str) -> dict[str, tuple[list, list]]:
    """mode -> (xs, ys) over the sweep of ``x`` at the most common value of ``fixed``."""
    vals = [r[fixed] for r in rows]
    at = max(set(vals), key=vals.count) if vals else None
    out: dict[str, tuple[list, list]] = {}
    for mode in MODE_ORDER:
        pts = sorted((r[x], r.get(y, float("nan"))) for r in rows if r["mode"] == mode and r[fixed] == at)
        if pts:
            out[mode] = ([p[0] for p in pts], [p[1] for p in pts])
    return out


def plot_all(rows: list[dict], out_dir: Path, run_id: str) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for ax, (y, label) in zip(axes, [("server_tokens_per_busy_s", "tokens / verifier-busy second"),
                                     ("tokens_per_server_cpu_s", "tokens / whole-server CPU second"),
                                     ("server_tokens_per_s", "tokens / wall second"),
                                     ("itl_ms_mean", "mean inter-token latency (ms)")]):
        for mode, (xs, ys) in _series(rows, "rtt_ms", "sessions", y).items():
            ax.plot(xs, ys, marker="o", label=mode)
        ax.set_xlabel("RTT (ms)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{run_id}: throughput and ITL vs RTT")
    fig.tight_layout()
    paths["plot_rtt"] = out_dir / f"{run_id}_rtt.png"
    fig.savefig(paths["plot_rtt"], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = [m for m in MODE_ORDER if any(r["mode"] == m for r in rows)]
    means = []
    for m in modes:
        v = [r["tokens_per_verify"] for r in rows if r["mode"] == m and r["tokens_per_verify"] == r["tokens_per_verify"]]
        means.append(sum(v) / len(v) if v else 0.0)
    axes[0].bar(modes, means, color="tab:blue")
    axes[0].set_ylabel("tokens per verify round (mean over configs)")
    axes[0].tick_params(axis="x", rotation=25)
    for mode, (xs, ys) in _series(rows, "sessions", "rtt_ms", "tokens_per_server_cpu_s").items():
        axes[1].plot(xs, ys, marker="o", label=mode)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("concurrent sessions")
    axes[1].set_ylabel("tokens / whole-server CPU second")
    axes[1].legend(fontsize=8)
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    paths["plot_modes"] = out_dir / f"{run_id}_modes.png"
    fig.savefig(paths["plot_modes"], dpi=110)
    plt.close(fig)
    return paths
