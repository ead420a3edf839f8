"""The demo: float16 training that fails without loss scaling and matches float32 with it.

``python -m loss_scaling.demo`` trains the same small flax model on the same data four
times, changing only the compute precision and the loss scale:

* ``fp32``: float32 compute (``NoOpLossScale``), the reference;
* ``fp16``: float16 compute, float32 master weights, no loss scaling (``NoOpLossScale``);
* ``fp16+ls``: the same float16 compute with ``DynamicLossScale``;
* ``autocast``: the float32 model (no ``dtype=``) under ``ls.autocast``, which runs its
  matmuls in float16, with ``DynamicLossScale``: mixed precision without a hand-cast model.

The model is a textbook vanishing-gradient network: 8 sigmoid layers of width 32 with
flax's default (LeCun normal) initialisation. A sigmoid's slope is at most 1/4, so the
backward signal shrinks by about 10x per layer; with a loss that is a mean over 4096
examples, each example's contribution to the gradient of the lower layers is around
1e-10, far below float16's smallest subnormal (6e-8). In float16 without scaling those
entries flush to exactly zero, the lower layers never learn, and training stalls at
chance. Adam rescales tiny but nonzero gradients, so float32 trains normally, and so does
float16 once the loss scale lifts the gradients into range.

Everything is generated deterministically from ``--seed`` (no downloads). tqdm and
matplotlib (``pip install "loss-scaling[demo]"``) are optional: without them the progress
bar is plain text and the PNG of the curves is skipped with a message.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scaling as ls

__all__ = ["MODES", "MLP", "Mode", "RunResult", "accuracy_gaps", "draw_results", "evaluate",
           "format_table", "main", "make_optimizer", "make_spirals", "make_train_step", "run",
           "save_figure", "train"]

DEFAULT_STEPS = 1000
DEFAULT_SEED = 0
DEFAULT_OUT = "demo_out/loss_scaling_demo.png"  # demo_out/ is in .gitignore

NUM_EXAMPLES = 4096  # training set = one full batch; the loss is the mean over it
NUM_CLASSES = 3
DEPTH = 8
WIDTH = 32
LEARNING_RATE = 1e-2
GROWTH_INTERVAL = 100  # not the default 2000, so that a short run shows the scale adapting


# ----------------------------------------------------------------------------- data


def make_spirals(n: int, *, seed: int, split: int = 0, classes: int = NUM_CLASSES,
                 turns: float = 0.75, noise: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """Interleaved noisy spiral arms in 2-D, one per class: ``(x float32 [n, 2], y int32 [n])``.

    Deterministic in ``(seed, split)``; use ``split=0`` for training, ``1`` for testing.

    Examples:
      >>> x, y = make_spirals(5, seed=0)
      >>> x.shape, x.dtype, y.shape, y.dtype
      ((5, 2), dtype('float32'), (5,), dtype('int32'))
      >>> bool((make_spirals(5, seed=0)[0] == x).all())
      True
    """
    rng = np.random.default_rng([seed, split])
    labels = rng.integers(0, classes, n)
    radius = np.sqrt(rng.uniform(0.0, 1.0, n))  # uniform over the disc
    angle = 2 * np.pi * (turns * radius + labels / classes)
    points = 2.0 * radius[:, None] * np.stack([np.cos(angle), np.sin(angle)], axis=1)
    points += noise * rng.normal(size=points.shape)
    return points.astype(np.float32), labels.astype(np.int32)


# ---------------------------------------------------------------------------- model


class MLP(nn.Module):
    """A deep, narrow sigmoid MLP; ``dtype`` is the compute dtype, parameters stay float32."""

    depth: int = DEPTH
    width: int = WIDTH
    classes: int = NUM_CLASSES
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        for _ in range(self.depth):
            x = nn.sigmoid(nn.Dense(self.width, dtype=self.dtype, param_dtype=jnp.float32)(x))
        return nn.Dense(self.classes, dtype=self.dtype, param_dtype=jnp.float32)(x)


@dataclasses.dataclass(frozen=True)
class Mode:
    """One of the runs: a name, the model's dtype and a loss scale; ``autocast``: the
    model's forward pass runs under ``ls.autocast`` (float16 matmuls)."""

    name: str
    description: str
    dtype: Any
    make_scaler: Callable[[], ls.LossScale]
    autocast: bool = False


