"""Issue 24's run table: four loss-scaling policies on the same training runs, side by side.

The same training, from the same initialisation on the same batches, once per policy:

* ``interval``: ``DynamicLossScale(growth="interval")``, the default rule (double after
  ``growth_interval`` clean steps, halve and skip on an overflow);
* ``headroom``: ``DynamicLossScale(growth="headroom")``, growth from the measured maximum of
  the gradients, its ceiling lifted after the same ``growth_interval``;
* ``interval+replay`` and ``headroom+replay``: the same rules with
  ``with_loss_scaling(..., max_replays=N)``: an overflowed batch is recomputed at the
  backed-off scale inside the step instead of being dropped.

Two models, both float16 compute with float32 params, Adam, a cosine-decayed learning rate:

* ``demo``: ``loss_scaling.demo``'s 8-layer sigmoid MLP on its spirals, full batch (the
  model whose float16 gradients underflow without a loss scale);
* ``lm``: a small causal transformer language model (2 layers, d_model 64, 4 heads, vocab
  64, 32 tokens) on a synthetic Markov chain (each token has 4 likely successors), a fresh
  batch of 32 sequences every step, generated from the seed (no downloads).

Injected faults, the same on every policy. On the ``--spike-steps`` an overflow spike: the
backward pass goes through a float16 intermediate ``--spike`` times the largest parameter
gradient (a custom VJP on the params: a gradient entry ``g`` becomes inf where
``|g| * spike`` passes float16's 65504, and is kept exactly otherwise). The loss is the
batch's ordinary, finite loss and its true gradient is unchanged: the step overflows iff the
scale leaves fewer than ``log2(spike)`` powers of two of room above the largest scaled
gradient, as a real float16 overflow deep in a backward pass does, and a replay at a scale
``spike`` times lower recovers the batch exactly. On the ``--nan-steps`` the loss itself is
NaN (a corrupt batch): nothing can recover that one. Besides these, the rules' own growth
overflows: ``--growth-interval`` is short, so the interval rule grows into an overflow every
few dozen steps.

Per step it records the loss scale after the step, whether the batch was applied, the
replays, the underflow fractions (``underflow_diagnostics=True``: ``zero_grad_fraction``,
entries of the scaled gradients that are exactly zero, and ``small_grad_fraction``, nonzero
but below float16's smallest normal once unscaled) and the loss. Metrics stay on the
device; one transfer at the end of each run. One jitted step per policy.

    python benchmarks/policy_runs.py                      # both models, 300 steps each
    python benchmarks/policy_runs.py --models demo --steps 200 --no-json

Prints a Markdown table and writes ``benchmarks/results/policy_runs.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scaling as ls
from loss_scaling import demo

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "policy_runs.json"
F16 = jnp.float16


# ----------------------------------------------------------------------------- policies


@dataclasses.dataclass(frozen=True)
class Policy:
    """A growth rule and whether an overflowed batch is replayed."""

    name: str
    growth: str    # "interval" or "headroom"
    replay: bool


POLICIES: tuple[Policy, ...] = (
    Policy("interval", "interval", False),
    Policy("headroom", "headroom", False),
    Policy("interval+replay", "interval", True),
    Policy("headroom+replay", "headroom", True),
)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run depends on besides the policy and the model (the CLI's flags)."""

    steps: int = 300
    seed: int = 0
    init_scale: float = 2.0**15
    growth_interval: int = 25
    max_replays: int = 3
    spike: float = 2.0**3
    spike_steps: tuple[int, ...] = (50, 120, 200)
    nan_steps: tuple[int, ...] = (160,)
    headroom_margin: float | None = None   # None: the library's default
    headroom_window: int | None = None     # None: the library's default

    def faults(self) -> tuple[np.ndarray, np.ndarray]:
        """Per step: the overflow spike factor (1 or ``spike``) and the NaN-loss flag."""
        spikes = np.ones(self.steps, np.float32)
        spikes[[s for s in self.spike_steps if s < self.steps]] = self.spike
        nans = np.zeros(self.steps, bool)
        nans[[s for s in self.nan_steps if s < self.steps]] = True
        return spikes, nans


