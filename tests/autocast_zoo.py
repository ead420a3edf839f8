"""Float32 models written as a float32 user writes them (no dtype argument anywhere), for
the autocast tests. Each :class:`Model` gives a loss of ``(params, batch)`` with the
framework's own state threaded as a float32 user threads it, its params, and batches."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import loss_scaling as ls

VOCAB, SEQ, WIDTH, HEADS, LAYERS, BATCH = 32, 16, 32, 4, 2, 8


@dataclasses.dataclass
class Model:
    """``loss(params, batch) -> scalar``; ``make_loss(cast)`` the same loss with the
    model's forward pass wrapped by ``cast`` (``ls.autocast`` or the identity)."""

    name: str
    make_loss: Callable[[Callable[..., Any]], Callable[..., Any]]
    params: Any
    batch: Callable[[int], Any]  # step -> batch

    def loss(self, cast: Callable[..., Any] = lambda f: f) -> Callable[..., Any]:
        return self.make_loss(cast)


def _tokens(step: int) -> tuple[jax.Array, jax.Array]:
    """A learnable sequence task: the next token is the previous one plus one."""
    key = jax.random.key(step)
    start = jax.random.randint(key, (BATCH, 1), 0, VOCAB)
    seq = (start + jnp.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def _images(step: int) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(step))
    labels = jax.random.randint(k1, (BATCH,), 0, 4)
    images = jax.random.normal(k2, (BATCH, 8, 8, 3)) + labels[:, None, None, None]
    return images, labels


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# -- 1. plain JAX GPT: lax.scan over a jax.checkpoint-ed block, a jitted attention helper --

