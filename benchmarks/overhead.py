"""Optimizer-step overhead of loss scaling, measured side by side in one process.

Every variant is one jitted step ``(params, opt_state, grads) -> (params, opt_state)``
with params and optimizer state donated (rows marked "not donated" aside: their ratios
are to a bare step that is not donated either), on the same ~40-leaf float32 model. Variants
run interleaved, round after round, so machine noise hits them all alike; the table
reports each one's median time per step as a ratio to a bare ``optax.adam`` step, and the
XLA temp buffer bytes of its compiled step.

    python benchmarks/overhead.py                 # 20M params, the README's CPU table
    python benchmarks/overhead.py --params 4e3 --steps 50   # dispatch-bound: a tiny model
    python benchmarks/overhead.py --params 2e8    # a size that loads a GPU
    python benchmarks/overhead.py --flat          # every leaf 1-D (flattened embeddings,
                                                  # biases): mixed sizes, no matrix
    python benchmarks/overhead.py --equal         # every leaf 1-D and of one size: XLA
                                                  # CPU may share work (and buffers)
                                                  # between leaves of one shape

Each variant is timed two ways: one step per ``block_until_ready`` (a loop that logs every
step) and pipelined (``--steps`` steps, then one block).

Requires ``jmp`` for its row (``pip install -e ".[bench]"``); it is skipped if missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loss_scaling as ls

SCALE = 2.0**15
NOT_DONATED_BASE = "bare optax.adam, not donated"
Step = Callable[[Any, Any, Any], tuple[Any, Any]]


def is_donated(variant: str) -> bool:
    """Every variant donates params and optimizer state unless its name says otherwise."""
    return "not donated" not in variant


def make_params(total: float, leaves: int, seed: int = 0, flat: bool = False,
                equal: bool = False) -> dict[str, jax.Array]:
    """``leaves`` float32 arrays (matrices and vectors, as in an MLP) with ``total`` entries;
    ``flat``: every one 1-D (a model whose embeddings and kernels are stored flattened);
    ``equal``: every one 1-D with ``total / leaves`` entries."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.5, 1.5, leaves)
    weights[1::2] *= 0.05  # every other leaf is bias/norm-sized
    if equal:
        weights[:], flat = 1.0, True
    sizes = np.maximum((weights / weights.sum() * total).astype(int), 1)
    params = {}
    for i, size in enumerate(sizes):
        width = min(1000, int(size))
        shape = (int(size),) if i % 2 or flat else (int(size) // width, width)
        params[f"leaf_{i:02d}"] = jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02)
    return params


# ----------------------------------------------------------------------------- variants


def bare_adam(inner: optax.GradientTransformation) -> tuple[Step, Callable]:
    def step(params, opt_state, grads):
        updates, opt_state = inner.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, inner.init


def loss_scaling_plain(inner, **options) -> tuple[Step, Callable]:
    """The README's plain step: ``tx.update`` then ``optax.apply_updates``."""
    tx = ls.with_loss_scaling(inner, **options)

    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, tx.init


def loss_scaling_fused(inner, **options) -> tuple[Step, Callable]:
    """The README's fused step: ``ls.apply_gradients``."""
    tx = ls.with_loss_scaling(inner, **options)
    return (lambda params, opt_state, grads: ls.apply_gradients(tx, grads, opt_state, params),
            tx.init)


def optax_apply_if_finite(inner) -> tuple[Step, Callable]:
    # Takes true gradients: it does no unscaling of its own.
    return bare_adam(optax.apply_if_finite(inner, max_consecutive_errors=1_000_000))


def jmp_select_tree(inner) -> tuple[Step, Callable] | None:
    try:
        import jmp
    except ImportError:
        return None

    # jmp's state cannot cross a jit boundary as a pytree (its unflatten re-validates and
    # fails on the placeholders `lower` uses), so its leaves travel as plain arrays.
    def init(params):
        return inner.init(params), (jnp.float32(SCALE), jnp.int32(0))

    def step(params, state, grads):
        opt_state, (scale, counter) = state
        loss_scale = jmp.DynamicLossScale(scale, counter)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state),
                                            (params, opt_state))
        return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

    return step, init