def make_scaler(policy: Policy, config: Config) -> ls.DynamicLossScale:
    """The policy's scaler; the headroom options only for the headroom rule."""
    options: dict[str, Any] = {}
    if policy.growth != "interval":
        options = {"growth": policy.growth, "headroom_margin": config.headroom_margin,
                   "headroom_window": config.headroom_window}
    return ls.DynamicLossScale(init_scale=config.init_scale,
                               growth_interval=config.growth_interval, **options)


def make_optimizer(policy: Policy, config: Config,
                   learning_rate: float) -> optax.GradientTransformationExtraArgs:
    """Adam with a cosine decay, wrapped; a NaN loss skips without touching the scale."""
    replays = {"max_replays": config.max_replays} if policy.replay else {}
    schedule = optax.cosine_decay_schedule(learning_rate, decay_steps=config.steps)
    return ls.with_loss_scaling(optax.adam(schedule), make_scaler(policy, config),
                                underflow_diagnostics=True, nonfinite_loss="skip",
                                **replays)


# ------------------------------------------------------------------------------- models


class Task(NamedTuple):
    """A model and its data: ``loss(params, step)`` is the loss of step ``step``'s batch."""

    name: str
    params: Any
    loss: Callable[[Any, jax.Array], jax.Array]
    learning_rate: float


