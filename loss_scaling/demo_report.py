"""The demo's output: its progress bar, results table and figure (``loss_scaling.demo``
re-exports them). Imports nothing optional at import time (tqdm, matplotlib on use).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

# loss_scaling.demo.RunResult; not imported, since the demo imports this module.
RunResult = Any


class _Bar(Protocol):
    def update(self, n: int = 1) -> Any: ...
    def set_postfix_str(self, s: str = "", refresh: bool = True) -> Any: ...
    def close(self) -> Any: ...


class _TextBar:
    """A minimal stand-in for ``tqdm`` (used when it is not installed)."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
        self.start = time.perf_counter()

    def _draw(self, end: str = "") -> None:
        done = int(30 * self.n / max(self.total, 1))
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r{self.desc}: [{'#' * done}{'.' * (30 - done)}] "
                         f"{self.n}/{self.total} {elapsed:5.1f}s {self.postfix}{end}")
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        self._draw(end="\n")


def _progress_bar(total: int, desc: str) -> _Bar:
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextBar(total, desc)
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)


# -------------------------------------------------------------------------- reports


def _format_scale(value: float) -> str:
    mantissa, exponent = np.frexp(value)
    return f"2^{exponent - 1}" if mantissa == 0.5 and value != 1 else f"{value:g}"


def accuracy_gaps(results: Sequence[RunResult]) -> dict[str, float]:
    """Test accuracy of each mode minus that of ``fp32``, in points (percent)."""
    reference = {r.mode.name: r for r in results}["fp32"]
    return {r.mode.name: round(100 * (r.test_accuracy - reference.test_accuracy), 1) + 0.0
            for r in results if r is not reference}


def format_table(results: Sequence[RunResult]) -> str:
    """The comparison table, then a line of test-accuracy differences against ``fp32``."""
    header = (f"{'mode':<8} {'compute':<29} {'final loss':>10} {'test acc':>8} "
              f"{'skipped':>7} {'final scale':>11} {'ms/step':>7} {'zero grads':>10}")
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.mode.name:<8} {r.mode.description:<29} {r.final_loss:>10.4f} "
            f"{100 * r.test_accuracy:>7.1f}% {r.skipped_steps:>7d} "
            f"{_format_scale(r.final_scale):>11} {1e3 * r.seconds_per_step:>7.2f} "
            f"{100 * r.zero_fraction:>9.1f}%")
    lines.append("-" * len(header))
    if any(r.mode.name == "fp32" for r in results):
        by_name = {r.mode.name: r for r in results}
        gaps = [f"{by_name[name].mode.description} {gap:+.1f} points"
                for name, gap in accuracy_gaps(results).items()]
        lines.append("test accuracy vs float32: " + "; ".join(gaps))
    lines.append("zero grads: fraction of gradient entries that are exactly 0, "
                 "mean over the steps")
    return "\n".join(lines)


_COLORS = {"fp32": "tab:blue", "fp16": "tab:red", "fp16+ls": "tab:green"}


def draw_results(results: Sequence[RunResult], axes: Sequence[Any]) -> None:
    """Draws the three panels on three matplotlib axes: loss, zero gradients, loss scale."""
    ax_loss, ax_zero, ax_scale = axes
    for r in results:
        color = _COLORS.get(r.mode.name)
        label = f"{r.mode.name} (test acc {100 * r.test_accuracy:.1f}%)"
        steps = np.arange(1, len(r.losses) + 1)
        ax_loss.plot(steps, r.losses, color=color, label=label, lw=1.5)
        ax_zero.plot(steps, 100 * r.zero_fractions, color=color, label=r.mode.name, lw=1.5)
    ax_loss.set(title="training loss", xlabel="step", ylabel="cross-entropy", yscale="log")
    ax_loss.legend(fontsize=8)
    ax_zero.set(title="gradient entries that are exactly 0", xlabel="step", ylabel="%",
                ylim=(-3, 100))
    ax_zero.legend(fontsize=8)

    scaled = [r for r in results if r.mode.dynamic]
    for r in scaled:
        steps = np.arange(1, len(r.loss_scales) + 1)
        color = _COLORS.get(r.mode.name)
        ax_scale.step(steps, r.loss_scales, where="post", color=color, label=r.mode.name)
        skipped = ~r.finite
        ax_scale.scatter(steps[skipped], r.loss_scales[skipped], marker="x", color="black",
                         zorder=3, label=f"skipped step ({int(skipped.sum())})")
    ax_scale.set(title="loss scale (fp16+ls)", xlabel="step", ylabel="factor")
    ax_scale.set_yscale("log", base=2)
    if scaled:
        ax_scale.legend(fontsize=8)


def save_figure(results: Sequence[RunResult], path: str | os.PathLike[str]) -> None:
    """Saves the three panels as a PNG at ``path`` (needs matplotlib; no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    draw_results(results, fig.subplots(1, 3))
    fig.suptitle("float16 training: without loss scaling the lower layers get zero "
                 "gradients; with it, float16 matches float32")
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(os.fspath(path), format="png")
