"""A zoo of small models against brute force: ``ls.find_overflow`` and ``ls.float16_report``.

Eleven models across flax nnx, linen, Equinox and plain JAX, all computing in float16 with
float32 params, as people write them: healthy ones (a causal transformer with a
``finfo.min`` mask, attention with ``softmax(where=)``, ``eqx.nn.LayerNorm``, linen
BatchNorm + LayerNorm, a scan-over-layers transformer, ``jax.checkpoint``), forward
overflows (a T5-style gated feed-forward, unscaled q.k logits, a real overflow in a later
block after a LayerNorm), a backward-only overflow at 2**15, and a ``-inf`` mask together
with a real backward overflow.

The truth for each is brute force, independent of the library: the real step,
``jax.value_and_grad`` of the float32 loss times 2**k compiled with ``jax.jit``, at every
power of two from 2**-14 to 2**127; a scale trains when the loss and every gradient are
finite. The layer and phase of a broken model are where it was built to break. Dimensions
are tiny and equal (4) so that the eager interpreter's per-shape compiles are shared.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import loss_scaling as ls

F16, F32 = jnp.float16, jnp.float32
D = 4  # width, sequence length and vocabulary
EXPONENTS = range(-14, 128)
TOKENS = jnp.array([[0, 1, 2, 3], [3, 2, 1, 0]])
CAUSAL = jnp.tril(jnp.ones((D, D), bool))


def causal_attention(q, k, v, scaled=True, fill=None, where=False):
    """One head; the mask filled with ``fill`` (finfo.min, -inf) or given as ``where=``."""
    s = jnp.einsum("btd,bsd->bts", q, k)
    if scaled:
        s = s / jnp.sqrt(jnp.asarray(q.shape[-1], s.dtype))
    if where:
        p = jax.nn.softmax(s, axis=-1, where=CAUSAL)
    else:
        p = jax.nn.softmax(jnp.where(CAUSAL, s, fill), axis=-1)
    return jnp.einsum("bts,bsd->btd", p, v)


def lm_loss(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), TOKENS).mean()


# ---------------------------------------------------------------------------- flax nnx


class NnxLM(nnx.Module):
    """A causal LM with a hand-written finfo(float16).min mask and a LayerNorm.

    Its q.k logits reach about 50, so the masked entries, -65504 minus the row max, round
    to -inf in float16: exp(-inf) = 0, harmless. ``unscaled`` and ``big`` make the q.k
    logits overflow float16 (no 1/sqrt(d), large query and key kernels).
    """

    def __init__(self, unscaled=False, big=3.0):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(D, D, dtype=F16, rngs=rngs)
        self.embed.embedding[...] = 2.0 * jnp.eye(D) + 1.0
        self.norm = nnx.LayerNorm(D, dtype=F16, rngs=rngs)
        self.attn = NnxAttention(big, unscaled, rngs)
        self.head = nnx.Linear(D, D, dtype=F16, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.attn(self.norm(h))
        return self.head(h)


class NnxAttention(nnx.Module):
    def __init__(self, big, unscaled, rngs):
        self.unscaled = unscaled
        self.query = nnx.Linear(D, D, use_bias=False, dtype=F16, rngs=rngs)
        self.key = nnx.Linear(D, D, use_bias=False, dtype=F16, rngs=rngs)
        self.value = nnx.Linear(D, D, use_bias=False, dtype=F16, rngs=rngs)
        self.query.kernel[...] = big * jnp.eye(D)
        self.key.kernel[...] = big * jnp.eye(D)

    def __call__(self, h):
        return causal_attention(self.query(h), self.key(h), self.value(h),
                                scaled=not self.unscaled, fill=jnp.finfo(F16).min)


class NnxChain(nnx.Module):
    """Three layers; ``mid``'s kernel is all 8: at 2**15 the cotangent of its input is
    4 * 8 * 2**15 = 2**20, which overflows and reaches ``first``'s kernel gradient."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.first = nnx.Linear(D, D, use_bias=False, dtype=F16, rngs=rngs)
        self.mid = nnx.Linear(D, D, use_bias=False, dtype=F16, rngs=rngs)
        self.last = nnx.Linear(D, D, use_bias=False, dtype=F16, rngs=rngs)
        self.first.kernel[...] = jnp.eye(D)
        self.mid.kernel[...] = jnp.full((D, D), 8.0)
        self.last.kernel[...] = jnp.eye(D)

    def __call__(self, x):
        return self.last(self.mid(self.first(x)))


