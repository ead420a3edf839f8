"""Compile time of one optimizer step with loss scaling, against a bare step, side by side.

Each variant is one jitted step ``(params, opt_state, grads) -> (params, opt_state)`` over
``--leaves`` float32 leaves of shape 16x33 with Adam, params and optimizer state donated.
Variants are compiled interleaved, round after round, with ``jax.clear_caches()`` before
every compile, so machine noise hits them all alike; the table gives the median seconds of
tracing + lowering, of XLA's compile, and of both, and the ratio of the total to bare Adam's
(the plain step is also compared with ``optax.apply_if_finite``, the plain contract's
nearest relative).

    python benchmarks/compile_time.py                        # 200, 1000 and 2000 leaves
    python benchmarks/compile_time.py --leaves 200 --rounds 5
    python benchmarks/compile_time.py --leaves 200 1000 --floors  # the minimal guards too
    python benchmarks/compile_time.py --leaves 200 --parts        # what two parts cost

``--parts`` measures the plain step with two of its parts taken out (monkeypatched while it
is traced, so not a usable step): the exact re-check branch that runs when the sum screen
fails, and the state bookkeeping after the step (the scale's update rule, the counters,
the failure register, the per-leaf flags): what each costs to compile.

``--floors`` adds the least a guarded step can be, written by hand: one sum-of-squares
screen of all the gradients concatenated and one ``lax.cond`` around bare Adam, then the
same with the gradients unscaled inside the branch by one multiply per leaf, and by two
(the exact reciprocal of ``loss_scaling.core.numerics``: ``normal * post``). They bound
from below what any loss-scaling wrapper compiles in: no per-leaf flags, no state.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import loss_scaling as ls

Step = Callable[[Any, Any, Any], tuple[Any, Any]]


def variants(inner: optax.GradientTransformation, floors: bool = False,
             parts: bool = False) -> dict[str, tuple[Step, Callable]]:
    def bare(params, opt_state, grads):
        updates, opt_state = inner.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    tx = ls.with_loss_scaling(inner)

    def fused(params, opt_state, grads):
        return ls.apply_gradients(tx, grads, opt_state, params)

    def plain(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    guarded = optax.apply_if_finite(inner, max_consecutive_errors=10**6)

    def if_finite(params, opt_state, grads):
        updates, opt_state = guarded.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    table = {"bare optax.adam": (bare, inner.init),
            "fused (ls.apply_gradients)": (fused, tx.init),
            "plain (tx.update + apply_updates)": (plain, tx.init),
            "optax.apply_if_finite": (if_finite, guarded.init)}
    if floors:
        table.update({name: (floor(factors), inner.init) for name, factors in
                      [("floor: screen + cond", 0), ("floor + unscale (1 multiply)", 1),
                       ("floor + unscale (2 multiplies)", 2)]})
    if parts:
        table.update({name: (without(*taken), tx.init) for name, taken in
                      [("plain without the exact branch", (True, False)),
                       ("plain without the bookkeeping", (False, True)),
                       ("plain without both", (True, True))]})
    return table


def without(exact_branch: bool, bookkeeping: bool) -> Step:
    """The plain step with the exact re-check branch and/or the state bookkeeping taken
    out while it is traced: an ablation, not a correct step."""
    from loss_scaling.core import numerics
    from loss_scaling.wrapper import transform

    tx = ls.with_loss_scaling(optax.adam(1e-3))

    def no_exact_branch(leaves, *_):
        return jnp.zeros((len(leaves),), jnp.bool_), jnp.asarray(False)

    def no_bookkeeping(options, state, inner_state, decision, loss_given=False):
        return state._replace(inner_state=inner_state, consecutive_skips=(~decision.apply).astype(
            state.consecutive_skips.dtype))

    def step(params, opt_state, grads):
        saved = numerics._exact_flags, transform._next_state
        if exact_branch:
            numerics._exact_flags = no_exact_branch
        if bookkeeping:
            transform._next_state = no_bookkeeping
        try:
            updates, opt_state = tx.update(grads, opt_state, params)
        finally:
            numerics._exact_flags, transform._next_state = saved
        return optax.apply_updates(params, updates), opt_state

    return step


def floor(factors: int) -> Step:
    """The minimal guarded Adam step: one screen, one cond, ``factors`` multiplies per leaf
    (by scalars read from the gradients, so XLA cannot fold them)."""
    inner = optax.adam(1e-3)

    def step(params, opt_state, grads):
        leaves = jax.tree.leaves(grads)
        joined = jax.lax.optimization_barrier(jnp.concatenate([g.ravel() for g in leaves]))
        finite = jnp.isfinite(jnp.sum(jnp.square(joined)))
        scalars = [1.0 / leaves[0][0, i] for i in range(factors)]

        def apply(operands):
            params, opt_state, grads = operands
            for x in scalars:
                grads = jax.tree.map(lambda g, x=x: g * x, grads)
            updates, opt_state = inner.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return jax.lax.cond(finite, apply, lambda ops: (ops[0], ops[1]),
                            (params, opt_state, grads))

    return step


def compile_once(step: Step, init: Callable, params: Any) -> tuple[float, float]:
    """Seconds to trace and lower, and to compile, with every JAX cache cleared first."""
    jax.clear_caches()
    opt_state = jax.eval_shape(init, params)
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, params)
    traced = time.perf_counter()
    lowered.compile()
    return traced - start, time.perf_counter() - traced


def measure(leaves: int, rounds: int, floors: bool = False,
            parts: bool = False) -> dict[str, list[tuple[float, float]]]:
    params = {f"leaf_{i:04d}": jax.ShapeDtypeStruct((16, 33), jnp.float32)
              for i in range(leaves)}
    table = variants(optax.adam(1e-3), floors, parts)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in table}
    for _ in range(rounds):
        for name, (step, init) in table.items():
            times[name].append(compile_once(step, init, params))
    return times


def report(leaves: int, times: dict[str, list[tuple[float, float]]]) -> str:
    total = {name: statistics.median(t + c for t, c in runs) for name, runs in times.items()}
    base = total["bare optax.adam"]
    lines = [f"{leaves} leaves of 16x33, Adam, donated; median of {len(times[next(iter(times))])}"
             " compiles, jax.clear_caches() before each",
             f"{'variant':36s} {'trace+lower s':>13s} {'compile s':>10s} {'total s':>8s} "
             f"{'/ bare':>7s} {'/ if_finite':>11s}"]
    for name, runs in times.items():
        trace = statistics.median(t for t, _ in runs)
        comp = statistics.median(c for _, c in runs)
        if_finite = total[name] / total["optax.apply_if_finite"]
        lines.append(f"{name:36s} {trace:13.2f} {comp:10.2f} {total[name]:8.2f} "
                     f"{total[name] / base:7.2f} {if_finite:11.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[200, 1000, 2000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", action="store_true",
                        help="also the plain step without two of its parts (an ablation)")
    parser.add_argument("--floors", action="store_true",
                        help="also the minimal hand-written guarded steps")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    for leaves in args.leaves:
        print(report(leaves, measure(leaves, args.rounds, args.floors, args.parts)),
              flush=True)
        print()


if __name__ == "__main__":
    main()
