"""What ``ls.autocast`` costs: a float32 model autocast against the same model hand-cast.

The model is the GPT of ``benchmarks/train_step_compile.py`` (``--layers`` blocks of
pre-LayerNorm attention and an MLP, width 64, 4 heads, 32 tokens), written twice by one
class: ``GPT(dtype=jnp.float16)``, hand-cast as flax's convention has it (``dtype=`` on
every layer, the softmax in float32, params float32), and ``GPT(dtype=jnp.float32)``, the
float32 model. Three variants of the same gradient computation, each
``jax.jit(jax.value_and_grad(loss))`` of the cross-entropy over ``(params, tokens)``:

* ``hand f16``: the hand-cast model (the reference of every ratio);
* ``autocast``: the float32 model under ``ls.autocast`` (the whole loss wrapped);
* ``float32``: the float32 model as it is (for scale: what mixed precision saves).

They are measured side by side in one process, interleaved round after round (each round
in another order) so that machine noise hits them alike:

* the step: one step per ``block_until_ready`` (a loop that logs every step) and pipelined
  (``--steps`` dispatched back to back, one block at the end); the median over the rounds
  of the mean milliseconds per step;
* the compile: trace + lower, and XLA's compile, with ``jax.clear_caches()`` before each
  and a fresh ``ls.autocast`` (its rewrite is cached per function, so a compile includes
  it); the median seconds;
* the compiled program's kernels (XLA fusions) and temp buffer bytes
  (``memory_analysis()``), the same on every run: on a busy machine the kernels say more
  than a compile time, and the bytes are where half activations save memory;
* the share of the matmul FLOPs with half operands, from ``ls.autocast_report``.

    python benchmarks/autocast_cost.py                 # 12 layers
    python benchmarks/autocast_cost.py --layers 4 --quick
    python benchmarks/autocast_cost.py --batch 32 --rounds 7

The issue's targets: autocast's step at most 1.05x the hand-cast model's, its compile at
most 1.2x. On CPU, XLA emulates float16 elementwise arithmetic through float32, so a model
that keeps its elementwise ops in float32 (as autocast does next to float32 params) can be
faster than the hand-cast one: the CPU ratio is not the GPU's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step_compile import GPT  # noqa: E402  (the same model, one file up)

import loss_scaling as ls  # noqa: E402

REFERENCE = "hand f16"
VARIANTS = (REFERENCE, "autocast", "float32")
TIMINGS = {"block every step": True, "pipelined": False}


def loss_of(model: GPT) -> Callable[[Any, jax.Array], jax.Array]:
    """The next-token cross-entropy of ``model`` (as the other benchmark's, float32 loss)."""

    def loss(params: Any, tokens: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def gradient_fns(layers: int) -> dict[str, Callable[[], Callable[..., Any]]]:
    """Each variant's un-jitted ``value_and_grad``, made fresh on every call (a fresh
    ``ls.autocast`` has no rewrite cached)."""
    hand, full = loss_of(GPT(layers, dtype=jnp.float16)), loss_of(GPT(layers, dtype=jnp.float32))
    return {
        REFERENCE: lambda: jax.value_and_grad(hand),
        "autocast": lambda: jax.value_and_grad(ls.autocast(full)),
        "float32": lambda: jax.value_and_grad(full),
    }


def inputs(layers: int, batch: int) -> tuple[Any, jax.Array]:
    model = GPT(layers, dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (batch, model.length + 1), 0, model.vocab)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]  # float32 in every variant
    return params, tokens


def rotated(names: list[str], k: int) -> list[str]:
    """``names`` starting at the ``k``-th: no variant is always first in a round."""
    k %= len(names)
    return names[k:] + names[:k]


def compile_once(make: Callable[[], Callable[..., Any]], params: Any, tokens: Any
                 ) -> tuple[float, float, Any]:
    """Seconds to trace and lower, and to compile, every JAX cache cleared first; and the
    compiled program."""
    jax.clear_caches()
    start = time.perf_counter()
    lowered = jax.jit(make()).lower(params, tokens)
    traced = time.perf_counter()
    compiled = lowered.compile()
    return traced - start, time.perf_counter() - traced, compiled


def time_steps(step: Any, params: Any, tokens: Any, steps: int, block_each: bool) -> float:
    """Mean seconds per step over ``steps`` calls."""
    start = time.perf_counter()
    out = None
    for _ in range(steps):
        out = step(params, tokens)
        if block_each:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def measure(layers: int, batch: int, rounds: int, steps: int, compile_rounds: int
            ) -> dict[str, dict[str, Any]]:
    params, tokens = inputs(layers, batch)
    makes = gradient_fns(layers)
    results: dict[str, dict[str, Any]] = {
        name: {"trace": [], "compile": [], **{t: [] for t in TIMINGS}} for name in makes}
    compiled = {}
    for k in range(compile_rounds):  # interleaved: each round compiles every variant once
        for name in rotated(list(makes), k):
            trace, comp, compiled[name] = compile_once(makes[name], params, tokens)
            results[name]["trace"].append(trace)
            results[name]["compile"].append(comp)
    compiled = {name: compiled[name] for name in makes}
    for name, step in compiled.items():
        jax.block_until_ready(step(params, tokens))  # warm up
        results[name]["loss"] = float(step(params, tokens)[0])
        results[name]["kernels"] = step.as_text().count("kind=k")  # kLoop/kInput/kOutput
        results[name]["temp"] = step.memory_analysis().temp_size_in_bytes
    for k in range(rounds):
        for timing, block_each in TIMINGS.items():
            for name in rotated(list(compiled), k):
                results[name][timing].append(
                    time_steps(compiled[name], params, tokens, steps, block_each))
    report = ls.autocast_report(ls.autocast(loss_of(GPT(layers, dtype=jnp.float32))),
                                params, tokens)
    results["autocast"]["half_flops"] = report.half_flops_fraction()
    return results


def table(layers: int, batch: int, rounds: int, steps: int, compile_rounds: int,
          results: dict[str, dict[str, Any]]) -> str:
    med = statistics.median
    ref = results[REFERENCE]
    lines = [f"GPT, {layers} layers, batch {batch} x 32 tokens, jax.jit(jax.value_and_grad("
             f"loss)); step: median of {rounds} rounds of {steps} steps; compile: median of "
             f"{compile_rounds}, jax.clear_caches() before each",
             f"{'variant':10s} {'block ms':>9s} {'/ hand':>7s} {'pipelined ms':>13s} "
             f"{'/ hand':>7s} {'trace+lower s':>14s} {'compile s':>10s} {'total s':>8s} "
             f"{'/ hand':>7s} {'kernels':>8s} {'temp MiB':>9s} {'loss':>8s}"]
    ref_total = med(ref["trace"]) + med(ref["compile"])
    for name, r in results.items():
        block, piped = med(r["block every step"]), med(r["pipelined"])
        total = med(r["trace"]) + med(r["compile"])
        lines.append(
            f"{name:10s} {1e3 * block:9.2f} {block / med(ref['block every step']):7.2f} "
            f"{1e3 * piped:13.2f} {piped / med(ref['pipelined']):7.2f} "
            f"{med(r['trace']):14.2f} {med(r['compile']):10.2f} {total:8.2f} "
            f"{total / ref_total:7.2f} {r['kernels']:8d} {r['temp'] / 2**20:9.2f} "
            f"{r['loss']:8.4f}")
    lines.append(f"autocast: {100 * results['autocast']['half_flops']:.0f}% of the forward "
                 "matmul FLOPs with float16 operands (ls.autocast_report); targets: step "
                 "<= 1.05x hand f16, compile <= 1.2x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="step-timing rounds")
    parser.add_argument("--steps", type=int, default=20, help="steps per timing")
    parser.add_argument("--compile-rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="a first look: 2 step rounds of 5 steps, 1 compile per variant")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.compile_rounds = 2, 5, 1
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{jax.devices()[0].device_kind}")
    for layers in args.layers:
        results = measure(layers, args.batch, args.rounds, args.steps, args.compile_rounds)
        print(table(layers, args.batch, args.rounds, args.steps, args.compile_rounds,
                    results), flush=True)
        print()


if __name__ == "__main__":
    main()