@jax.jit
def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    scores = jnp.where(causal, scores, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * scale + bias


def gpt_block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    b, t, d = x.shape
    h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    heads = lambda a: a.reshape(b, t, HEADS, d // HEADS)  # noqa: E731
    a = attention(heads(q), heads(k), heads(v)).reshape(b, t, d)
    x = x + a @ p["proj"]
    h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    return x + jax.nn.gelu(h @ p["up"] + p["up_bias"]) @ p["down"]


def gpt_params(key: jax.Array) -> dict[str, Any]:
    ks = jax.random.split(key, 6)
    init = lambda k, *shape: jax.random.normal(k, shape) * 0.1  # noqa: E731
    blocks = {
        "ln1_scale": jnp.ones((LAYERS, WIDTH)), "ln1_bias": jnp.zeros((LAYERS, WIDTH)),
        "qkv": init(ks[0], LAYERS, WIDTH, 3 * WIDTH), "proj": init(ks[1], LAYERS, WIDTH, WIDTH),
        "ln2_scale": jnp.ones((LAYERS, WIDTH)), "ln2_bias": jnp.zeros((LAYERS, WIDTH)),
        "up": init(ks[2], LAYERS, WIDTH, 4 * WIDTH), "up_bias": jnp.zeros((LAYERS, 4 * WIDTH)),
        "down": init(ks[3], LAYERS, 4 * WIDTH, WIDTH),
    }
    return {"embed": init(ks[4], VOCAB, WIDTH), "pos": init(ks[5], SEQ, WIDTH),
            "blocks": blocks, "head": init(ks[0], WIDTH, VOCAB)}


def gpt_forward(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    x = params["embed"][tokens] + params["pos"]
    block = jax.checkpoint(gpt_block)
    x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["blocks"])
    return x @ params["head"]


def plain_gpt() -> Model:
    def make_loss(cast: Callable[..., Any]) -> Callable[..., Any]:
        forward = cast(gpt_forward)
        return lambda params, batch: cross_entropy(forward(params, batch[0]), batch[1])

    return Model("plain_gpt", make_loss, gpt_params(jax.random.key(0)), _tokens)


# -- 2. linen transformer under nn.scan(nn.remat(Block)) -----------------------------------

class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, mask=nn.make_causal_mask(x[..., 0]))
        x = x + h
        h = nn.Dense(4 * WIDTH)(nn.LayerNorm()(x))
        return x + nn.Dense(WIDTH)(nn.gelu(h)), None


class LinenTransformer(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, WIDTH)(tokens)
        blocks = nn.scan(nn.remat(LinenBlock), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=LAYERS)
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def linen_transformer() -> Model:
    model = LinenTransformer()
    params = model.init(jax.random.key(1), _tokens(0)[0])

    def make_loss(cast: Callable[..., Any]) -> Callable[..., Any]:
        apply = cast(model.apply)
        return lambda params, batch: cross_entropy(apply(params, batch[0]), batch[1])

    return Model("linen_transformer", make_loss, params, _tokens)


# -- 3. linen CNN with BatchNorm ----------------------------------------------------------

class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        for features in (16, 32):
            x = nn.Conv(features, (3, 3))(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(4)(x.reshape(x.shape[0], -1))


def linen_cnn() -> Model:
    model = LinenCNN()
    variables = model.init(jax.random.key(2), _images(0)[0], train=False)

    def make_loss(cast: Callable[..., Any]) -> Callable[..., Any]:
        apply = cast(model.apply)

        def loss(params: Any, batch: Any) -> Any:
            logits, updates = apply({"params": params, "batch_stats": variables["batch_stats"]},
                                    batch[0], train=True, mutable=["batch_stats"])
            return cross_entropy(logits, batch[1])

        return loss

    return Model("linen_cnn", make_loss, variables["params"], _images)


# -- 4. nnx transformer: MultiHeadAttention, LayerNorm, Dropout ----------------------------

class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.dropout(self.attn(self.ln1(x), mask=mask))
        return x + self.dropout(self.down(nnx.gelu(self.up(self.ln2(x)))))


class NnxTransformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
        self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def nnx_forward(model: NnxTransformer, tokens: jax.Array) -> jax.Array:
    return model(tokens)


def nnx_transformer() -> Model:
    graphdef, params, rest = nnx.split(NnxTransformer(nnx.Rngs(3)), nnx.Param, ...)

    def make_loss(cast: Callable[..., Any]) -> Callable[..., Any]:
        forward = cast(nnx_forward)

        def loss(params: Any, batch: Any) -> Any:
            model = nnx.merge(graphdef, params, rest, copy=True)
            return cross_entropy(forward(model, batch[0]), batch[1])

        return loss

    return Model("nnx_transformer", make_loss, params, _tokens)


# -- 5. Equinox -----------------------------------------------------------------------------

class EqxClassifier(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 16, 3, padding=1, key=k1)
        self.norm = eqx.nn.LayerNorm(16 * 8 * 8)
        self.mlp = eqx.nn.MLP(16 * 8 * 8, 4, 64, depth=2, activation=jax.nn.silu, key=k2)

    def __call__(self, image: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.conv(jnp.transpose(image, (2, 0, 1))))
        return self.mlp(self.norm(h.reshape(-1)))


def eqx_forward(model: EqxClassifier, images: jax.Array) -> jax.Array:
    return jax.vmap(model)(images)


def equinox_classifier() -> Model:
    params, static = eqx.partition(EqxClassifier(jax.random.key(4)), eqx.is_array)

    def make_loss(cast: Callable[..., Any]) -> Callable[..., Any]:
        forward = cast(eqx_forward)
        return lambda params, batch: cross_entropy(
            forward(eqx.combine(params, static), batch[0]), batch[1])

    return Model("equinox", make_loss, params, _images)


# -- 6. a custom_vjp layer (a linear layer that damps the gradient it passes down) ----------
#
# Its backward pass is linear in the cotangent, as any rule must be to meet loss scaling
# (a clip of the cotangent would clip the *scaled* gradient, with or without autocast).

@jax.custom_vjp
def damped_linear(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def _damped_fwd(x: jax.Array, w: jax.Array) -> Any:
    return x @ w, (x, w)


def _damped_bwd(res: Any, g: jax.Array) -> Any:
    x, w = res
    return 0.5 * (g @ w.T), x.T @ g


damped_linear.defvjp(_damped_fwd, _damped_bwd)


def custom_vjp_forward(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    x = params["embed"][tokens].reshape(tokens.shape[0] * SEQ, WIDTH)
    h = jax.nn.relu(damped_linear(x, params["w1"]))
    return damped_linear(h, params["w2"]).reshape(tokens.shape[0], SEQ, VOCAB)


def custom_vjp_mlp() -> Model:
    ks = jax.random.split(jax.random.key(5), 3)
    params = {"embed": jax.random.normal(ks[0], (VOCAB, WIDTH)),
              "w1": jax.random.normal(ks[1], (WIDTH, 4 * WIDTH)) * 0.2,
              "w2": jax.random.normal(ks[2], (4 * WIDTH, VOCAB)) * 0.1}

    def make_loss(cast: Callable[..., Any]) -> Callable[..., Any]:
        forward = cast(custom_vjp_forward)
        return lambda params, batch: cross_entropy(forward(params, batch[0]), batch[1])

    return Model("custom_vjp", make_loss, params, _tokens)


# -- 7. an RMS norm with a literal eps, on rows of zeros ------------------------------------

def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-8) * scale


def rms_forward(params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    x = params["embed"][tokens]
    x = jnp.where((tokens % 4 == 0)[..., None], 0.0, x)  # every 4th token embeds to zeros
    h = rms_norm(x @ params["w"], params["scale"])
    return h @ params["head"]


def rms_norm_model() -> Model:
    ks = jax.random.split(jax.random.key(6), 3)
    params = {"embed": jax.random.normal(ks[0], (VOCAB, WIDTH)),
              "w": jax.random.normal(ks[1], (WIDTH, WIDTH)) * 0.2,
              "scale": jnp.ones((WIDTH,)),
              "head": jax.random.normal(ks[2], (WIDTH, VOCAB)) * 0.2}

    def make_loss(cast: Callable[..., Any]) -> Callable[..., Any]:
        forward = cast(rms_forward)
        return lambda params, batch: cross_entropy(forward(params, batch[0]), batch[1])

    return Model("rms_norm_eps", make_loss, params, _tokens)


ZOO: dict[str, Callable[[], Model]] = {
    "plain_gpt": plain_gpt,
    "linen_transformer": linen_transformer,
    "linen_cnn": linen_cnn,
    "nnx_transformer": nnx_transformer,
    "equinox": equinox_classifier,
    "custom_vjp": custom_vjp_mlp,
    "rms_norm_eps": rms_norm_model,
}


@functools.cache
def model(name: str) -> Model:
    return ZOO[name]()


def train_in_one_scan(loss_fn: Any, params: Any, batches: Any, tx: Any,
                      scaled: bool) -> tuple[np.ndarray, Any]:
    """One step per batch (``batches`` stacked), in one jitted scan: with ``scaled``, the
    loss-scaled step of ``ls.value_and_grad`` and ``ls.apply_gradients`` (``tx`` a
    ``with_loss_scaling``), else optax's plain step. Returns every step's loss and the
    final optimizer state."""

    def step(carry, batch):
        params, opt_state = carry
        if scaled:
            loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, batch)
            params, opt_state = ls.apply_gradients(tx, grads, opt_state, params, loss=loss)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return (params, opt_state), loss

    run = jax.jit(lambda params: jax.lax.scan(step, (params, tx.init(params)), batches))
    (params, opt_state), losses = run(params)
    return np.asarray(losses), opt_state
