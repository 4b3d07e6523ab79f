"""Shared look of the metrics plots: agent and kind colours, rc style, saving, empty-panel text.

Figures use matplotlib's object API (`Figure`, no pyplot), so nothing here touches global backend state;
PNGs are rendered by the Agg canvas and plotting works headless and from any thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

PathLike = str | os.PathLike[str]

KIND_COLORS = {
    "prefill": "#8c6bb1",
    "decode": "#41ab5d",
    "train": "#2171b5",
    "sync": "#fd8d3c",
    "swap": "#969696",
    "load": "#fdd0a2",
}
# Kind strips under agent-coloured bars: greys and hues that tab10's agent colours don't use.
KIND_STRIP_COLORS = {
    "prefill": "#000000",
    "decode": "#b0b0b0",
    "train": "#606060",
    "sync": "#e7298a",
    "swap": "#e6ab02",
    "load": "#a6761d",
}
STYLE = {
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linestyle": "-",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titleweight": "bold",
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "figure.dpi": 110,
}


def agent_colors(agents: Iterable[str]) -> dict[str, str]:
    """A stable colour per agent: the same agent name gets the same colour in every plot of a run."""
    palette = [to_hex(color) for color in colormaps["tab10"].colors]
    return {agent: palette[index % len(palette)] for index, agent in enumerate(sorted(set(agents)))}


def kind_color(kind: str, *, strip: bool = False) -> str:
    """Colour of an interval kind: bold for kind-coloured bars, greys/accents for strips under agent bars."""
    return (KIND_STRIP_COLORS if strip else KIND_COLORS).get(kind, "#737373")


def ensure_dir(path: PathLike) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(figure: Figure, path: Path) -> Path:
    figure.savefig(path, bbox_inches="tight", facecolor="white")
    return path


def draw_no_data(axes) -> None:
    """Grey 'no data recorded' in the middle of an empty panel (the layout stays the same)."""
    axes.text(
        0.5,
        0.5,
        "no data recorded",
        transform=axes.transAxes,
        ha="center",
        va="center",
        color="#969696",
        fontsize=10,
    )
