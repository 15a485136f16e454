"""The PNG of held-out accuracy over a run's time that `brigade local` writes next to its summary."""

from __future__ import annotations


def plot_accuracy(summary: dict, path: str, started_at: float) -> bool:
    """Held-out accuracy over the run's time (and the training reward per step), as a PNG; False without evaluations.

    Time is counted from `started_at` (wall clock), the command's start."""
    curve = summary.get("accuracy_curve") or []
    if not curve:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    xs, ys = [(c["ts"] - started_at) / 60 for c in curve], [c["accuracy"] for c in curve]
    ax.plot(xs, ys, "o-", color="tab:blue", label=f"held-out accuracy (greedy, {curve[-1]['total']} prompts)")
    for c, x, y in zip(curve, xs, ys):
        ax.annotate(f"v{c['version']}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    # Cut evaluations judged a subset of the prompts: drawn apart (hollow), never joined to the curve.
    partial = [c for c in summary.get("evaluations_cut") or [] if c.get("partial_accuracy") is not None]
    if partial:
        ax.plot(
            [(c["ts"] - started_at) / 60 for c in partial],
            [c["partial_accuracy"] for c in partial],
            "o",
            mfc="none",
            color="tab:blue",
            label="cut evaluation (partial: a subset of the prompts)",
        )
        for c in partial:
            x = (c["ts"] - started_at) / 60
            ax.annotate(
                f"v{c['version']} ({c['judged']}/{c['planned']})",
                (x, c["partial_accuracy"]),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=7,
            )
    steps = summary.get("reward_curve") or []
    if steps:
        ax.plot(
            [(s["ts"] - started_at) / 60 for s in steps],
            [s["reward"] for s in steps],
            ".",
            color="tab:orange",
            alpha=0.5,
            label="training reward (per step)",
        )
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("accuracy / reward")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    base, final = summary.get("base_accuracy"), summary.get("final_accuracy")
    if base is not None and final is not None:
        ax.set_title(f"held-out accuracy {base:.2f} (base) -> {final:.2f} (final)")
    if summary.get("cut"):  # `brigade local` ended early: say so on the picture too
        ax.set_title(f"{ax.get_title()}  [run cut: {summary['cut'].replace('_', ' ')}]".strip(), fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