def flax_dynamic_scale(inner) -> tuple[Step, Callable]:
    """flax.training.dynamic_scale.DynamicScale's arithmetic and its documented select."""
    from flax.training.dynamic_scale import DynamicScale

    def init(params):
        return inner.init(params), DynamicScale(scale=SCALE)

    def step(params, state, grads):
        opt_state, dyn = state
        # As DynamicScale.value_and_grad does after differentiating:
        grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / dyn.scale, grads)
        finite = jnp.array(True)
        for g in jax.tree.leaves(grads):
            finite &= jnp.all(jax.lax.is_finite(g))
        grow = dyn.fin_steps == dyn.growth_interval
        fin_scale = jnp.where(grow & finite, jnp.minimum(dyn.scale * dyn.growth_factor,
                                                         jnp.finfo(jnp.float32).max), dyn.scale)
        inf_scale = dyn.scale * dyn.backoff_factor
        new_scale = jnp.where(finite, fin_scale, inf_scale)
        new_fin_steps = jnp.where(grow | (~finite), 0, dyn.fin_steps + 1)
        dyn = dyn.replace(scale=new_scale, fin_steps=new_fin_steps)
        # As its docstring's train step does:
        updates, new_opt_state = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        select = lambda new, old: jax.tree.map(  # noqa: E731
            lambda a, b: jnp.where(finite, a, b), new, old)
        return select(new_params, params), (select(new_opt_state, opt_state), dyn)

    return step, init


# ---------------------------------------------------------------------------- measuring


def _time(fn: Any, carry: Any, grads: Any, steps: int, sync_each: bool) -> tuple[float, Any]:
    start = time.perf_counter()
    for _ in range(steps):
        carry = fn(*carry, grads)
        if sync_each:  # a training loop that logs every step
            carry = jax.block_until_ready(carry)
    carry = jax.block_until_ready(carry)
    return (time.perf_counter() - start) / steps, carry


MODES = {"sync": True, "pipelined": False}
"""The two timings: one step per ``block_until_ready``, and pipelined."""


