"""The plot of `shram-static bench --plot`: decode time against context per backend, with floors."""


def plot(results: list[dict], path: str) -> None:
    """Decode ms/step against context, one line per (model, backend, batch), floors dashed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(f"--plot needs matplotlib (pip install matplotlib): {e}") from e
    fig, ax = plt.subplots(figsize=(8, 5))
    floors = {}
    for r in results:
        xs = [p["context"] for p in r["points"]]
        ax.plot(xs, [p["decode_ms"] for p in r["points"]], marker="o",
                label=f"{r['model']} {r['backend']} B={r['batch']}")
        floors[(r["model"], r["batch"])] = (r["floor_ms"], xs)
    for (m, b), (f, xs) in floors.items():
        ax.hlines(f, min(xs), max(xs), linestyles="dashed", colors="gray")
        ax.annotate(f"floor {m} B={b}", (max(xs), f), fontsize=8, ha="right", va="bottom")
    ax.set_xlabel("context (tokens held per row)")
    ax.set_ylabel("decode ms / step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
