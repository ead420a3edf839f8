"""flax nnx optimizer-step overhead of loss scaling, measured side by side in one process.

The model of ``benchmarks/overhead.py`` (~40 float32 leaves, 20M params by default) as an
``nnx.Module`` of ``nnx.Param``s. Each variant is one ``optimizer.update(model, grads)``
step, compiled the way the flax performance guide recommends for a hot loop:
``nnx.split`` once, then a ``jax.jit`` step that merges, updates and returns the state,
with the state donated. Rows:

* ``bare nnx.Optimizer(adam)``: the baseline, no loss scaling;
* ``ls.nnx.Optimizer`` with ``ls.with_loss_scaling(optax.adam(1e-3))`` at DEFAULT
  settings (the fused step), on finite and on overflowing gradients;
* the same wrapper in a plain ``nnx.Optimizer`` (the plain path), for comparison;
* the same two steps without nnx (``optax.adam`` and ``ls.apply_gradients`` on the params
  dict, as in ``benchmarks/overhead.py``): what the nnx layer itself costs;
* the README's step: ``@nnx.jit(donate_argnums=(0, 1))`` on ``(model, optimizer, grads)``,
  bare and fused, and both again without donation. These rows' ratios are to the bare step
  compiled the same way (``nnx.jit`` adds its own Python work per call).

Variants run interleaved, round after round; each is timed with one step per
``block_until_ready`` and pipelined (``--steps`` steps, then one block). Ratios are medians
over rounds, against the bare step timed the same way.

    python benchmarks/nnx_overhead.py              # 20M params, the README's nnx row
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
from flax import nnx

import loss_scaling as ls

SCALE = 2.0**15


def make_params(total: float, leaves: int, seed: int = 0) -> dict[str, np.ndarray]:
    """As in benchmarks/overhead.py: matrices and vectors with ``total`` entries."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.5, 1.5, leaves)
    weights[1::2] *= 0.05  # every other leaf is bias/norm-sized
    sizes = np.maximum((weights / weights.sum() * total).astype(int), 1)
    params = {}
    for i, size in enumerate(sizes):
        shape = (int(size),) if i % 2 else (int(size) // 1000 or 1, 1000)
        params[f"leaf_{i:02d}"] = rng.standard_normal(shape, np.float32) * 0.02
    return params


class Model(nnx.Module):
    """One ``nnx.Param`` per array of ``params``."""

    def __init__(self, params: dict[str, np.ndarray]) -> None:
        for name, value in params.items():
            setattr(self, name, nnx.Param(jnp.asarray(value)))


def make_variant(params: dict[str, np.ndarray], optimizer_cls: type, tx: Any,
                 grads_scale: float, poison: bool) -> tuple[Callable, Any, Any, int]:
    model = Model(params)
    optimizer = optimizer_cls(model, tx, wrt=nnx.Param)
    grads = jax.tree.map(lambda p: p * (1e-3 * grads_scale), nnx.state(model, nnx.Param))
    if poison:
        first = grads["leaf_00"]
        first[...] = first[...].at[0, 0].set(jnp.inf)
    graphdef, state = nnx.split((model, optimizer))

    def step(state: Any, grads: Any) -> Any:
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    fn = jax.jit(step, donate_argnums=0).lower(state, grads).compile()
    temp = fn.memory_analysis().temp_size_in_bytes
    state = jax.block_until_ready(fn(state, grads))  # warm up
    return fn, state, grads, temp


def make_optax_variant(params: dict[str, np.ndarray], fused: bool) -> tuple[Callable, Any, Any,
                                                                             int]:
    """The same step on the params dict, without nnx (as in benchmarks/overhead.py)."""
    p = {k: jnp.asarray(v) for k, v in params.items()}
    if fused:
        tx: Any = ls.with_loss_scaling(optax.adam(1e-3))
        grads = jax.tree.map(lambda x: x * (1e-3 * SCALE), p)

        def step(carry: Any, grads: Any) -> Any:
            return ls.apply_gradients(tx, grads, carry[1], carry[0])
    else:
        tx = optax.adam(1e-3)
        grads = jax.tree.map(lambda x: x * 1e-3, p)

        def step(carry: Any, grads: Any) -> Any:
            updates, opt_state = tx.update(grads, carry[1], carry[0])
            return optax.apply_updates(carry[0], updates), opt_state

    carry = (p, tx.init(p))
    fn = jax.jit(step, donate_argnums=0).lower(carry, grads).compile()
    temp = fn.memory_analysis().temp_size_in_bytes
    carry = jax.block_until_ready(fn(carry, grads))
    return fn, carry, grads, temp


def make_nnx_jit_variant(params: dict[str, np.ndarray], optimizer_cls: type, tx: Any,
                         grads_scale: float, donate: bool) -> tuple[Callable, Any, Any, None]:
    """The step as the README writes it: ``nnx.jit`` on the objects, updating in place.
    Its temp bytes are unknown (``nnx.jit`` compiles behind its own call): ``None``."""
    model = Model(params)
    optimizer = optimizer_cls(model, tx, wrt=nnx.Param)
    grads = jax.tree.map(lambda p: p * (1e-3 * grads_scale), nnx.state(model, nnx.Param))

    @nnx.jit(donate_argnums=(0, 1) if donate else ())
    def train_step(model: Any, optimizer: Any, grads: Any) -> None:
        optimizer.update(model, grads)

    def step(state: Any, grads: Any) -> Any:
        train_step(*state, grads)
        return state  # the objects themselves; block_until_ready sees their arrays

    state = (model, optimizer)
    jax.block_until_ready(step(state, grads))  # compile and warm up
    return step, state, grads, None


def _time(fn: Any, state: Any, grads: Any, steps: int, sync_each: bool) -> tuple[float, Any]:
    start = time.perf_counter()
    for _ in range(steps):
        state = fn(state, grads)
        if sync_each:
            state = jax.block_until_ready(state)
    state = jax.block_until_ready(state)
    return (time.perf_counter() - start) / steps, state


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=20e6, help="total parameter count")
    parser.add_argument("--leaves", type=int, default=40, help="number of parameter arrays")
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    params = make_params(args.params, args.leaves)
    n_params = sum(x.size for x in params.values())

    def wrapped() -> Any:  # DEFAULT settings, as the README builds it
        return ls.with_loss_scaling(optax.adam(1e-3))

    specs = {
        "bare nnx.Optimizer(adam)": (nnx.Optimizer, optax.adam(1e-3), 1.0, False),
        "ls.nnx.Optimizer (fused), default, finite": (ls.nnx.Optimizer, wrapped(), SCALE, False),
        "ls.nnx.Optimizer (fused), default, skipped": (ls.nnx.Optimizer, wrapped(), SCALE, True),
        "nnx.Optimizer + with_loss_scaling (plain), default, finite": (
            nnx.Optimizer, wrapped(), SCALE, False),
    }
    compiled, states, grads, temp = {}, {}, {}, {}
    for name, (cls, tx, scale, poison) in specs.items():
        compiled[name], states[name], grads[name], temp[name] = make_variant(
            params, cls, tx, scale, poison)
    for name, fused in (("without nnx: optax.adam", False),
                        ("without nnx: ls.apply_gradients, default, finite", True)):
        compiled[name], states[name], grads[name], temp[name] = make_optax_variant(params, fused)
    nnx_jit_base = "@nnx.jit, donated: bare nnx.Optimizer(adam)"
    nnx_jit_not_donated_base = "@nnx.jit, not donated: bare nnx.Optimizer(adam)"
    baseline = dict.fromkeys(compiled, "bare nnx.Optimizer(adam)")
    for donate, base_name in ((True, nnx_jit_base), (False, nnx_jit_not_donated_base)):
        prefix = base_name.split(":")[0]
        for name, cls, tx, scale in (
                (base_name, nnx.Optimizer, optax.adam(1e-3), 1.0),
                (f"{prefix}: ls.nnx.Optimizer (fused), default, finite", ls.nnx.Optimizer,
                 wrapped(), SCALE)):
            compiled[name], states[name], grads[name], temp[name] = make_nnx_jit_variant(
                params, cls, tx, scale, donate)
            baseline[name] = base_name
    names = list(compiled)

    modes = {"sync": True, "pipelined": False}
    times: dict[str, dict[str, list[float]]] = {m: {n: [] for n in names} for m in modes}
    for _ in range(args.rounds):
        for mode, sync_each in modes.items():
            for name in names:
                elapsed, states[name] = _time(compiled[name], states[name], grads[name],
                                              args.steps, sync_each)
                times[mode][name].append(elapsed)

    base = {m: statistics.median(times[m]["bare nnx.Optimizer(adam)"]) for m in modes}
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
          f"params={n_params / 1e6:.3f}M leaves={len(params)} rounds={args.rounds} "
          f"steps/round={args.steps}")
    print(f"bare nnx.Optimizer(adam) median step: {base['sync'] * 1e3:.3f} ms (block every "
          f"step), {base['pipelined'] * 1e3:.3f} ms (pipelined)")
    print("| variant | block every step | pipelined | XLA temp bytes |\n|---|---:|---:|---:|")
    results = {}
    for name in names:
        ratios = {m: statistics.median(times[m][name]) / statistics.median(
            times[m][baseline[name]]) for m in modes}
        results[name] = {"ratio_sync": ratios["sync"], "ratio_pipelined": ratios["pipelined"],
                         "temp_bytes": temp[name]}
        temp_text = "n/a" if temp[name] is None else f"{temp[name] / 2**20:,.2f} MiB"
        print(f"| {name} | {ratios['sync']:.2f}x | {ratios['pipelined']:.2f}x | {temp_text} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": jax.default_backend(), "params": int(n_params),
                       "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