def interleaved(compiled: dict[str, Any], carries: dict[str, Any],
                variants: dict[str, tuple[Any, Any, Any]], rounds: int,
                steps: int) -> dict[str, dict[str, list[float]]]:
    """Per mode and variant, the seconds per step of each round: every variant runs
    ``steps`` steps in turn, round after round, so machine noise hits them all alike."""
    times: dict[str, dict[str, list[float]]] = {m: {n: [] for n in variants} for m in MODES}
    for _ in range(rounds):
        for mode, sync_each in MODES.items():
            for name, (_, _, grads) in variants.items():
                elapsed, carries[name] = _time(compiled[name], carries[name], grads, steps,
                                               sync_each)
                times[mode][name].append(elapsed)
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=20e6, help="total parameter count")
    parser.add_argument("--leaves", type=int, default=40, help="number of parameter arrays")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    parser.add_argument("--flat", action="store_true",
                        help="every leaf 1-D (the second harness of docs/performance.md)")
    parser.add_argument("--equal", action="store_true",
                        help="every leaf 1-D and of one size (params / leaves entries)")
    parser.add_argument("--quick", action="store_true",
                        help="only the default rows and their anchors (for GPU leases)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    params0 = make_params(args.params, args.leaves, flat=args.flat, equal=args.equal)
    n_params = sum(x.size for x in jax.tree.leaves(params0))
    true_grads = jax.tree.map(lambda p: p * 1e-3, params0)
    scaled_grads = jax.tree.map(lambda g: g * SCALE, true_grads)
    bad_grads = dict(scaled_grads)
    first = sorted(bad_grads)[0]
    bad_grads[first] = bad_grads[first].at[(0,) * bad_grads[first].ndim].set(jnp.inf)
    inner = optax.adam(1e-3)

    fused, plain = loss_scaling_fused, loss_scaling_plain
    # Every loss_scaling row but those naming an option runs with DEFAULT settings:
    # `ls.with_loss_scaling(optax.adam(1e-3))`, as the README's snippets build it.
    variants: dict[str, tuple[Step, Callable, Any]] = {
        "bare optax.adam": (*bare_adam(inner), true_grads),
        "fused, default, finite": (*fused(inner), scaled_grads),
        "fused, default, skipped": (*fused(inner), bad_grads),
        "plain, default, finite": (*plain(inner), scaled_grads),
        "plain, default, skipped": (*plain(inner), bad_grads),
        "optax.apply_if_finite": (*optax_apply_if_finite(inner), true_grads),
    }
    if not args.quick:
        variants.update({
            "fused, skip='select', finite": (*fused(inner, skip="select"), scaled_grads),
            "plain, skip='cond', finite": (*plain(inner, skip="cond"), scaled_grads),
            "plain, skip='select', finite": (*plain(inner, skip="select"), scaled_grads),
            "fused, on_failure='raise' (host callback), finite": (
                *fused(inner, on_failure="raise"), scaled_grads),
            "fused, max_consecutive_skips=100, finite": (
                *fused(inner, max_consecutive_skips=100), scaled_grads),
            NOT_DONATED_BASE: (*bare_adam(inner), true_grads),
            "fused, default, finite, not donated": (*fused(inner), scaled_grads),
            "fused, skip='select', finite, not donated": (
                *fused(inner, skip="select"), scaled_grads),
        })
    variants["flax DynamicScale recipe"] = (*flax_dynamic_scale(inner), scaled_grads)
    jmp_variant = jmp_select_tree(inner)
    if jmp_variant is not None:
        variants["jmp select_tree recipe"] = (*jmp_variant, scaled_grads)

    compiled, carries, temp_bytes = {}, {}, {}
    for name, (step, init, grads) in variants.items():
        params = jax.tree.map(jnp.copy, params0)
        opt_state = init(params)
        donate = (0, 1) if is_donated(name) else ()
        fn = jax.jit(step, donate_argnums=donate).lower(params, opt_state, grads).compile()
        temp_bytes[name] = fn.memory_analysis().temp_size_in_bytes
        compiled[name] = fn
        carries[name] = jax.block_until_ready(fn(params, opt_state, grads))  # warm up

    modes = MODES
    times = interleaved(compiled, carries, variants, args.rounds, args.steps)

    def baseline(name: str) -> str:
        return "bare optax.adam" if is_donated(name) else NOT_DONATED_BASE

    base = {m: statistics.median(times[m]["bare optax.adam"]) for m in modes}
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
          f"params={n_params / 1e6:.3f}M leaves={len(params0)}"
          f"{' (all 1-D)' * (args.flat and not args.equal)}{' (1-D, one size)' * args.equal} "
          f"rounds={args.rounds} "
          f"steps/round={args.steps}")
    print(f"bare optax.adam median step: {base['sync'] * 1e3:.3f} ms (block every step), "
          f"{base['pipelined'] * 1e3:.3f} ms (pipelined)")
    print("| variant | block every step | pipelined | XLA temp bytes |\n|---|---:|---:|---:|")
    results = {}
    for name in variants:
        ratios = {m: statistics.median(times[m][name]) / statistics.median(
            times[m][baseline(name)]) for m in modes}
        results[name] = {"ratio_sync": ratios["sync"], "ratio_pipelined": ratios["pipelined"],
                         "temp_bytes": int(temp_bytes[name]),
                         "median_s_sync": statistics.median(times["sync"][name])}
        print(f"| {name} | {ratios['sync']:.2f}x | {ratios['pipelined']:.2f}x | "
              f"{temp_bytes[name] / 2**20:,.2f} MiB |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": jax.default_backend(), "params": int(n_params),
                       "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
