"""What ls.find_overflow and ls.float16_report cost, as a multiple of one eager step.

Both are eager debugging tools: they interpret the forward and backward pass one primitive
at a time (every intermediate checked for inf/NaN, followed where it goes), and both run
the real step compiled (find_overflow once, to compare; float16_report to bisect the loss
scale, about ten runs), compiled on the first call and kept for later calls with the same
shapes. This script times each on

* the largest model of tests/test_debug_zoo.py (the scan-over-layers transformer),
* a toy ViT in flax linen (32x32x3 images in 16 patches, width 64, 4 heads, 2 blocks,
  10 classes, batch 2, float16 compute, float32 params), and
* a 12-layer GPT in flax linen (float16 compute, float32 params; width 64, 4 heads,
  sequence 32, vocabulary 128, batch 2, a causal finfo.min mask, pre-LayerNorm),

against one eager forward + backward (``jax.value_and_grad`` called without ``jit``, warm:
the best of three calls after the first; a ``lax.scan`` called eagerly is traced and
compiled on every call, so the scanned model's eager step is slow), and beside it the
jitted step. Each tool is timed on its first call, after ``jax.clear_caches()`` (what a
user waits for in a fresh session: the eager compiles of each primitive's shapes and the
compile of the real step), and on its second, on another batch of the same shapes (what a
user waits for when calling it again: nothing is compiled again).

    python benchmarks/debug_cost.py              # all three models
    python benchmarks/debug_cost.py --model vit
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
from loss_scaling.debug import _trace

F16 = jnp.float16
WIDTH, HEADS, SEQ, VOCAB, BATCH, LAYERS = 64, 4, 32, 128, 2, 12


class Block(nn.Module):
    causal: bool = True

    @nn.compact
    def __call__(self, h: Any) -> Any:
        batch, seq = h.shape[:2]
        x = nn.LayerNorm(dtype=F16, name="ln1")(h)
        q, k, v = jnp.split(nn.Dense(3 * WIDTH, dtype=F16, name="qkv")(x), 3, axis=-1)
        split = lambda t: t.reshape(batch, seq, HEADS, WIDTH // HEADS)  # noqa: E731
        s = jnp.einsum("bthd,bshd->bhts", split(q), split(k)) / jnp.sqrt(
            jnp.asarray(WIDTH // HEADS, F16))
        if self.causal:
            s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, jnp.finfo(F16).min)
        p = jax.nn.softmax(s, axis=-1)
        a = jnp.einsum("bhts,bshd->bthd", p, split(v)).reshape(batch, seq, WIDTH)
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


class ViT(nn.Module):
    @nn.compact
    def __call__(self, images: Any) -> Any:
        b = images.shape[0]  # 32x32x3 -> 16 patches of 8x8x3
        patches = images.reshape(b, 4, 8, 4, 8, 3).transpose(0, 1, 3, 2, 4, 5)
        h = nn.Dense(WIDTH, dtype=F16, name="embed")(patches.reshape(b, 16, 192))
        h = h + self.param("pos", nn.initializers.normal(0.02), (16, WIDTH)).astype(F16)
        for i in range(2):
            h = Block(causal=False, name=f"block_{i}")(h)
        h = nn.LayerNorm(dtype=F16, name="ln_f")(h).mean(axis=1)
        return nn.Dense(10, dtype=F16, name="head")(h)


def gpt(seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    model = GPT()
    tokens = jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, VOCAB)
    params = jax.jit(model.init)(jax.random.key(1), tokens)["params"]

    def loss_fn(params: Any, tokens: Any) -> Any:
        logits = model.apply({"params": params}, tokens).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                               tokens[:, 1:]).mean()

    return loss_fn, (params, tokens)


def vit(seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    model = ViT()
    images = jax.random.normal(jax.random.key(seed), (BATCH, 32, 32, 3))
    labels = jax.random.randint(jax.random.key(seed + 1), (BATCH,), 0, 10)
    params = jax.jit(model.init)(jax.random.key(1), images)["params"]

    def loss_fn(params: Any, images: Any, labels: Any) -> Any:
        logits = model.apply({"params": params}, images).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss_fn, (params, images, labels)


def zoo_largest(seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
    import test_debug_zoo

    case = test_debug_zoo.case_of("plain_scan_transformer")
    if seed:  # another batch of the same shape
        return case.loss_fn, (case.args[0], jnp.flip(case.args[1], axis=1))
    return case.loss_fn, case.args


def seconds(f: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(f())
    return time.perf_counter() - start


def measure(name: str, build: Callable[..., tuple[Callable[..., Any], tuple[Any, ...]]]
            ) -> None:
    loss_fn, args = build()
    _, other = build(seed=1)  # the second call's batch: new values, the same shapes
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
        def run(tool: Callable[..., Any] = tool, batch: tuple[Any, ...] = args) -> None:
            tool(loss_fn, *batch, scale=2.0**15)

        jax.clear_caches()  # each tool's first call as in a fresh session: nothing compiled
        _trace._compiled.clear()
        first, second = seconds(run), seconds(lambda tool=tool: run(tool, other))
        print(f"  {tool.__name__:14s} first call {first:6.1f} s = {first / warm:5.1f}x, "
              f"second call {second:6.1f} s = {second / warm:5.1f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["zoo", "vit", "gpt", "all"], default="all")
    model = parser.parse_args(argv).model
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    if model in ("zoo", "all"):
        measure("zoo's largest model (scan transformer, 3 layers, width 4)", zoo_largest)
    if model in ("vit", "all"):
        measure(f"toy ViT (linen, 2 blocks, width {WIDTH})", vit)
    if model in ("gpt", "all"):
        measure(f"{LAYERS}-layer GPT (linen, width {WIDTH})", gpt)


if __name__ == "__main__":
    main()