def demo_task(config: Config) -> Task:
    """loss_scaling.demo's float16 sigmoid MLP on its spirals, full batch every step."""
    x, y = (jnp.asarray(a) for a in demo.make_spirals(demo.NUM_EXAMPLES, seed=config.seed))
    model = demo.MLP(dtype=F16)
    params = model.init(jax.random.key(config.seed), x[:1])["params"]

    def loss(params: Any, step: jax.Array) -> jax.Array:
        del step  # the same (full) batch every step
        return demo._cross_entropy(model, params, x, y)

    return Task("demo", params, loss, demo.LEARNING_RATE)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP, float16."""

    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        width = x.shape[-1]
        h = nn.LayerNorm(dtype=F16, param_dtype=jnp.float32)(x)
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dtype=F16, param_dtype=jnp.float32)(h, h, mask=mask)
        h = nn.LayerNorm(dtype=F16, param_dtype=jnp.float32)(x)
        h = nn.gelu(nn.Dense(4 * width, dtype=F16, param_dtype=jnp.float32)(h))
        return x + nn.Dense(width, dtype=F16, param_dtype=jnp.float32)(h)


class TinyLM(nn.Module):
    """A causal language model: token and position embeddings, blocks, a linear head."""

    vocab: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 2
    length: int = 32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.width, dtype=F16, param_dtype=jnp.float32)(tokens)
        position = self.param("position", nn.initializers.normal(0.02),
                              (self.length, self.width), jnp.float32)
        x = x + position[: tokens.shape[-1]].astype(F16)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.layers):
            x = Block(self.heads)(x, mask)
        x = nn.LayerNorm(dtype=F16, param_dtype=jnp.float32)(x)
        return nn.Dense(self.vocab, dtype=F16, param_dtype=jnp.float32)(x)


def markov_batches(steps: int, *, seed: int, batch: int = 32, length: int = 32,
                   vocab: int = 64, successors: int = 4) -> np.ndarray:
    """``int32 [steps, batch, length]`` token sequences of a fixed sparse Markov chain.

    Each token has ``successors`` possible next tokens with Dirichlet-drawn probabilities:
    the best achievable loss is the chain's entropy rate (about 1 nat), chance is log 64.
    """
    rng = np.random.default_rng([seed, 24])
    table = np.stack([rng.choice(vocab, successors, replace=False) for _ in range(vocab)])
    probs = rng.dirichlet(np.ones(successors), vocab)
    tokens = np.empty((steps * batch, length), np.int32)
    tokens[:, 0] = rng.integers(0, vocab, steps * batch)
    for t in range(1, length):
        u = rng.random(steps * batch)[:, None]
        pick = (u > np.cumsum(probs[tokens[:, t - 1]], axis=1)).sum(axis=1)
        tokens[:, t] = table[tokens[:, t - 1], np.minimum(pick, successors - 1)]
    return tokens.reshape(steps, batch, length)


def lm_task(config: Config) -> Task:
    """TinyLM on the Markov chain, a new batch every step, next-token cross-entropy."""
    # 33 tokens: the model reads 32 and predicts the next one at each position.
    data = jnp.asarray(markov_batches(config.steps, seed=config.seed, length=33))
    model = TinyLM()
    params = model.init(jax.random.key(config.seed), data[0, :, :-1])["params"]

    def loss(params: Any, step: jax.Array) -> jax.Array:
        tokens = data[step]
        logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return Task("lm", params, loss, 3e-3)


TASKS: dict[str, Callable[[Config], Task]] = {"demo": demo_task, "lm": lm_task}


# ------------------------------------------------------------------------------ faults


F16_MAX = float(jnp.finfo(F16).max)


@jax.custom_vjp
def spike_gradient(x: jax.Array, factor: jax.Array) -> jax.Array:
    """``x`` unchanged; in the backward pass its gradient goes through a float16
    intermediate ``factor`` times as large: entries with ``|g| * factor > 65504`` become
    inf, the others are kept exactly (the intermediate divided back by ``factor``)."""
    return x


def _spike_fwd(x: jax.Array, factor: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, factor


def _spike_bwd(factor: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, jax.Array]:
    fits = jnp.abs(cotangent) * factor.astype(cotangent.dtype) <= F16_MAX
    return jnp.where(fits, cotangent, jnp.inf), jnp.zeros_like(factor)


spike_gradient.defvjp(_spike_fwd, _spike_bwd)


def with_faults(task: Task) -> Callable[..., jax.Array]:
    """``task.loss`` with a fault: ``loss(params, step, spike, nan)`` for the step's
    overflow spike factor (1: none) and NaN-loss flag."""

    def loss(params: Any, step: jax.Array, spike: jax.Array, nan: jax.Array) -> jax.Array:
        params = jax.tree.map(lambda p: spike_gradient(p, spike), params)
        return jnp.where(nan, jnp.float32(jnp.nan), task.loss(params, step))

    return loss


# ---------------------------------------------------------------------------- training


class StepRecord(NamedTuple):
    """What one step reports (device arrays, read after the run)."""

    loss: jax.Array            # the unscaled loss of the step's batch (first pass)
    loss_scale: jax.Array      # the scale after the step
    applied: jax.Array         # whether the batch was applied (else dropped)
    replays: jax.Array         # recomputations of this batch at a backed-off scale
    zero_fraction: jax.Array   # fraction of the scaled gradients' entries that are 0
    small_fraction: jax.Array  # nonzero, but below float16's smallest normal unscaled


def make_train_step(loss_fn: Callable[..., jax.Array], tx: optax.GradientTransformationExtraArgs,
                    replay: bool) -> Callable[..., Any]:
    """The jitted step ``(params, opt_state, step, spikes, nans) -> (params, opt_state,
    StepRecord)``; ``spikes`` and ``nans`` are the whole run's fault schedule."""

    @jax.jit
    def train_step(params: Any, opt_state: Any, step: jax.Array, spikes: jax.Array,
                   nans: jax.Array) -> Any:
        def batch_loss(p: Any) -> jax.Array:   # this step's batch, with its fault
            return loss_fn(p, step, spikes[step], nans[step])

        loss, grads = ls.value_and_grad(batch_loss)(opt_state, params)   # SCALED grads
        replay_args = {"value_fn": batch_loss} if replay else {}
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params, loss=loss,
                                               **replay_args)
        m = ls.metrics(opt_state)
        return params, opt_state, StepRecord(
            loss, m["loss_scale"], m["last_step_applied"], m["last_step_replays"],
            m["zero_grad_fraction"], m["small_grad_fraction"])

    return train_step


_STEPS: dict[tuple[Any, ...], Any] = {}


def _step_key(task: Task, policy: Policy, config: Config) -> tuple[Any, ...]:
    return (task.name, config.seed, config.steps, policy, config.growth_interval,
            config.max_replays, config.headroom_margin, config.headroom_window)


def _initial(task: Task, policy: Policy, config: Config) -> tuple[Any, ...]:
    """A run's first arguments: fresh params, the optimizer state, step 0, the faults."""
    params = jax.tree.map(jnp.array, task.params)   # a fresh copy per run
    opt_state = make_optimizer(policy, config, task.learning_rate).init(params)
    spikes, nans = (jnp.asarray(a) for a in config.faults())
    return params, opt_state, jnp.int32(0), spikes, nans