# --------------------------------------------------------------------------- flax linen


class LinenNormMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, dtype=F16, name="up")(x)
        x = nn.BatchNorm(use_running_average=False, dtype=F16, name="bn")(x)
        x = nn.LayerNorm(dtype=F16, name="ln")(nn.relu(x))
        return nn.Dense(D, dtype=F16, name="out")(x)


class T5FeedForward(nn.Module):
    """T5's gated feed-forward: gelu(x wi_0) * (x wi_1), then wo. Pretrained in bfloat16, its
    activations pass 65504: each factor fits float16, their product does not."""

    @nn.compact
    def __call__(self, x):
        gate = nn.gelu(nn.Dense(D, use_bias=False, dtype=F16, name="wi_0")(x),
                       approximate=False)
        up = nn.Dense(D, use_bias=False, dtype=F16, name="wi_1")(x)
        with jax.named_scope("gated"):
            h = gate * up
        return nn.Dense(D, use_bias=False, dtype=F16, name="wo")(h)


class LinenMaskedAmp(nn.Module):
    """Attention with a -inf mask (harmless), then ``amp``, whose all-8 kernel makes the
    cotangent of its input overflow at 2**15 (a real backward overflow)."""

    @nn.compact
    def __call__(self, x):
        q = nn.Dense(D, use_bias=False, dtype=F16, name="q")(x)
        h = causal_attention(q, q, q, fill=-jnp.inf)
        h = nn.Dense(D, use_bias=False, dtype=F16, name="amp",
                     kernel_init=nn.initializers.constant(8.0))(h)
        return h


# ------------------------------------------------------------------------------ Equinox


class EqxBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    linear: eqx.nn.Linear

    def __init__(self, key, big=None):
        self.norm = eqx.nn.LayerNorm(D)
        self.linear = eqx.nn.Linear(D, D, key=key)
        if big is not None:  # normalized inputs up to 1.7 times big: past 65504
            self.linear = eqx.tree_at(lambda m: m.weight, self.linear, big * jnp.eye(D))

    def __call__(self, x):
        h = jax.vmap(self.norm)(x.astype(F16))  # eqx.nn.LayerNorm computes in float16 here
        return x + jax.vmap(lambda v: _eqx_linear(self.linear, v))(h)


def _eqx_linear(linear, x):
    return linear.weight.astype(F16) @ x + linear.bias.astype(F16)


