"""Float32 language models (flax linen, no dtype anywhere) with a forward pass that float16
cannot hold, planted as it happens in real models, and one healthy model.

* ``massive``: one MLP writes a "massive activation" of ~2e5 into one channel of the
  residual stream at the first position (an attention sink, as in large language models;
  the LayerNorms that read it hold it in float32).
* ``t5_wo``: a T5-style MLP output (``wo``) of ~1e5 in every channel, then a LayerNorm.
* ``qk``: attention logits without 1/sqrt(d), from large query and key weights (~1e5).
* ``healthy``: the same model, nothing planted.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

VOCAB, SEQ, WIDTH, HEADS, LAYERS, BATCH = 32, 16, 32, 4, 2, 8


class Block(nn.Module):
    scaled_logits: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = nn.LayerNorm(name="ln1")(x)
        heads = lambda a: a.reshape(b, t, HEADS, d // HEADS)  # noqa: E731
        q = heads(nn.Dense(d, name="query")(h))
        k = heads(nn.Dense(d, name="key")(h))
        v = heads(nn.Dense(d, name="value")(h))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if self.scaled_logits:
            logits = logits / jnp.sqrt(d // HEADS)
        self.sow("intermediates", "logits", logits)
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v).reshape(b, t, d)
        x = x + nn.Dense(d, name="out")(attended)
        h = nn.LayerNorm(name="ln2")(x)
        return x + nn.Dense(d, name="wo")(jax.nn.gelu(nn.Dense(4 * d, name="wi")(h)))


class LM(nn.Module):
    scaled_logits: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, WIDTH, name="embed")(tokens)
        x = x + nn.Embed(SEQ, WIDTH, name="pos")(jnp.arange(tokens.shape[1]))
        for i in range(LAYERS):
            x = Block(self.scaled_logits, name=f"block_{i}")(x)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="ln_f")(x))


def tokens(step: int) -> tuple[jax.Array, jax.Array]:
    """A learnable task: the next token is the previous one plus one (mod VOCAB)."""
    start = jax.random.randint(jax.random.key(1000 + step), (BATCH, 1), 0, VOCAB)
    seq = (start + jnp.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


@dataclasses.dataclass(frozen=True)
class Planted:
    name: str
    model: LM
    params: Any

    def logits(self, cast: Callable[..., Any] = lambda f: f) -> Callable[..., Any]:
        apply = cast(self.model.apply)
        return lambda params, x: apply({"params": params}, x)

    def loss(self, cast: Callable[..., Any] = lambda f: f) -> Callable[..., Any]:
        logits = self.logits(cast)
        return lambda params, batch: optax.softmax_cross_entropy_with_integer_labels(
            logits(params, batch[0]), batch[1]).mean()


def _intermediates(model: LM, params: Any, x: jax.Array) -> Any:
    _, state = model.apply({"params": params}, x, capture_intermediates=True,
                           mutable=["intermediates"])
    return state["intermediates"]


def _set(params: Any, path: tuple[str, ...], change: Callable[[Any], Any]) -> Any:
    """``params`` with the leaf at ``path`` replaced by ``change(leaf)``."""
    if not path:
        return change(params)
    return {**params, path[0]: _set(params[path[0]], path[1:], change)}


def _scale(params: Any, path: tuple[str, ...], factor: Any) -> Any:
    """``params`` with the leaf at ``path`` multiplied by ``factor``."""
    return _set(params, path, lambda leaf: leaf * factor)


@functools.cache
def planted(name: str) -> Planted:
    model = LM(scaled_logits=name != "qk")
    x = tokens(0)[0]
    params = model.init(jax.random.key(7), x)["params"]
    if name == "massive":
        # position 0 carries a feature (channel 5 of its position embedding) that hidden
        # unit 0 of block 0's MLP detects; that unit writes ~2e5 into channel 3
        params = _set(params, ("pos", "embedding"), lambda e: e.at[0, 5].set(12.0))
        params = _set(params, ("block_0", "wi", "kernel"),
                      lambda k: k.at[:, 0].set(0.0).at[5, 0].set(10.0))
        params = _set(params, ("block_0", "wi", "bias"), lambda b: b.at[0].set(-30.0))
        hidden = _intermediates(model, params, x)["block_0"]["wi"]["__call__"][0][..., 0]
        unit = jax.nn.gelu(hidden)
        params = _set(params, ("block_0", "wo", "kernel"),
                      lambda k: k.at[0, :].set(0.0).at[0, 3].set(2e5 / unit[:, 0].min()))
    elif name == "t5_wo":  # block 1's MLP output at ~1e5 everywhere, then ln_f
        out = _intermediates(model, params, x)["block_1"]["wo"]["__call__"][0]
        factor = 1e5 / jnp.abs(out).max()
        params = _scale(_scale(params, ("block_1", "wo", "kernel"), factor),
                        ("block_1", "wo", "bias"), factor)
    elif name == "qk":  # block 0's logits at ~1e5 (no 1/sqrt(d) either)
        logits = _intermediates(model, params, x)["block_0"]["logits"][0]
        factor = jnp.sqrt(1e5 / jnp.abs(logits).max())
        for part in ("query", "key"):
            for leaf in ("kernel", "bias"):
                params = _scale(params, ("block_0", part, leaf), factor)
    else:
        assert name == "healthy", name
    return Planted(name, model, params)


PLANTED = ("massive", "t5_wo", "qk")