def compile_steps(task: Task, policies: Sequence[Policy], config: Config) -> None:
    """Compiles the policies' steps, each once per process for everything it depends on
    (runs that differ only in ``init_scale`` or in the fault schedule share one: the
    update reads the scale from the state, the schedule is an argument). XLA compiles
    them in parallel threads; tracing stays in this one."""
    todo = {}
    for policy in policies:
        key = _step_key(task, policy, config)
        if key not in _STEPS and key not in todo:
            tx = make_optimizer(policy, config, task.learning_rate)
            step = make_train_step(with_faults(task), tx, policy.replay)
            todo[key] = step.lower(*_initial(task, policy, config))
    workers = max(1, min(len(todo), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        compiled = pool.map(lambda lowered: lowered.compile(), todo.values())
        _STEPS.update(zip(todo, compiled, strict=True))


@dataclasses.dataclass
class Run:
    """One policy's run on one model: per-step arrays (one entry per step) and timing."""

    model: str
    policy: str
    losses: np.ndarray
    loss_scales: np.ndarray
    applied: np.ndarray
    replays: np.ndarray
    zero_fractions: np.ndarray
    small_fractions: np.ndarray
    spike_steps: tuple[int, ...]
    nan_steps: tuple[int, ...]
    seconds: float

    def summary(self, common: np.ndarray | None = None) -> dict[str, Any]:
        """The table's row: see :func:`summarize`."""
        return summarize(self, common)


def train(task: Task, policy: Policy, config: Config) -> Run:
    """Trains ``task`` for ``config.steps`` steps under ``policy``; one read at the end."""
    compile_steps(task, [policy], config)
    train_step = _STEPS[_step_key(task, policy, config)]
    params, opt_state, _, spikes, nans = _initial(task, policy, config)
    start = time.perf_counter()
    records = []
    for step in range(config.steps):
        params, opt_state, record = train_step(params, opt_state, jnp.int32(step), spikes,
                                               nans)
        records.append(record)
    history = jax.device_get(records)
    seconds = time.perf_counter() - start
    column = {name: np.array([getattr(r, name) for r in history])
              for name in StepRecord._fields}
    return Run(task.name, policy.name, column["loss"].astype(np.float32),
               column["loss_scale"].astype(np.float32), column["applied"].astype(bool),
               column["replays"].astype(np.int32), column["zero_fraction"].astype(np.float32),
               column["small_fraction"].astype(np.float32),
               tuple(s for s in config.spike_steps if s < config.steps),
               tuple(s for s in config.nan_steps if s < config.steps), seconds)


def summarize(run: Run, common: np.ndarray | None = None) -> dict[str, Any]:
    """Batches dropped, overflowed first passes (injected and the rule's own), replays,
    the final scale, the mean underflow fractions, the final loss.

    A step *overflowed* when its first pass had non-finite gradients and a finite loss:
    skipped without replay, replayed (and applied, or dropped once the replays ran out)
    with it. The underflow fractions are averaged over the steps in ``common`` (a bool
    mask; default: the run's applied steps), which :func:`table_rows` sets to the steps
    that every run of the model applied: a fraction is only measured on an applied step,
    and part of it depends on the batch (parameters that a batch does not reach), so runs
    are compared on the same batches. The final loss is the mean of the last 10 steps'
    finite losses.
    """
    common = run.applied if common is None else common & run.applied
    finite_loss = np.isfinite(run.losses)
    overflowed = finite_loss & (~run.applied | (run.replays > 0))
    injected = np.zeros_like(overflowed)
    injected[list(run.spike_steps)] = True
    dropped = np.flatnonzero(~run.applied)
    tail = run.losses[-10:]
    return {
        "model": run.model,
        "policy": run.policy,
        "batches_dropped": int(dropped.size),
        "dropped_with_finite_loss": int((~run.applied & finite_loss).sum()),
        "dropped_steps": dropped.tolist(),
        "overflowed_steps": int(overflowed.sum()),
        "injected_overflows": int((overflowed & injected).sum()),
        "growth_overflows": int((overflowed & ~injected).sum()),
        "replays": int(run.replays.sum()),
        "final_scale": float(run.loss_scales[-1]),
        "mean_zero_fraction": float(run.zero_fractions[common].mean()),
        "mean_small_fraction": float(run.small_fractions[common].mean()),
        "final_loss": float(tail[np.isfinite(tail)].mean()),
        "seconds": round(run.seconds, 2),
    }


def table_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per run, the underflow averaged over the steps all runs of its model applied."""
    common: dict[str, np.ndarray] = {}
    for run in runs:
        common[run.model] = common.get(run.model, run.applied) & run.applied
    return [run.summary(common[run.model]) for run in runs]


def run_all(models: Sequence[str] = ("demo", "lm"), policies: Sequence[Policy] = POLICIES,
            config: Config = Config()) -> list[Run]:
    """Every policy on every model, one after the other in this process (their steps
    compiled first, in parallel)."""
    runs = []
    for name in models:
        task = TASKS[name](config)
        compile_steps(task, policies, config)
        runs.extend(train(task, policy, config) for policy in policies)
    return runs


# ------------------------------------------------------------------------------ output


COLUMNS = (
    ("model", "model", "{}"),
    ("policy", "policy", "{}"),
    ("batches_dropped", "batches dropped", "{}"),
    ("overflowed_steps", "overflowed steps (injected + growth)", None),
    ("replays", "replays", "{}"),
    ("final_scale", "final scale", "2^{:.0f}"),
    ("mean_zero_fraction", "mean underflow", "{:.2e}"),
    ("final_loss", "final loss", "{:.4f}"),
)


def _cell(row: dict[str, Any], key: str, fmt: str | None) -> str:
    if key == "overflowed_steps":
        return f"{row[key]} ({row['injected_overflows']} + {row['growth_overflows']})"
    if key == "final_scale":
        return fmt.format(np.log2(row[key])) if fmt else str(row[key])
    return (fmt or "{}").format(row[key])


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The run table in Markdown, one row per (model, policy)."""
    lines = ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row, key, fmt) for key, _, fmt in COLUMNS) + " |"
              for row in rows]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(TASKS), default=["demo", "lm"])
    parser.add_argument("--policies", nargs="+", choices=[p.name for p in POLICIES],
                        default=[p.name for p in POLICIES])
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--init-scale", type=float, default=defaults.init_scale)
    parser.add_argument("--growth-interval", type=int, default=defaults.growth_interval)
    parser.add_argument("--max-replays", type=int, default=defaults.max_replays)
    parser.add_argument("--spike", type=float, default=defaults.spike,
                        help="the factor of the injected overflow spikes (see above)")
    parser.add_argument("--spike-steps", type=int, nargs="*", default=defaults.spike_steps)
    parser.add_argument("--nan-steps", type=int, nargs="*", default=defaults.nan_steps)
    parser.add_argument("--headroom-margin", type=float, default=None)
    parser.add_argument("--headroom-window", type=int, default=None)
    parser.add_argument("--json", default=str(RESULTS), help="where to write the JSON")
    parser.add_argument("--no-json", action="store_true", help="write no JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the table; ``argv`` as for the command line."""
    args = _parser().parse_args(argv)
    config = Config(steps=args.steps, seed=args.seed, init_scale=args.init_scale,
                    growth_interval=args.growth_interval,
                    max_replays=args.max_replays, spike=args.spike,
                    spike_steps=tuple(args.spike_steps), nan_steps=tuple(args.nan_steps),
                    headroom_margin=args.headroom_margin,
                    headroom_window=args.headroom_window)
    policies = [p for p in POLICIES if p.name in args.policies]
    rows = table_rows(run_all(args.models, policies, config))
    print(markdown_table(rows))
    if not args.no_json:
        out = pathlib.Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": "python benchmarks/policy_runs.py " + " ".join(sys.argv[1:]
                                                                             if argv is None
                                                                             else argv),
                  "date": datetime.date.today().isoformat(), "jax": jax.__version__,
                  "backend": jax.default_backend(),
                  "config": dataclasses.asdict(config), "runs": rows}
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
