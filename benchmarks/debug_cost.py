"""What ls.find_overflow and ls.float16_report cost, as a multiple of one eager step.

Both are eager debugging tools: they interpret the forward and backward pass one primitive
at a time (every intermediate checked for inf/NaN, followed where it goes), and
float16_report also compiles the real step once and bisects the loss scale with it. This
script times each on

* the largest model of tests/test_debug_zoo.py (the scan-over-layers transformer), and
* a 12-layer GPT in flax linen (float16 compute, float32 params; width 64, 4 heads,
  sequence 32, vocabulary 128, batch 2, a causal finfo.min mask, pre-LayerNorm),

against one eager forward + backward (``jax.value_and_grad`` called without ``jit``, warm:
the best of three calls after the first; a ``lax.scan`` called eagerly is traced and
compiled on every call, so the scanned model's eager step is slow), and beside it the
jitted step. Each tool is timed on its first call (what a user waits for: it
includes the eager compiles of each primitive's shapes) and on its second.

    python benchmarks/debug_cost.py            # both models
    python benchmarks/debug_cost.py --model gpt
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import loss_scaling as ls

F16 = jnp.float16
WIDTH, HEADS, SEQ, VOCAB, BATCH, LAYERS = 64, 4, 32, 128, 2, 12


class Block(nn.Module):
    @nn.compact
    def __call__(self, h: Any) -> Any:
        x = nn.LayerNorm(dtype=F16, name="ln1")(h)
        q, k, v = jnp.split(nn.Dense(3 * WIDTH, dtype=F16, name="qkv")(x), 3, axis=-1)
        split = lambda t: t.reshape(BATCH, SEQ, HEADS, WIDTH // HEADS)  # noqa: E731
        s = jnp.einsum("bthd,bshd->bhts", split(q), split(k)) / jnp.sqrt(
            jnp.asarray(WIDTH // HEADS, F16))
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        p = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(F16).min), axis=-1)
        a = jnp.einsum("bhts,bshd->bthd", p, split(v)).reshape(BATCH, SEQ, WIDTH)
        h = h + nn.Dense(WIDTH, dtype=F16, name="proj")(a)
        x = nn.LayerNorm(dtype=F16, name="ln2")(h)
        x = nn.Dense(WIDTH, dtype=F16, name="fc2")(nn.gelu(nn.Dense(4 * WIDTH, dtype=F16,
                                                                     name="fc1")(x)))
        return h + x


class GPT(nn.Module):
    @nn.compact
    def __call__(self, tokens: Any) -> Any:
        h = nn.Embed(VOCAB, WIDTH, dtype=F16, name="wte")(tokens)
        h = h + self.param("wpe", nn.initializers.normal(0.02), (SEQ, WIDTH)).astype(F16)
        for i in range(LAYERS):
            h = Block(name=f"h_{i}")(h)
        return nn.Dense(VOCAB, dtype=F16, name="head")(nn.LayerNorm(dtype=F16, name="ln_f")(h))


def gpt() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    model = GPT()
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, VOCAB)
    params = jax.jit(model.init)(jax.random.key(1), tokens)["params"]

    def loss_fn(params: Any, tokens: Any) -> Any:
        logits = model.apply({"params": params}, tokens).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                               tokens[:, 1:]).mean()

    return loss_fn, (params, tokens)


def zoo_largest() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
    import test_debug_zoo

    case = test_debug_zoo.case_of("plain_scan_transformer")
    return case.loss_fn, case.args


def seconds(f: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(f())
    return time.perf_counter() - start


def measure(name: str, loss_fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    step = lambda: jax.value_and_grad(loss_fn)(*args)  # noqa: E731  (eager: no jit)
    cold = seconds(step)
    warm = min(seconds(step) for _ in range(3))
    jitted = jax.jit(jax.value_and_grad(loss_fn))
    compiled = seconds(lambda: jitted(*args))
    fast = min(seconds(lambda: jitted(*args)) for _ in range(3))
    print(f"{name}: one eager forward + backward {warm * 1e3:.0f} ms "
          f"(first call {cold * 1e3:.0f} ms); jitted {fast * 1e3:.1f} ms "
          f"(compile and first call {compiled:.1f} s)")
    for tool in (ls.find_overflow, ls.float16_report):
        def run(tool: Callable[..., Any] = tool) -> None:
            tool(loss_fn, *args, scale=2.0**15)

        first, second = seconds(run), seconds(run)
        print(f"  {tool.__name__:14s} first call {first:6.1f} s = {first / warm:5.1f}x, "
              f"second call {second:6.1f} s = {second / warm:5.1f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["zoo", "gpt", "all"], default="all")
    model = parser.parse_args(argv).model
    if model in ("zoo", "all"):
        measure("zoo's largest model (scan transformer, 3 layers, width 4)", *zoo_largest())
    if model in ("gpt", "all"):
        measure(f"{LAYERS}-layer GPT (linen, width {WIDTH})", *gpt())


if __name__ == "__main__":
    main()
