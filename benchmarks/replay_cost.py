"""What replay (``max_replays``) costs on a healthy step, side by side in one process.

Each variant is one whole jitted train step ``(params, opt_state, x) -> (params,
opt_state)``: ``ls.value_and_grad`` of a float16 loss, then the fused
``ls.apply_gradients`` with Adam, params and optimizer state donated. The loss is as cheap
as a loss can be (``sum(f16(p) * f16(x))`` per leaf, summed in float32: one read of the
params forward, one write of the gradients backward), so the step is mostly the
optimizer's and the ratio is the harshest one. Variants run interleaved, round after
round; the table reports each one's median time per step as a ratio to the default fused
step (``max_replays=0``), one step per ``block_until_ready`` and pipelined, plus the XLA
temp bytes and the compile time (the replaying step holds the forward and backward pass
twice: the user's, and the replay's inside a ``lax.while_loop`` that a healthy step does
not enter).

    python benchmarks/replay_cost.py                         # 20M params, 40 leaves
    python benchmarks/replay_cost.py --params 4e3 --steps 50  # dispatch-bound
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import loss_scaling as ls

sys.path.insert(0, str(Path(__file__).parent))
from overhead import make_params  # noqa: E402


def loss_fn(params: Any, x: Any) -> jax.Array:
    # Products in float16, summed in float32: Adam moves every param by ~1e-3 a step, so
    # a float16 sum of a leaf's half-million products would overflow after ~100 steps.
    return sum(jnp.sum(p.astype(jnp.float16) * x[k].astype(jnp.float16), dtype=jnp.float32)
               for k, p in params.items()) * 1e-3


def train_step(max_replays: int) -> tuple[Any, Any]:
    tx = ls.with_loss_scaling(optax.adam(1e-3), max_replays=max_replays)

    def step(params: Any, opt_state: Any, x: Any) -> Any:
        loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x)
        extra = {"value_fn": lambda p: loss_fn(p, x)} if max_replays else {}
        return ls.apply_gradients(tx, grads, opt_state, params, loss=loss, **extra)

    return step, tx.init


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=20e6)
    parser.add_argument("--leaves", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)

    params0 = make_params(args.params, args.leaves)
    x = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params0)
    variants = {"fused, default (max_replays=0)": 0, "fused, max_replays=2": 2}
    compiled, carries, temp, compile_s = {}, {}, {}, {}
    for name, n in variants.items():
        step, init = train_step(n)
        params = jax.tree.map(jnp.copy, params0)
        opt_state = init(params)
        jax.clear_caches()
        start = time.perf_counter()
        fn = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, x).compile()
        compile_s[name] = time.perf_counter() - start
        temp[name] = fn.memory_analysis().temp_size_in_bytes
        compiled[name] = fn
        carries[name] = jax.block_until_ready(fn(params, opt_state, x))

    times: dict[str, dict[str, list[float]]] = {m: {n: [] for n in variants}
                                                for m in ("sync", "pipelined")}
    for _ in range(args.rounds):
        for mode in times:
            for name in variants:
                start = time.perf_counter()
                carry = carries[name]
                for _ in range(args.steps):
                    carry = compiled[name](*carry, x)
                    if mode == "sync":
                        carry = jax.block_until_ready(carry)
                carries[name] = jax.block_until_ready(carry)
                times[mode][name].append((time.perf_counter() - start) / args.steps)
    for name in variants:  # every step was healthy: nothing replayed, nothing skipped
        m = ls.metrics(carries[name][1])
        assert int(m["replays"]) == 0 and int(m["skipped_steps"]) == 0, name

    base = next(iter(variants))
    n_params = sum(p.size for p in jax.tree.leaves(params0))
    print(f"backend={jax.default_backend()} params={n_params / 1e6:.3f}M "
          f"leaves={len(params0)} rounds={args.rounds} steps/round={args.steps}")
    print(f"default fused train step: {statistics.median(times['sync'][base]) * 1e3:.3f} ms")
    print("| variant | block every step | pipelined | XLA temp bytes | compile |\n"
          "|---|---:|---:|---:|---:|")
    results = {}
    for name in variants:
        ratio = {m: statistics.median(times[m][name]) / statistics.median(times[m][base])
                 for m in times}
        results[name] = {**ratio, "compile_s": compile_s[name], "temp": temp[name]}
        print(f"| {name} | {ratio['sync']:.3f}x | {ratio['pipelined']:.3f}x | "
              f"{temp[name] / 2**20:,.2f} MiB | {compile_s[name]:.2f} s "
              f"({compile_s[name] / compile_s[base]:.2f}x) |")
    return results


if __name__ == "__main__":
    main()