class EqxNet(eqx.Module):
    blocks: list

    def __init__(self, big=None):
        self.blocks = [EqxBlock(jax.random.key(0)), EqxBlock(jax.random.key(1), big)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


# ---------------------------------------------------------------------------- plain JAX


def init_plain(n_layers=1, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return {"embed": jax.random.normal(keys[0], (D, D)),
            "qkv": 0.5 * jax.random.normal(keys[1], (n_layers, 3, D, D)),
            "head": jax.random.normal(keys[2], (D, D))}


def where_attention_loss(params, tokens):
    h = params["embed"].astype(F16)[tokens]
    q, k, v = (h @ w.astype(F16) for w in params["qkv"][0])
    with jax.named_scope("attn"):
        h = h + causal_attention(q, k, v, where=True)
    return lm_loss(h @ params["head"].astype(F16))


def layer_norm(h):
    mean = jnp.mean(h.astype(F32), -1, keepdims=True)
    var = jnp.var(h.astype(F32), -1, keepdims=True)
    return ((h - mean) * jax.lax.rsqrt(var + 1e-5)).astype(F16)


def scanned_loss(params, tokens):
    def layer(h, qkv):
        with jax.named_scope("layer"):
            q, k, v = (layer_norm(h) @ w.astype(F16) for w in qkv)
            return h + causal_attention(q, k, v, fill=jnp.finfo(F16).min), None

    h = params["embed"].astype(F16)[tokens]
    h = jax.lax.scan(layer, h, params["qkv"])[0]
    return lm_loss(h @ params["head"].astype(F16))


def checkpoint_loss(params, tokens):
    @jax.checkpoint
    def block(qkv, h):
        q, k, v = (layer_norm(h) @ w.astype(F16) for w in qkv)
        return h + causal_attention(q, k, v, fill=jnp.finfo(F16).min)

    h = params["embed"].astype(F16)[tokens]
    for i in range(params["qkv"].shape[0]):
        h = block(params["qkv"][i], h)
    return lm_loss(h @ params["head"].astype(F16))


# ------------------------------------------------------------------------------ the zoo


@dataclasses.dataclass(frozen=True)
class Case:
    """A model: the tools' arguments, how to differentiate it by hand, what is wrong."""

    framework: str
    loss_fn: Callable[..., Any]
    args: tuple[Any, ...]  # (model or params, *batch) as the tools take them
    broken: str | None = None  # None (healthy), "forward" or "backward"
    layer: str = ""  # a substring of the overflowing layer's path
    primitive: str = ""


def sum_loss(out):
    return jnp.sum(out.astype(F32))


def linen_case(module, x, broken=None, layer="", primitive="", stats=False):
    variables = module.init(jax.random.key(0), x)
    params = variables["params"]
    if stats:
        batch_stats = variables["batch_stats"]

        def loss_fn(params, x):
            out, _ = module.apply({"params": params, "batch_stats": batch_stats}, x,
                                  mutable=["batch_stats"])
            return sum_loss(out)
    else:
        def loss_fn(params, x):
            return sum_loss(module.apply({"params": params}, x))
    return Case("linen", loss_fn, (params, x), broken, layer, primitive)


X = jnp.linspace(-1.0, 1.0, 2 * D * D).reshape(2, D, D).astype(F16)
SMALL = jnp.full((2, D), 1e-3, F16)


def t5_params():
    """Each factor of the gate is at most 4 * 300 in magnitude (the batch is within [-1, 0]),
    their product is past 65504."""
    params = T5FeedForward().init(jax.random.key(0), X[0])["params"]
    return {"wi_0": {"kernel": jnp.full((D, D), -300.0)},
            "wi_1": {"kernel": jnp.full((D, D), 300.0)}, "wo": params["wo"]}


def _nnx_loss(m, tokens):
    return lm_loss(m(tokens))


def _module_loss(m, x):
    return sum_loss(m(x))


def _t5() -> Case:
    t5 = T5FeedForward()
    return Case("linen", lambda p, x: sum_loss(t5.apply({"params": p}, x)),
                (t5_params(), X[0]), "forward", "T5FeedForward/gated", "mul")


# Built when first used (a module-level zoo would cost every collection its inits).
BUILDERS: dict[str, Callable[[], Case]] = {
    # healthy
    "nnx_causal_lm_finfo_min_mask": lambda: Case("nnx", _nnx_loss, (NnxLM(), TOKENS)),
    "plain_softmax_where": lambda: Case("plain", where_attention_loss,
                                        (init_plain(), TOKENS)),
    "eqx_layernorm": lambda: Case("equinox", _module_loss, (EqxNet(), X[0])),
    "linen_batchnorm_layernorm": lambda: linen_case(LinenNormMLP(), X[0], stats=True),
    "plain_scan_transformer": lambda: Case("plain", scanned_loss,
                                           (init_plain(3, 1), TOKENS)),
    "plain_checkpoint": lambda: Case("plain", checkpoint_loss, (init_plain(2, 2), TOKENS)),
    # forward overflows
    "linen_t5_gated_ff": _t5,
    "nnx_unscaled_qk": lambda: Case("nnx", _nnx_loss,
                                    (NnxLM(unscaled=True, big=150.0), TOKENS),
                                    "forward", "attn", "dot_general"),
    "eqx_second_block_after_layernorm": lambda: Case(
        "equinox", _module_loss, (EqxNet(big=6e4), X[0]), "forward", "blocks.1",
        "dot_general"),
    # backward overflows at 2**15
    "nnx_backward_only": lambda: Case("nnx", _module_loss, (NnxChain(), SMALL),
                                      "backward", "mid", "dot_general"),
    "linen_inf_mask_and_backward": lambda: linen_case(
        LinenMaskedAmp(), SMALL[:, None, :] * jnp.ones((1, D, 1), F16), "backward",
        "LinenMaskedAmp/amp", "dot_general"),
}


@functools.cache
def case_of(name: str) -> Case:
    return BUILDERS[name]()


class _Zoo(dict):
    """``ZOO[name]``: the case, built on first use."""

    def __missing__(self, name: str) -> Case:
        return case_of(name)


ZOO = _Zoo()
NAMES = list(BUILDERS)


def differentiable(case: Case) -> tuple[Any, Callable[[Any], Any]]:
    """What the framework's own recipe differentiates, and the loss as a function of it."""
    first, *batch = case.args
    if case.framework == "nnx":
        graphdef, diff, rest = nnx.split(first, nnx.Param, ...)
        return diff, lambda d: case.loss_fn(nnx.merge(graphdef, d, rest), *batch)
    if case.framework == "equinox":
        diff, static = eqx.partition(first, eqx.is_inexact_array)
        return diff, lambda d: case.loss_fn(eqx.combine(d, static), *batch)
    return first, lambda d: case.loss_fn(d, *batch)


def brute_force(case: Case) -> list[int]:
    """The exponents k at which the real float16 step at scale 2**k is finite."""
    diff, loss_of = differentiable(case)

    @jax.jit
    def finite(diff, scale):
        loss, grads = jax.value_and_grad(lambda d: loss_of(d).astype(F32) * scale)(diff)
        return jnp.isfinite(loss) & jnp.all(jnp.stack(
            [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))

    return [k for k in EXPONENTS if bool(finite(diff, jnp.float32(2.0**k)))]


TRUTH = {}
# The zoo runs whole (CI runs every test); the quick subset (`-m "not slow"`) keeps the
# three defect tests below that are not marked: a zoo model each way costs ~10 s of CPU.
SLOW = pytest.mark.slow


def truth(name: str) -> list[int]:
    if name not in TRUTH:
        TRUTH[name] = brute_force(ZOO[name])
    return TRUTH[name]


@SLOW
@pytest.mark.parametrize("name", NAMES)
def test_the_zoo_is_what_it_says_by_brute_force(name):
    case, trains = ZOO[name], truth(name)
    if case.broken == "forward":
        assert trains == [], trains  # no scale helps a forward overflow
    elif case.broken == "backward":
        assert trains and 0 in trains and 15 not in trains, trains
    else:
        assert trains and 0 in trains, trains


@SLOW
@pytest.mark.parametrize("name", NAMES)
def test_find_overflow_names_the_true_layer_and_phase_and_nothing_on_healthy_models(name):
    case, trains = ZOO[name], truth(name)
    scale = 2.0 ** (15 if case.broken else min(15, max(trains)))  # a scale that trains
    report = ls.find_overflow(case.loss_fn, *case.args, scale=scale)
    if case.broken is None:
        assert not report, report
        return
    assert report.found and report.phase == case.broken, report
    assert case.layer in report.layer and report.primitive == case.primitive, report
    assert report.dtype == "float16" and report.file == __file__, report


@SLOW
@pytest.mark.parametrize("name", NAMES)
def test_float16_report_agrees_with_brute_force(name):
    case, trains = ZOO[name], truth(name)
    table = ls.float16_report(case.loss_fn, *case.args, scale=2.0**15)
    assert table.fits == bool(trains), table
    if not trains:
        assert table.max_scale is None
        return
    best = 2.0 ** max(trains)
    assert best / 2 <= table.max_scale <= best, (table.max_scale, best)
    assert not table.hypothetical
    assert [r.headroom for r in table.rows] == sorted(r.headroom for r in table.rows)


# ------------------------------------------------- the defects of issue 32, one test each
# Each of these failed on the tools before issue 32 (checked against commit 36c0fbd).


def test_a_finfo_min_mask_that_becomes_minus_inf_is_a_note_not_the_overflow():
    case = ZOO["nnx_causal_lm_finfo_min_mask"]
    report = ls.find_overflow(case.loss_fn, *case.args, scale=2.0**10)
    assert not report, report
    # -65504 minus the row max rounds to -inf in float16; exp(-inf) = 0 masks it
    assert any(n.startswith("forward sub") and "attn" in n for n in report.notes), report
    assert "harmless" in str(report)
    # Nor does it top the readiness table: the mask fill and its -inf are left out, and
    # the tightest row is a real cotangent (the head's, at 2**15).
    table = ls.float16_report(case.loss_fn, *case.args, scale=2.0**15)
    assert all(r.forward_max < 65504 for r in table.rows), table
    assert table.rows[0].backward_headroom == table.rows[0].headroom >= 0, table
    assert any("mask fill" in n for n in table.notes) and table.fits, table


def test_softmax_where_on_finite_inputs_is_not_an_overflow():
    case = ZOO["plain_softmax_where"]
    assert not ls.find_overflow(case.loss_fn, *case.args, scale=2.0**10)


@SLOW
def test_eqx_layernorm_is_healthy_and_a_later_blocks_overflow_is_named():
    healthy = ZOO["eqx_layernorm"]
    assert not ls.find_overflow(healthy.loss_fn, *healthy.args)  # jnp.var's NaN: selected
    broken = ZOO["eqx_second_block_after_layernorm"]
    report = ls.find_overflow(broken.loss_fn, *broken.args)
    assert report.inputs_finite and report.primitive == "dot_general", report
    assert report.layer.startswith("blocks.1"), report


def test_a_minus_inf_mask_does_not_hide_a_real_backward_overflow():
    case = ZOO["linen_inf_mask_and_backward"]
    report = ls.find_overflow(case.loss_fn, *case.args, scale=2.0**15)
    assert (report.phase, report.primitive) == ("backward", "dot_general"), report
    assert "LinenMaskedAmp/amp" in report.layer and report.reaches == "gradients", report
    assert report.notes  # the -inf mask, masked away


class LinenBigNorm(nn.Module):
    """Activations of a few hundred: flax's float32 BatchNorm / LayerNorm statistics (their
    squares, up to about 1e6) pass 65504, harmlessly, inside a float16 model."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, dtype=F16, name="up", kernel_init=nn.initializers.normal(300.0))(x)
        x = nn.BatchNorm(use_running_average=False, dtype=F16, name="bn")(x) + nn.LayerNorm(
            dtype=F16, name="ln")(x)
        return nn.Dense(D, dtype=F16, name="out")(nn.relu(x))


@SLOW
def test_float32_statistics_of_a_float16_model_are_held_to_float32s_range():
    case = linen_case(LinenBigNorm(), X[0] - X[0].mean(0), stats=True)
    trains = brute_force(case)
    assert trains and max(trains) >= 12  # it trains at 2**12 and more
    table = ls.float16_report(case.loss_fn, *case.args, scale=2.0**15)
    assert table.fits and 2.0 ** max(trains) / 2 <= table.max_scale <= 2.0 ** max(trains)
    float32_rows = [r for r in table.rows if r.op.endswith("f32")]
    assert all(r.headroom > 100 for r in float32_rows), table  # float32's range, not 65504
    assert "fits float16" in str(table) and "NOT" not in str(table)


class MaskedLM32(nn.Module):
    """The float32 version of a masked-attention model whose q.k einsum would overflow."""

    @nn.compact
    def __call__(self, x):
        q = nn.Dense(D, use_bias=False, name="q",
                     kernel_init=lambda *_: 200.0 * jnp.eye(D) + 1.0)(x)
        h = causal_attention(q, q, q, scaled=False, fill=jnp.finfo(F32).min)
        return nn.LayerNorm(name="ln")(h)


@SLOW
def test_a_float32_model_gets_no_verdict_and_its_mask_fill_is_not_a_row():
    case = linen_case(MaskedLM32(), jnp.abs(X.astype(F32)))
    table = ls.float16_report(case.loss_fn, *case.args, scale=1.0)
    assert all(r.headroom > -100 for r in table.rows), table  # finfo(float32).min: -112
    assert table.fits is None and table.max_scale is None and table.hypothetical
    assert "Pass the float16 version" in str(table)
    assert any("mask fill" in n for n in table.notes), table.notes
    # the einsum that would overflow float16 tops the table
    assert table.rows[0].op.startswith("dot_general") and table.rows[0].headroom < 0, table
