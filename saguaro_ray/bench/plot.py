"""The bench report as a picture: a Gantt of a few rounds per mode, and tokens/s bars.

matplotlib is an optional extra (``pip install 'saguaro-ray[plot]'``): only
this module needs it, and it is imported when a plot is asked for.
"""

from __future__ import annotations

import os
from typing import Any

from saguaro_ray.errors import ConfigError


def require_matplotlib() -> None:
    """Raise :class:`ConfigError` naming the extra when matplotlib is missing:
    called before a bench runs, so a missing extra costs no run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("plotting the bench report needs matplotlib: pip install 'saguaro-ray[plot]'") from None


def plot(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Gantt of target and draft work over a few rounds per mode, and tokens/s bars."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sample = report["timeline_sample"]
    keys = [k for k in sample if sample[k]]
    fig, axes = plt.subplots(len(keys) + 1, 1, figsize=(11, 2.2 * (len(keys) + 1) + 1))
    axes = list(axes) if len(keys) + 1 > 1 else [axes]
    colors = {"verify": "#1f77b4", "build": "#2ca02c", "draft": "#ff7f0e", "lookup": "#9467bd"}
    for ax, key in zip(axes, keys):
        rounds = sample[key]
        t0 = rounds[0]["start"]
        for rd in rounds:
            for lane, part, color in ((1, "verify", "verify"), (0, "build", "build"), (0, "draft", "draft"), (0, "lookup", "lookup"), (0, "miss_backup", "draft")):
                span = rd.get(part)
                if span:
                    ax.barh(lane, (span[1] - span[0]) * 1000, left=(span[0] - t0) * 1000, color=colors[color], height=0.6)
            ax.axvline((rd["start"] - t0) * 1000, color="#cccccc", linewidth=0.5)
        ax.set_yticks([0, 1], ["draft", "target"])
        ax.set_title(key, fontsize=9, loc="left")
        ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    if keys:
        axes[0].legend(handles, list(colors), loc="upper right", fontsize=7, ncols=4)
    ax = axes[-1]
    # the bars: the lowest single temperature (a mixed cell's is a label), else the first cell's; the first sampling setting's and request length's
    single = [x["temperature"] for x in report["results"] if not isinstance(x["temperature"], str)]
    shown = min(single) if single else report["results"][0]["temperature"]
    first = report["results"][0]
    res = [e for e in report["results"] if e["temperature"] == shown and (e.get("sampling"), e.get("max_tokens")) == (first.get("sampling"), first.get("max_tokens"))]
    labels = [f"{e['mode']}/{e['runtime'][:2]}/d{e['num_drafts']}\nb={e['batch_size']}" for e in res]
    ax.bar(range(len(res)), [e["tokens_per_s"] for e in res], color="#1f77b4")
    ax.errorbar(
        range(len(res)),
        [e["tokens_per_s"] for e in res],
        yerr=[[e["tokens_per_s"] - e["tokens_per_s_min"] for e in res], [e["tokens_per_s_max"] - e["tokens_per_s"] for e in res]],
        fmt="none",
        color="black",
        capsize=2,
    )
    ax.set_xticks(range(len(res)), labels, fontsize=7)
    ax.set_ylabel("decode tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
