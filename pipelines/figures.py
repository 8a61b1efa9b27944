"""The eval's PNG figures, drawn like the paper's: λ against BLEU and perplexity, solver traces, top-10 tokens."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers or CI
import matplotlib.pyplot as plt  # noqa: E402


def lambda_curves(path: Path, lams: list[float], series: dict[str, list[float]], ylabel: str,
                  baseline: float | None = None, baseline_label: str = "softmax") -> None:
    """One line per series over the λ grid: a symlog axis (linear below 0.1) that starts at λ = 0, so λ = 0 sits
    on the left edge and no negative λ is drawn."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, ys in series.items():
        ax.plot(lams, ys, marker="o", label=name, clip_on=False)  # the λ = 0 marker on the edge is drawn whole
    if baseline is not None:
        ax.axhline(baseline, color="grey", ls="--", lw=1, label=baseline_label)
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlim(0, max(max(lams), 0.1) * 1.5)
    ax.set_xlabel("λ")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def solver_traces(path: Path, traces: dict[str, dict[str, list[float]]]) -> None:
    """Left: ‖xᵗ⁺¹ − xᵗ‖ per iteration; right: the duality gap per iteration (log scale), one line per solver."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for name, tr in traces.items():
        if tr.get("step"):
            axes[0].plot(range(1, len(tr["step"]) + 1), tr["step"], marker=".", label=name)
        axes[1].plot(range(len(tr["gap"])), [max(g, 1e-17) for g in tr["gap"]], marker=".", label=name)
    axes[0].set(xlabel="iteration t", ylabel="‖xᵗ⁺¹ − xᵗ‖₂", yscale="log", title="step size")
    axes[1].set(xlabel="iteration t", ylabel="duality gap f(x) − g(u)", yscale="log", title="certificate")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def top_tokens(path: Path, context: str, panels: dict[str, list[tuple[str, float]]]) -> None:
    """Horizontal bars of the top-10 next tokens and their probabilities, one panel per decoder."""
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.8))
    for ax, (name, rows) in zip(axes, panels.items()):
        labels = [repr(t) for t, _ in rows][::-1]
        ax.barh(labels, [p for _, p in rows][::-1])
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle(f"next token after: {context!r}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
