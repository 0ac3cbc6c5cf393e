"""The curve panels of the benches of whole jobs (r3_ab, sparse): one style, one way to save."""
from __future__ import annotations

from pathlib import Path


def panels(rows: int, cols: int, size=(10, 7)):
    """(figure, flat list of axes) on the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(rows, cols).ravel())


def style(ax, title: str, log: bool = False) -> None:
    if log:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def save(fig, title: str, png: Path) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    return png
