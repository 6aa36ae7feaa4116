"""Layer-wise push vs push-after-forward on the paged Llama (the demo's scenarios),
plus a timeline picture of one prefill step for each."""
from __future__ import annotations

from typing import Dict, Optional

from .. import demo


def run(quick: bool = False) -> Dict[str, object]:
    argv = ["--repeats", "2" if quick else "5"]
    if quick:
        argv += ["--layers", "8", "--prompt-len", "1024", "--no-compile"]
    result = demo.run(demo.parse_args(argv))
    return result


def plot_timeline(result: Dict[str, object], path: str, flavor: Optional[str] = None) -> str:
    """Per-layer compute spans and transfer spans (event ready -> landed) of one
    prefill step, layer-wise vs after-forward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flavor = flavor or ("compiled" if "compiled" in result else "eager")
    lw = result["traces"][f"layerwise[{flavor}]"]
    af = result["traces"][f"after_forward[{flavor}]"]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    colors = plt.cm.viridis([i / max(1, len(lw["layers"]) - 1) for i in range(len(lw["layers"]))])
    rows = {"layer-wise: compute": 3, "layer-wise: transfer": 2,
            "after forward: compute": 1, "after forward: transfer": 0}
    prev = 0.0
    for row, color in zip(lw["layers"], colors):  # a layer computes until its push
        ax.broken_barh([(prev, row["pushed"] - prev)], (rows["layer-wise: compute"] - 0.35, 0.7),
                       facecolors=color, edgecolor="white", linewidth=0.3)
        prev = row["pushed"]
        ax.broken_barh([(row["event_ready"], row["landed"] - row["event_ready"])],
                       (rows["layer-wise: transfer"] - 0.35, 0.7), facecolors=color, edgecolor="black",
                       linewidth=0.3)
    ax.broken_barh([(0, af["forward_s"])], (rows["after forward: compute"] - 0.35, 0.7),
                   facecolors="#bbbbbb")
    for row, color in zip(af["layers"], colors):
        ax.broken_barh([(row["event_ready"], row["landed"] - row["event_ready"])],
                       (rows["after forward: transfer"] - 0.35, 0.7), facecolors=color, edgecolor="black",
                       linewidth=0.3)
    for trace, name, color in ((lw, "layer-wise", "tab:green"), (af, "after forward", "tab:red")):
        ax.axvline(trace["kv_ready_s"], linestyle="--", linewidth=1, color=color,
                   label=f"{name}: decode side has all KV ({trace['kv_ready_s']:.3f} s)")
    ax.set_yticks(list(rows.values()), list(rows.keys()))
    ax.set_xlabel("seconds since the start of prefill")
    ax.set_title(f"one prefill step ({flavor} forward); colour = layer; "
                 "transfer bars span event ready -> landed")
    fig.legend(loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