MODES: tuple[Mode, ...] = (
    Mode("fp32", "float32", jnp.float32, ls.NoOpLossScale),
    Mode("fp16", "float16 without loss scaling", jnp.float16, ls.NoOpLossScale),
    Mode("fp16+ls", "float16 with DynamicLossScale", jnp.float16,
         lambda: ls.DynamicLossScale(growth_interval=GROWTH_INTERVAL)),
    Mode("autocast", "float32 model + ls.autocast + loss scaling", jnp.float32,
         lambda: ls.DynamicLossScale(growth_interval=GROWTH_INTERVAL), autocast=True),
)


def make_optimizer(mode: Mode, steps: int) -> optax.GradientTransformationExtraArgs:
    """Adam with a cosine-decayed learning rate, wrapped in ``with_loss_scaling``.

    Every mode uses the wrapper; only the scaler differs (``NoOpLossScale`` is the
    identity), so the comparison changes nothing but the precision and the scale. The
    wrapper's underflow statistics report the fraction of gradient entries that are zero.
    """
    schedule = optax.cosine_decay_schedule(LEARNING_RATE, decay_steps=max(steps, 1))
    return ls.with_loss_scaling(optax.adam(schedule), mode.make_scaler(),
                                underflow_diagnostics=True)


# ------------------------------------------------------------------------- training


class StepStats(NamedTuple):
    """What one train step reports (device arrays; read them after the run)."""

    loss: jax.Array           # the unscaled loss, float32
    loss_scale: jax.Array     # the factor that scaled this step's loss
    finite: jax.Array         # whether this step's gradients were finite (else skipped)
    zero_fraction: jax.Array  # fraction of gradient entries that are exactly zero


def _apply(model: MLP, params: Any, x: jax.Array, autocast: bool = False) -> jax.Array:
    apply = ls.autocast(model.apply) if autocast else model.apply
    return cast(jax.Array, apply({"params": params}, x))


def _cross_entropy(model: MLP, params: Any, x: jax.Array, y: jax.Array,
                   autocast: bool = False) -> jax.Array:
    logits = _apply(model, params, x, autocast)
    # The loss itself in float32, as mixed precision recipes do.
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def make_train_step(model: MLP, tx: optax.GradientTransformationExtraArgs, *,
                    autocast: bool = False) -> Callable[..., Any]:
    """The jit-compiled step ``(params, opt_state, x, y) -> (params, opt_state, StepStats)``:
    ``ls.value_and_grad`` differentiates the scaled loss, ``ls.apply_gradients`` unscales,
    checks, skips or steps and updates the scale. ``autocast``: the model runs under
    ``ls.autocast``."""
    grad_fn = ls.value_and_grad(lambda p, x, y: _cross_entropy(model, p, x, y, autocast))

    @jax.jit
    def train_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        scaler = ls.get_loss_scale(opt_state)
        loss, grads = grad_fn(scaler, params, x, y)        # grads of the *scaled* loss
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
        metrics = ls.metrics(opt_state)         # in-graph: no host sync
        return params, opt_state, StepStats(loss, scaler.loss_scale,
                                            metrics["last_step_applied"],
                                            metrics["zero_grad_fraction"])

    return train_step


def evaluate(model: MLP, params: Any, x: Any, y: Any, *,
             autocast: bool = False) -> tuple[float, float]:
    """``(mean cross-entropy, accuracy in [0, 1])`` of ``model`` at ``params`` on ``(x, y)``
    (``autocast``: run under ``ls.autocast``, as trained)."""

    @jax.jit
    def loss_and_accuracy(params: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
        logits = _apply(model, params, x, autocast)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return loss.mean(), (jnp.argmax(logits, -1) == y).mean()

    loss, accuracy = loss_and_accuracy(params, jnp.asarray(x), jnp.asarray(y))
    return float(loss), float(accuracy)


@dataclasses.dataclass
class RunResult:
    """The outcome of one mode's run; per-step arrays have one entry per step."""

    mode: Mode
    losses: np.ndarray          # float32 [steps]: the training loss at each step
    loss_scales: np.ndarray     # float32 [steps]: the factor used at each step
    finite: np.ndarray          # bool [steps]: False where the step was skipped
    zero_fractions: np.ndarray  # float32 [steps]
    test_loss: float
    test_accuracy: float        # in [0, 1]
    final_scale: float
    skipped_steps: int
    seconds_per_step: float     # after compilation
    compile_seconds: float      # the first step (tracing, compiling, running)
    params: Any = dataclasses.field(repr=False, default=None)

    @property
    def final_loss(self) -> float:
        return float(self.losses[-1])

    @property
    def zero_fraction(self) -> float:
        """Mean over the run of the fraction of gradient entries that are exactly zero."""
        return float(self.zero_fractions.mean())


def _train_and_test_data(seed: int) -> tuple[Any, ...]:
    return (*make_spirals(NUM_EXAMPLES, seed=seed, split=0),
            *make_spirals(NUM_EXAMPLES, seed=seed, split=1))


def train(mode: Mode, *, steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED,
          progress: bool = True, data: tuple[Any, Any, Any, Any] | None = None) -> RunResult:
    """Trains the model in one mode, full batch, for ``steps`` steps; returns a RunResult.

    Args:
      mode: one of :data:`MODES`.
      steps: number of optimizer steps (skipped ones included).
      seed: seeds the data and the initialisation (identical across modes).
      progress: show a progress bar on stderr.
      data: ``(x_train, y_train, x_test, y_test)``; generated from ``seed`` if omitted.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}.")
    x_train, y_train, x_test, y_test = map(jnp.asarray, data or _train_and_test_data(seed))
    model = MLP(dtype=mode.dtype)
    params = model.init(jax.random.key(seed), x_train[:1])["params"]
    tx = make_optimizer(mode, steps)
    opt_state = tx.init(params)
    train_step = make_train_step(model, tx, autocast=mode.autocast)

    bar = _progress_bar(steps, f"{mode.name:>7}") if progress else None
    start = time.perf_counter()
    params, opt_state, first = train_step(params, opt_state, x_train, y_train)
    jax.block_until_ready(first)
    compile_seconds = time.perf_counter() - start
    stats: list[StepStats] = [first]
    if bar is not None:
        bar.update(1)
    start = time.perf_counter()
    for done in range(2, steps + 1):
        params, opt_state, step_stats = train_step(params, opt_state, x_train, y_train)
        stats.append(step_stats)
        if bar is not None and (done % 25 == 0 or done == steps):
            # Reading the loss waits for the step: the bar shows real progress.
            bar.set_postfix_str(f"loss {float(step_stats.loss):.3f} "
                                f"scale {float(step_stats.loss_scale):g}", refresh=False)
            bar.update(done - bar.n)
    jax.block_until_ready(params)
    seconds_per_step = (time.perf_counter() - start) / max(steps - 1, 1)
    if bar is not None:
        bar.close()

    history = jax.device_get(stats)
    test_loss, test_accuracy = evaluate(model, params, x_test, y_test, autocast=mode.autocast)
    summary = ls.metrics(opt_state)
    return RunResult(
        mode=mode,
        losses=np.array([s.loss for s in history], np.float32),
        loss_scales=np.array([s.loss_scale for s in history], np.float32),
        finite=np.array([s.finite for s in history], bool),
        zero_fractions=np.array([s.zero_fraction for s in history], np.float32),
        test_loss=test_loss, test_accuracy=test_accuracy,
        final_scale=float(summary["loss_scale"]), skipped_steps=int(summary["skipped_steps"]),
        seconds_per_step=seconds_per_step if steps > 1 else compile_seconds,
        compile_seconds=compile_seconds, params=params)


def run(steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED, progress: bool = True,
        modes: Sequence[Mode] = MODES) -> list[RunResult]:
    """Trains every mode on the same data from the same initialisation."""
    data = _train_and_test_data(seed)
    return [train(mode, steps=steps, seed=seed, progress=progress, data=data) for mode in modes]


# --------------------------------------------------------------------------- output


class _TextBar:
    """A minimal stand-in for ``tqdm`` (used when it is not installed)."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
        self.start = time.perf_counter()

    def update(self, n: int = 1, end: str = "") -> None:
        self.n += n
        done = int(30 * self.n / max(self.total, 1))
        sys.stderr.write(f"\r{self.desc}: [{'#' * done}{'.' * (30 - done)}] "
                         f"{self.n}/{self.total} {time.perf_counter() - self.start:5.1f}s "
                         f"{self.postfix}{end}")
        sys.stderr.flush()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        self.update(0, end="\n")


def _progress_bar(total: int, desc: str) -> Any:
    """tqdm's bar on stderr, or :class:`_TextBar` without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _TextBar(total, desc)
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)


def accuracy_gaps(results: Sequence[RunResult]) -> dict[str, float]:
    """Test accuracy of each mode minus that of ``fp32``, in points (percent)."""
    reference = {r.mode.name: r for r in results}["fp32"]
    return {r.mode.name: round(100 * (r.test_accuracy - reference.test_accuracy), 1) + 0.0
            for r in results if r is not reference}


def format_table(results: Sequence[RunResult]) -> str:
    """The comparison table, then a line of test-accuracy differences against ``fp32``."""
    width = max([len("compute"), *(len(r.mode.description) for r in results)])
    header = (f"{'mode':<8} {'compute':<{width}} {'final loss':>10} {'test acc':>8} "
              f"{'skipped':>7} {'final scale':>11} {'ms/step':>7} {'zero grads':>10}")
    lines = [header, "-" * len(header)]
    for r in results:
        exponent = float(np.log2(r.final_scale))  # a power of two shows as 2^k
        scale = f"2^{exponent:g}" if exponent.is_integer() and exponent else f"{r.final_scale:g}"
        lines.append(
            f"{r.mode.name:<8} {r.mode.description:<{width}} {r.final_loss:>10.4f} "
            f"{100 * r.test_accuracy:>7.1f}% {r.skipped_steps:>7d} "
            f"{scale:>11} {1e3 * r.seconds_per_step:>7.2f} "
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


_COLORS = {"fp32": "tab:blue", "fp16": "tab:red", "fp16+ls": "tab:green",
           "autocast": "tab:purple"}


def draw_results(results: Sequence[RunResult], axes: Sequence[Any]) -> None:
    """Draws the three panels on three matplotlib axes: loss, zero gradients, loss scale
    (of the runs with a dynamic scale)."""
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

    scaled = [r for r in results if isinstance(r.mode.make_scaler(), ls.DynamicLossScale)]
    for r in scaled:
        steps = np.arange(1, len(r.loss_scales) + 1)
        color = _COLORS.get(r.mode.name)
        ax_scale.step(steps, r.loss_scales, where="post", color=color, label=r.mode.name)
        skipped = ~r.finite
        ax_scale.scatter(steps[skipped], r.loss_scales[skipped], marker="x", color=color,
                         zorder=3, label=f"{r.mode.name} skipped step ({int(skipped.sum())})")
    ax_scale.set(title="loss scale", xlabel="step", ylabel="factor")
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
                 "gradients; with it, float16 matches float32, hand-cast or autocast")
    directory = os.path.dirname(os.fspath(path))
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(os.fspath(path), format="png")


# ------------------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loss_scaling.demo", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a deep sigmoid MLP on generated 3-class spirals four times: "
        "float32; float16 compute without loss scaling; float16 compute with "
        "loss_scaling.DynamicLossScale; the float32 model under loss_scaling.autocast with "
        "DynamicLossScale. Prints a comparison table and saves a PNG of the loss curves and "
        "the loss scale over time.")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help="optimizer steps per mode (full batch of "
                             f"{NUM_EXAMPLES} examples; the learning rate decays to 0 over them)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help="seed of the generated data and of the initialisation")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="where to save the PNG (loss curves, zero gradients, loss scale); "
                             "missing folders are created")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; ``argv`` as for the command line (``None``: ``sys.argv[1:]``)."""
    args = _parser().parse_args(argv)
    if args.steps < 1:
        _parser().error(f"--steps must be at least 1, got {args.steps}")
    print(f"A sigmoid MLP ({DEPTH} layers of width {WIDTH}) on {NUM_EXAMPLES} generated spiral "
          f"points, Adam, full batch: {args.steps} steps in each of {len(MODES)} modes "
          f"(seed {args.seed}, jax {jax.__version__} on {jax.default_backend()}).", flush=True)
    start = time.perf_counter()
    results = run(steps=args.steps, seed=args.seed, progress=not args.no_progress)
    print("\n" + format_table(results))
    print(f"\ntotal time {time.perf_counter() - start:.1f}s")
    try:
        save_figure(results, args.out)
    except ImportError:
        print("matplotlib is not installed: no picture. Install it with "
              "`pip install \"loss-scaling[demo]\"`.")
    else:
        print(f"saved the picture to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
