"""``ls.autocast``: the rules, everywhere in the program, outputs, frameworks, composition,
bad input and the report. Programs are read with the tests' own walker (jaxpr_walk.py),
never by asking autocast what it did."""

from __future__ import annotations

import functools
from typing import Any

import chex
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax import lax, shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxpr_walk import casts, equations, flops_by_dtype, half_fraction, reading_half

import loss_scaling as ls
from loss_scaling.autocast.rules import RULES, Rule

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
maybe_jit = pytest.mark.parametrize("maybe_jit", [lambda f: f, jax.jit], ids=["eager", "jit"])


def prims(jaxpr: Any, name: str) -> list[Any]:
    return [e for e, _ in equations(jaxpr) if e.primitive.name == name]


def dtypes_in(eqn: Any) -> list[str]:
    return [str(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype")]


def dtypes_out(eqn: Any) -> list[str]:
    return [str(v.aval.dtype) for v in eqn.outvars]


W = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
X = jnp.linspace(-2.0, 2.0, 8).reshape(2, 4)


# -- the rules ------------------------------------------------------------------------------

@maybe_jit
def test_a_matmul_runs_in_half_and_the_output_keeps_its_dtype(maybe_jit: Any) -> None:
    f = ls.autocast(lambda w, x: x @ w)
    out = maybe_jit(f)(W, X)
    assert out.dtype == F32
    np.testing.assert_allclose(out, X @ W, rtol=2e-3, atol=2e-3)
    (dot,) = prims(jax.make_jaxpr(f)(W, X), "dot_general")
    assert dtypes_in(dot) == ["float16", "float16"] and dtypes_out(dot) == ["float16"]


@pytest.mark.parametrize("name, fn", [
    ("exp", jnp.exp), ("log", lambda h: jnp.log(jnp.abs(h) + 1.0)), ("rsqrt", lambda h: lax.rsqrt(
        jnp.abs(h) + 1.0)), ("reduce_sum", jnp.sum), ("cumsum", lambda h: jnp.cumsum(h, axis=1)),
    ("integer_pow", lambda h: h ** 3), ("pow", lambda h: jnp.abs(h) ** 1.5),
    ("reduce_prod", lambda h: jnp.prod(h, axis=1)), ("log1p", lambda h: jnp.log1p(jnp.abs(h))),
])
def test_range_sensitive_ops_read_float32(name: str, fn: Any) -> None:
    f = ls.autocast(lambda w, x: fn(x @ w))
    jaxpr = jax.make_jaxpr(f)(W, X)
    ops = prims(jaxpr, name)
    assert ops and all(dtypes_in(e)[0] == "float32" for e in ops)
    np.testing.assert_allclose(f(W, X), fn(X @ W), rtol=5e-3, atol=5e-3)


def test_elementwise_ops_run_in_the_widest_operand_dtype() -> None:
    def fn(w, x, b):
        h = x @ w  # half
        return jnp.tanh(h) * 2.0, h + b, jnp.maximum(h, 0.0)

    jaxpr = jax.make_jaxpr(ls.autocast(fn))(W, X, jnp.ones((2, 3)))
    (tanh,) = prims(jaxpr, "tanh")
    assert dtypes_in(tanh) == ["float16"]  # one operand keeps its dtype
    (mul,) = prims(jaxpr, "mul")
    assert dtypes_in(mul) == ["float16", "float16"]  # a literal that fits follows
    (add,) = prims(jaxpr, "add")
    assert dtypes_out(add) == ["float32"]  # half meets float32 at float32
    (mx,) = prims(jaxpr, "max")
    assert dtypes_out(mx) == ["float16"]


@pytest.mark.parametrize("literal", [1e-8, 1e5, -7e4, 3e-6])
def test_a_literal_the_half_dtype_cannot_hold_is_never_rounded(literal: float) -> None:
    f = ls.autocast(lambda w, x: (x @ w) * 0.0 + literal)
    out = f(W, X)
    np.testing.assert_array_equal(out, np.full((2, 3), np.float32(literal)))
    (add,) = prims(jax.make_jaxpr(f)(W, X), "add")
    assert dtypes_in(add) == ["float32", "float32"]


def test_a_literal_alone_is_a_float32_constant() -> None:
    jaxpr = jax.make_jaxpr(ls.autocast(lambda w, x: x @ w + jnp.ones((2, 3))))(W, X)
    (ones,) = [e for e in prims(jaxpr, "broadcast_in_dim") if not e.invars[0].aval.shape]
    assert dtypes_out(ones) == ["float32"]


def test_rms_norm_with_an_eps_on_rows_of_zeros_is_finite() -> None:
    def rms(w, x):
        h = x @ w
        return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-8)

    x = X.at[0].set(0.0)
    out, grad = jax.value_and_grad(lambda w: ls.autocast(rms)(w, x).sum())(W)
    assert np.isfinite(out) and np.isfinite(grad).all()
    # the same norm hand-cast to float16 (eps rounded to 0) is not
    h16 = x.astype(F16) @ W.astype(F16)
    by_hand = h16 * lax.rsqrt(jnp.mean(h16 * h16, -1, keepdims=True) + F16(1e-8))
    assert not np.isfinite(by_hand).all()


def test_ints_bools_complex_float64_keys_and_user_converts_are_never_touched() -> None:
    def fn(w, x, key, idx, c):
        h = x @ w
        noise = jax.random.normal(key, h.shape)  # float32 random bits, as written
        picked = jnp.take(h, idx, axis=1)  # integer indices
        mask = h > 0  # bool
        z = c @ c  # complex matmul
        bf = (x.astype(BF16) @ w.astype(BF16))  # the user's own bfloat16
        return h + noise, picked, mask, z, bf, idx * 2

    key = jax.random.key(0)
    idx = jnp.array([0, 2])
    c = (X[:, :2] + 1j * X[:, 2:]).astype(jnp.complex64)
    c = jnp.concatenate([c, c], axis=0)[:2, :2]
    jaxpr = jax.make_jaxpr(ls.autocast(fn))(W, X, key, idx, c)
    dots = prims(jaxpr, "dot_general")
    assert sorted(tuple(dtypes_in(d)) for d in dots) == sorted([
        ("float16", "float16"), ("complex64", "complex64"), ("bfloat16", "bfloat16")])
    out = ls.autocast(fn)(W, X, key, idx, c)
    ref = fn(W, X, key, idx, c)
    for a, b in zip(out, ref, strict=True):
        assert a.dtype == b.dtype
    np.testing.assert_array_equal(out[5], ref[5])
    np.testing.assert_array_equal(out[3], ref[3])
    np.testing.assert_array_equal(out[4], ref[4])


def test_float64_runs_as_written() -> None:
    with jax.enable_x64(True):
        w, x = W.astype(jnp.float64), X.astype(jnp.float64)
        jaxpr = jax.make_jaxpr(ls.autocast(lambda w, x: jnp.exp(x @ w)))(w, x)
        for eqn, _ in equations(jaxpr):
            assert "float16" not in dtypes_in(eqn) + dtypes_out(eqn), eqn


@pytest.mark.parametrize("half", [F16, BF16], ids=["float16", "bfloat16"])
def test_bfloat16_works_the_same(half: Any) -> None:
    f = ls.autocast(lambda w, x: jnp.sum(jax.nn.log_softmax(x @ w)), dtype=half)
    (dot,) = prims(jax.make_jaxpr(f)(W, X), "dot_general")
    assert dtypes_in(dot) == [str(jnp.dtype(half))] * 2
    loss, grad = jax.value_and_grad(f)(W, X)
    ref = jax.value_and_grad(lambda w, x: jnp.sum(jax.nn.log_softmax(x @ w)))(W, X)
    assert loss.dtype == F32 and grad.dtype == F32
    np.testing.assert_allclose(loss, ref[0], rtol=2e-2)


class _Unknown:
    """A primitive no table names: it runs as written and the report marks it."""

    prim = jax.extend.core.Primitive("my_scaled_softsign")

    @staticmethod
    def impl(x: Any) -> Any:
        return x / (1.0 + jnp.abs(x))


_Unknown.prim.def_impl(_Unknown.impl)
_Unknown.prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
jax.interpreters.mlir.register_lowering(
    _Unknown.prim, jax.interpreters.mlir.lower_fun(_Unknown.impl, multiple_results=False))


def test_an_unknown_primitive_runs_as_written_and_the_report_marks_it() -> None:
    def fn(w, x):
        return _Unknown.prim.bind(x @ w)

    assert "my_scaled_softsign" not in RULES
    jaxpr = jax.make_jaxpr(ls.autocast(fn))(W, X)
    (eqn,) = prims(jaxpr, "my_scaled_softsign")
    assert dtypes_in(eqn) == ["float32"]
    np.testing.assert_allclose(ls.autocast(fn)(W, X), fn(W, X), rtol=2e-3, atol=2e-3)
    report = ls.autocast_report(fn, W, X)
    (row,) = report.unknown
    assert row.primitive == "my_scaled_softsign" and row.rule is ls.AutocastRule.UNKNOWN
    assert "unknown primitives (run as written): my_scaled_softsign" in str(report)


# -- everywhere in the program ----------------------------------------------------------------

def test_nested_jit_keeps_its_shardings_donation_and_name() -> None:
    @functools.partial(jax.jit, donate_argnums=(0,), inline=False)
    def helper(h, w):
        return jnp.exp(h @ w)

    def fn(w, x):
        return helper(x @ w, jnp.ones((3, 3)))

    old = prims(jax.make_jaxpr(fn)(W, X), "jit")[0]
    (new,) = [e for e in prims(jax.make_jaxpr(ls.autocast(fn))(W, X), "jit")
              if e.params["name"] == "helper"]
    for key in ("donated_invars", "in_shardings", "out_shardings", "name", "inline"):
        assert new.params[key] == old.params[key], key
    (dot,) = prims(new.params["jaxpr"], "dot_general")
    assert dtypes_in(dot) == ["float16", "float16"]
    np.testing.assert_allclose(ls.autocast(fn)(W, X), fn(W, X), rtol=1e-2)


def test_a_scan_keeps_its_carry_dtype_and_casts_an_invariant_weight_once_outside() -> None:
    def fn(w, x):
        def body(c, _):
            return jnp.tanh(c @ w), jnp.sum(c)

        return lax.scan(body, x @ w, None, length=5)  # the carry starts half, as a matmul

    w = jnp.eye(4) * 0.5
    jaxpr = jax.make_jaxpr(ls.autocast(fn))(w, X)
    (scan,) = prims(jaxpr, "scan")
    body = scan.params["jaxpr"].jaxpr
    carry = body.invars[scan.params["num_consts"]:][:scan.params["num_carry"]]
    assert [str(v.aval.dtype) for v in carry] == ["float32"]
    assert [str(v.aval.dtype) for v in body.outvars[:1]] == ["float32"]
    # the weight is cast to float16 once, outside the loop; inside only the carry is
    outside = [e for e, r in casts(jaxpr, "float32", "float16") if r == 1]
    inside = [e for e, r in casts(jaxpr, "float32", "float16") if r == 5]
    assert [e.invars[0].aval.shape for e in outside] == [(2, 4), (4, 4)]  # x, and w once
    assert [e.invars[0].aval.shape for e in inside] == [(2, 4)]  # the carry, each step
    (pin,) = [e for e, r in casts(jaxpr, "float16", "float32") if r == 1]  # entry: float32
    out, ys = ls.autocast(fn)(w, X)
    ref, ref_ys = fn(w, X)
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-3)


def test_the_gradient_of_a_loop_invariant_weight_accumulates_in_float32() -> None:
    def fn(w, x):
        return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=64)[0].sum()

    w = jnp.eye(4) * 0.9
    grad_jaxpr = jax.make_jaxpr(jax.grad(ls.autocast(fn)))(w, X)
    scans = prims(grad_jaxpr, "scan")
    # no scan carries a float16 (4, 4) value: the weight's gradient sums in float32
    for s in scans:
        body = s.params["jaxpr"].jaxpr
        carry = body.invars[s.params["num_consts"]:][:s.params["num_carry"]]
        assert ("float16", (4, 4)) not in [(str(v.aval.dtype), v.aval.shape) for v in carry]
    g = jax.grad(ls.autocast(fn))(w, X)
    ref = jax.grad(fn)(w, X)
    assert g.dtype == F32
    np.testing.assert_allclose(g, ref, rtol=3e-2, atol=3e-2)


def test_while_and_fori_loops_keep_their_carries() -> None:
    def fn(w, x):
        def body(i, c):
            return jnp.tanh(c @ w) + i

        c = lax.fori_loop(0, 3, body, x)
        return lax.while_loop(lambda c: jnp.sum(c) < 100.0, lambda c: c * 2.0 + 1.0, c)

    w = jnp.eye(4)
    out = jax.jit(ls.autocast(fn))(w, X)
    assert out.dtype == F32
    np.testing.assert_allclose(out, fn(w, X), rtol=1e-2, atol=1e-2)


def test_cond_branches_meet_at_the_widest_dtype() -> None:
    def fn(w, x, pred):
        h = x @ w
        return lax.cond(pred, lambda h: h * 2.0, lambda h: jnp.exp(h), h)

    jaxpr = jax.make_jaxpr(ls.autocast(fn))(W, X, True)
    (cond,) = prims(jaxpr, "cond")
    assert [str(v.aval.dtype) for v in cond.outvars] == ["float32"]
    for pred in (True, False):
        np.testing.assert_allclose(ls.autocast(fn)(W, X, pred), fn(W, X, pred), rtol=1e-2)


def test_checkpoint_keeps_its_policy_and_names() -> None:
    from jax.ad_checkpoint import checkpoint_name

    policy = jax.checkpoint_policies.save_only_these_names("hidden")

    def fn(w, x):
        @functools.partial(jax.checkpoint, policy=policy)
        def block(x):
            return jnp.sum(jnp.sin(checkpoint_name(x @ w, "hidden")))

        return block(x)

    jaxpr = jax.make_jaxpr(ls.autocast(fn))(W, X)
    (remat,) = prims(jaxpr, "remat2")
    assert remat.params["policy"] is policy
    (name,) = prims(jaxpr, "name")
    assert name.params["name"] == "hidden" and dtypes_in(name) == ["float16"]
    g = jax.grad(ls.autocast(fn))(W, X)
    np.testing.assert_allclose(g, jax.grad(fn)(W, X), rtol=2e-2, atol=2e-2)


def test_shard_map_is_rewritten_inside() -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def fn(w, x):
        @functools.partial(shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        def step(w, x):
            return lax.psum(jnp.sum(jnp.exp(x @ w)), "data")

        return step(w, x)

    jaxpr = jax.make_jaxpr(ls.autocast(fn))(W, X)
    (dot,) = prims(jaxpr, "dot_general")
    assert dtypes_in(dot) == ["float16", "float16"]
    np.testing.assert_allclose(ls.autocast(fn)(W, X), fn(W, X), rtol=1e-2)


def test_a_custom_jvp_rule_is_kept_and_sees_the_dtypes_it_was_written_for() -> None:
    seen: list[Any] = []

    @jax.custom_jvp
    def softclip(x):
        seen.append(x.dtype)
        return jnp.tanh(x)

    @softclip.defjvp
    def softclip_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        seen.append(x.dtype)
        return softclip(x), 3.0 * t  # not tanh's derivative: the rule is the author's

    def fn(w, x):
        return jnp.sum(softclip(x @ w))

    g = jax.grad(ls.autocast(fn))(W, X)
    np.testing.assert_allclose(g, jax.grad(fn)(W, X), rtol=1e-2)
    np.testing.assert_allclose(g, 3.0 * X.T @ jnp.ones((2, 3)), rtol=1e-2)
    assert set(seen) == {jnp.dtype(F32)}


def test_a_custom_vjp_rule_is_kept_and_its_matmuls_run_in_half() -> None:
    @jax.custom_vjp
    def linear(x, w):
        return x @ w

    def fwd(x, w):
        assert x.dtype == F32 and w.dtype == F32  # the dtypes the author wrote it for
        return x @ w, (x, w)

    def bwd(res, g):
        x, w = res
        return 0.5 * g @ w.T, 0.5 * x.T @ g  # half the true gradient: the author's rule

    linear.defvjp(fwd, bwd)

    def fn(w, x):
        return jnp.sum(linear(x, w))

    f = ls.autocast(fn)
    g = jax.grad(f)(W, X)
    np.testing.assert_allclose(g, 0.5 * X.T @ jnp.ones((2, 3)), rtol=1e-2)
    grad_jaxpr = jax.make_jaxpr(jax.grad(f))(W, X)
    assert half_fraction(grad_jaxpr) == 1.0, flops_by_dtype(grad_jaxpr)


# -- outputs ----------------------------------------------------------------------------------

def test_outputs_keep_the_dtypes_the_function_gives_them() -> None:
    def fn(w, x):
        h = x @ w
        return {"f32": h, "bf16": h.astype(BF16), "i": jnp.argmax(h, -1), "b": h > 0}

    out = ls.autocast(fn)(W, X)
    ref = fn(W, X)
    assert jax.tree.map(lambda a: a.dtype, out) == jax.tree.map(lambda a: a.dtype, ref)


def test_float32_params_get_float32_gradients() -> None:
    params = {"w": W, "b": jnp.zeros(3)}
    grads = jax.grad(ls.autocast(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]))))(params, X)
    chex.assert_trees_all_equal_dtypes(grads, params)


def test_traced_once_per_input_signature() -> None:
    calls: list[int] = []

    def fn(w, x, scale=1.0):
        calls.append(1)
        return x @ w * scale

    f = ls.autocast(fn)
    f(W, X)
    f(W + 1.0, X)
    jax.jit(f)(W, X)
    assert len(calls) == 1
    f(W, X, scale=2.0)  # a Python float is static, as equinox.filter_jit treats it
    f(W[:, :2], X)
    assert len(calls) == 3


# -- frameworks -------------------------------------------------------------------------------

class _LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(2)(nn.relu(x))


def test_linen_apply_with_mutable_and_rngs() -> None:
    model = _LinenBN()
    x = jnp.linspace(-1, 1, 24).reshape(6, 4)
    variables = model.init(jax.random.key(0), x, train=False)
    rngs = {"dropout": jax.random.key(1)}
    out, updates = ls.autocast(model.apply)(variables, x, train=True, mutable=["batch_stats"],
                                            rngs=rngs)
    ref, ref_updates = model.apply(variables, x, train=True, mutable=["batch_stats"], rngs=rngs)
    assert out.dtype == F32
    chex.assert_trees_all_equal_dtypes(updates, ref_updates)
    chex.assert_trees_all_close(updates, ref_updates, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    jaxpr = jax.make_jaxpr(lambda v: ls.autocast(model.apply)(
        v, x, train=True, mutable=["batch_stats"], rngs=rngs))(variables)
    assert half_fraction(jaxpr) == 1.0


class _NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.drop(self.bn(self.lin(x)))))


def test_nnx_stateful_layers_update_as_without_autocast() -> None:
    x = jnp.linspace(-1, 1, 24).reshape(6, 4)
    model, ref = _NnxNet(nnx.Rngs(0)), _NnxNet(nnx.Rngs(0))
    forward = ls.autocast(lambda m, x: m(x))
    for _ in range(2):
        out, expected = forward(model, x), ref(x)
        np.testing.assert_allclose(out, expected, rtol=2e-2, atol=2e-2)
    state, ref_state = nnx.state(model), nnx.state(ref)
    chex.assert_trees_all_equal_dtypes(state, ref_state)
    # RNG counts exactly; BatchNorm statistics to float16 precision
    counts = nnx.state(model, nnx.RngCount)
    chex.assert_trees_all_equal(counts, nnx.state(ref, nnx.RngCount))
    chex.assert_trees_all_close(nnx.state(model, nnx.BatchStat), nnx.state(ref, nnx.BatchStat),
                                rtol=1e-2, atol=1e-3)
    assert int(jax.tree.leaves(counts)[0]) > 0


def test_nnx_under_nnx_jit_and_value_and_grad_with_the_optimizer() -> None:
    model = _NnxNet(nnx.Rngs(0))
    optimizer = ls.nnx.Optimizer(model, ls.with_loss_scaling(optax.adam(1e-2), ls.DynamicLossScale(
        init_scale=2.0**10)), wrt=nnx.Param)
    x, y = jnp.linspace(-1, 1, 24).reshape(6, 4), jnp.zeros((6, 2))

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = ls.value_and_grad(ls.autocast(loss_fn))(optimizer, model)
        optimizer.update(model, grads, loss=loss)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(20)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    ls.check(optimizer)


class _EqxNet(eqx.Module):
    mlp: eqx.nn.MLP
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(4, 2, 8, 2, activation=jax.nn.gelu, key=key)
        self.norm = eqx.nn.LayerNorm(4)

    def __call__(self, x):
        return self.mlp(self.norm(x))


def test_equinox_modules_trace_their_arrays_and_keep_the_rest_static() -> None:
    model = _EqxNet(jax.random.key(0))
    calls: list[int] = []

    def loss_fn(model, x):
        calls.append(1)
        return jnp.mean(jax.vmap(model)(x) ** 2)

    f = ls.autocast(loss_fn)
    loss, grads = eqx.filter_value_and_grad(f)(model, X)
    ref, ref_grads = eqx.filter_value_and_grad(loss_fn)(model, X)
    np.testing.assert_allclose(loss, ref, rtol=2e-2)
    chex.assert_trees_all_equal_dtypes(eqx.filter(grads, eqx.is_array),
                                       eqx.filter(ref_grads, eqx.is_array))
    n = len(calls)  # one trace of the autocast function (under grad), one reference call
    eqx.filter_jit(f)(model, X)
    f(model, X)
    assert n == 2 and len(calls) == n  # the same signature: the rewrite is reused


# -- composition ------------------------------------------------------------------------------

def _mlp_loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


_PARAMS = {"w1": jnp.linspace(-0.5, 0.5, 32).reshape(4, 8), "b1": jnp.zeros(8),
           "w2": jnp.linspace(-0.5, 0.5, 16).reshape(8, 2)}
_Y = jnp.ones((2, 2))


@pytest.mark.parametrize("growth", ["interval", "headroom"])
def test_with_loss_scaling_fused_step_and_ls_value_and_grad(growth: str) -> None:
    tx = ls.with_loss_scaling(optax.adam(1e-2), ls.DynamicLossScale(growth=growth))
    opt_state = tx.init(_PARAMS)

    @jax.jit
    def step(params, opt_state):
        loss, grads = ls.value_and_grad(ls.autocast(_mlp_loss))(opt_state, params, X, _Y)
        params, opt_state = ls.apply_gradients(tx, grads, opt_state, params, loss=loss)
        return params, opt_state, loss

    params = _PARAMS
    for _ in range(10):
        params, opt_state, loss = step(params, opt_state)
    ls.check(opt_state)
    assert np.isfinite(loss) and float(loss) < float(_mlp_loss(_PARAMS, X, _Y))
    chex.assert_trees_all_equal_dtypes(params, _PARAMS)


def test_replay_recomputes_with_the_autocast_loss() -> None:
    tx = ls.with_loss_scaling(optax.sgd(1e-2), ls.DynamicLossScale(init_scale=2.0**30),
                              max_replays=20)
    opt_state = tx.init(_PARAMS)
    value_fn = ls.autocast(_mlp_loss)

    @jax.jit
    def step(params, opt_state):
        loss, grads = ls.value_and_grad(value_fn)(opt_state, params, X, _Y)
        return ls.apply_gradients(tx, grads, opt_state, params, loss=loss,
                                  value_fn=lambda p: value_fn(p, X, _Y))

    params, opt_state = step(_PARAMS, opt_state)
    metrics = ls.metrics(opt_state)
    assert int(metrics["replays"]) > 0 and int(metrics["skipped_steps"]) == 0


def test_ls_train_state_with_a_linen_model() -> None:
    model = _LinenBN()
    x = jnp.linspace(-1, 1, 24).reshape(6, 4)
    variables = model.init(jax.random.key(0), x, train=False)
    state = ls.TrainState.create(apply_fn=ls.autocast(model.apply), params=variables["params"],
                                 tx=ls.with_loss_scaling(optax.adam(1e-2)))
    stats = variables["batch_stats"]

    @jax.jit
    def step(state, stats, key):
        def loss_fn(params):
            out, updates = state.apply_fn({"params": params, "batch_stats": stats}, x,
                                          train=True, mutable=["batch_stats"],
                                          rngs={"dropout": key})
            return jnp.mean(out ** 2), updates["batch_stats"]

        (loss, stats), grads = ls.value_and_grad(loss_fn, has_aux=True)(state, state.params)
        return state.apply_gradients(grads=grads, loss=loss), stats, loss

    for i in range(3):
        state, stats, loss = step(state, stats, jax.random.key(i))
    assert np.isfinite(loss)
    chex.assert_trees_all_equal_dtypes(stats, variables["batch_stats"])
    assert isinstance(state, train_state.TrainState)


def test_equinox_helpers_train_an_autocast_model() -> None:
    model = _EqxNet(jax.random.key(0))
    tx = ls.with_loss_scaling(optax.adam(1e-2))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    loss_fn = ls.autocast(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = ls.equinox.filter_value_and_grad(loss_fn)(opt_state, model, X)
        model, opt_state = ls.equinox.apply_gradients(tx, grads, opt_state, model, loss=loss)
        return model, opt_state, loss

    first = None
    for _ in range(10):
        model, opt_state, loss = step(model, opt_state)
        first = loss if first is None else first
    assert float(loss) < float(first)


def test_pmap_step() -> None:
    n = jax.local_device_count()
    f = jax.pmap(lambda w, x: jax.grad(ls.autocast(lambda w: jnp.sum(jnp.exp(x @ w))))(w))
    g = f(jnp.broadcast_to(W, (n, *W.shape)), jnp.broadcast_to(X, (n, *X.shape)))
    np.testing.assert_allclose(g[0], jax.grad(lambda w: jnp.sum(jnp.exp(X @ w)))(W), rtol=2e-2)


# -- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int16, "float8_e4m3fn", None, 16])
def test_a_dtype_that_is_not_a_16_bit_float_is_refused(dtype: Any) -> None:
    with pytest.raises(ValueError, match=r"ls.autocast\(dtype=...\) must be a 16-bit floating"):
        ls.autocast(jnp.sin, dtype=dtype)


@pytest.mark.parametrize("dtype", [jnp.float16, "float16", np.float16, jnp.bfloat16, "bfloat16"])
def test_16_bit_float_dtypes_are_accepted_in_every_spelling(dtype: Any) -> None:
    assert ls.autocast(jnp.sin, dtype=dtype).dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("policy", [{"float32": ["head"]}, "float32", ls.AutocastRule.FLOAT32])
def test_a_policy_of_the_wrong_type_is_refused(policy: Any) -> None:
    with pytest.raises(TypeError, match=r"policy=...\) must be an ls.AutocastPolicy"):
        ls.autocast(jnp.sin, policy=policy)


def test_a_non_array_output_is_refused_by_path() -> None:
    f = ls.autocast(lambda w, x: {"out": x @ w, "name": "logits"})
    with pytest.raises(TypeError, match=r"returned str 'logits' at output \['name'\]"):
        f(W, X)


def test_a_non_callable_is_refused() -> None:
    with pytest.raises(TypeError, match="needs a function"):
        ls.autocast(W)


# -- the report -------------------------------------------------------------------------------

@maybe_jit
def test_the_report_lists_each_equation_with_its_rule_dtypes_and_place(maybe_jit: Any) -> None:
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="head")(jax.nn.softmax(nn.Dense(8, name="hidden")(x)))

    model = Mlp()
    variables = model.init(jax.random.key(0), X)
    reports = []
    maybe_jit(lambda v: reports.append(ls.autocast_report(model.apply, v, X)))(variables)
    (report,) = reports
    dots = [r for r in report.rows if r.primitive == "dot_general"]
    assert [r.path for r in dots] == ["Mlp/hidden", "Mlp/head"]
    assert all(r.rule is Rule.HALF and r.in_dtypes == (F16, F16) for r in dots)
    assert all(r.source and r.source.split(":")[0].endswith("test_autocast.py") for r in dots)
    exp = next(r for r in report.rows if r.primitive == "exp")
    assert exp.rule is Rule.FLOAT32 and exp.in_dtypes == (F32,)
    assert report.flops_by_dtype() == {"float16": 2 * 2 * 4 * 8 + 2 * 2 * 8 * 2}
    text = str(report)
    assert "matmul/conv FLOPs: float16 192 (100%)" in text and "Mlp/hidden" in text
    assert "equations per rule:" in text


def test_the_report_writes_nothing_into_an_nnx_model() -> None:
    model = _NnxNet(nnx.Rngs(0))
    arrays = (nnx.Param, nnx.BatchStat, nnx.RngCount)
    before = jax.tree.map(np.asarray, nnx.state(model, *arrays))
    report = ls.autocast_report(lambda m, x: m(x), model, X)
    assert report.rows and report.half_flops_fraction() == 1.0
    chex.assert_trees_all_equal(before, jax.tree.map(np.asarray, nnx.state(model, *arrays)))


def test_the_report_of_an_autocast_function_uses_its_dtype_and_policy() -> None:
    policy = ls.AutocastPolicy(float32=("Elsewhere",))
    f = ls.autocast(lambda w, x: x @ w, dtype=BF16, policy=policy)
    (row,) = ls.autocast_report(f, W, X).rows
    assert row.in_dtypes == (jnp.dtype(BF16),) * 2


def test_every_primitive_in_the_table_has_one_rule() -> None:
    assert all(isinstance(rule, Rule) for rule in RULES.values())
    assert RULES["dot_general"] is Rule.HALF and RULES["exp"] is Rule.FLOAT32
    assert RULES["add"] is Rule.WIDEST and RULES["scan"] is Rule.LOOP
    assert Rule.UNKNOWN not in RULES.values()


def test_reading_half_helper_sees_a_hand_cast_softmax() -> None:
    # the test's own walker, checked: a float16 softmax reads exp in float16
    jaxpr = jax.make_jaxpr(lambda x: jax.nn.softmax(x.astype(F16)))(X)
    assert reading_half(jaxpr, {"exp"})


def test_a_weight_used_by_several_matmuls_is_cast_once() -> None:
    def fn(w, x):
        return jnp.sum(x @ w) + jnp.sum((2.0 * x) @ w) + jnp.sum(jnp.tanh(x) @ w)

    jaxpr = jax.make_jaxpr(ls.autocast(fn))(W, X)
    weight_casts = [e for e, _ in casts(jaxpr, "float32", "float16")
                    if e.invars[0].aval.shape == W.shape]
    assert len(weight_casts) == 1 and len(prims(jaxpr, "dot_general")) == 3


@pytest.mark.parametrize("shape", [(3,), (1, 3)], ids=["broadcast", "size_1"])
def test_a_bias_added_to_a_matmul_runs_in_half_and_its_gradient_sums_in_float32(
        shape: tuple[int, ...]) -> None:
    def fn(w, b, x):
        return jnp.sum(jnp.tanh(x @ w + b))

    b = jnp.linspace(0.1, 0.3, 3).reshape(shape)
    jaxpr = jax.make_jaxpr(ls.autocast(fn))(W, b, X)
    (add,) = prims(jaxpr, "add")
    assert dtypes_in(add) == ["float16", "float16"]  # as torch's linear adds it
    grad_jaxpr = jax.make_jaxpr(jax.grad(ls.autocast(fn), argnums=1))(W, b, X)
    sums = [e for e in prims(grad_jaxpr, "reduce_sum") if e.outvars[0].aval.size == 3]
    assert sums and all(dtypes_in(e) == ["float32"] for e in sums)
    g = jax.grad(ls.autocast(fn), argnums=1)(W, b, X)
    assert g.dtype == F32 and g.shape == shape
    np.testing.assert_allclose(g, jax.grad(fn, argnums=1)(W, b, X), rtol=1e-2, atol=1e-3)


def test_a_bias_that_is_not_a_vector_along_the_last_axis_meets_at_float32() -> None:
    def fn(w, x, mask):
        return (x @ w) + mask  # an additive mask of the result's own shape: float32

    (add,) = prims(jax.make_jaxpr(ls.autocast(fn))(W, X, jnp.full((2, 3), -1e9)), "add")
    assert dtypes_in(add) == ["float32", "float32"]
    (add,) = prims(jax.make_jaxpr(ls.autocast(lambda w, x, c: (x @ w) + c))(
        W, X, jnp.ones((2, 1))), "add")  # a column: broadcast along the first axis
    assert dtypes_in(add) == ["float32", "float32"]


# -- what a first user met (issue 39's docs pass) ----------------------------------------

def test_a_module_itself_can_be_autocast() -> None:
    linear = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    out = ls.autocast(linear)(X[0])
    np.testing.assert_allclose(out, linear(X[0]), rtol=1e-2, atol=1e-2)
    grads = jax.grad(lambda m: jnp.sum(ls.autocast(m)(X[0])))(linear)
    assert grads.weight.dtype == F32
    model, ref = _NnxNet(nnx.Rngs(0)), _NnxNet(nnx.Rngs(0))
    np.testing.assert_allclose(ls.autocast(model)(X), ref(X), rtol=2e-2, atol=2e-2)
    chex.assert_trees_all_equal(nnx.state(model, nnx.RngCount), nnx.state(ref, nnx.RngCount))


def test_integer_equations_are_never_unknown() -> None:
    model = _NnxNet(nnx.Rngs(0))  # Dropout draws bits: `or`, shifts on integers
    report = ls.autocast_report(lambda m, x: m(x), model, X)
    assert report.unknown == ()
    assert {"shift_right_logical", "or"} <= {r.primitive for r in report.rows
                                             if r.rule is Rule.AS_WRITTEN}


def test_rows_inside_a_library_function_carry_the_users_line() -> None:
    def fn(w, x):
        return jax.nn.log_softmax(x @ w)  # the line every row points to

    report = ls.autocast_report(fn, W, X)
    line = fn.__code__.co_firstlineno + 1
    assert {r.source for r in report.rows} == {f"{__file__}:{line}"}


def test_a_policy_rule_never_reaches_code_the_user_wrote_in_a_16_bit_dtype() -> None:
    policy = ls.AutocastPolicy(rules={"tanh": ls.AutocastRule.FLOAT32})
    f = ls.autocast(lambda x: jnp.tanh(x.astype(BF16)) + jnp.tanh(x), policy=policy)
    tanhs = prims(jax.make_jaxpr(f)(X), "tanh")
    assert sorted(dtypes_in(t)[0] for t in tanhs) == ["bfloat16", "float32"]


def test_a_custom_rule_that_cannot_be_rewritten_says_so_and_shows_no_half_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from loss_scaling.autocast import rewrite

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("fwd_jaxpr_thunk")

    monkeypatch.setattr(rewrite, "_pinned_thunk", broken)

    @jax.custom_vjp
    def linear(x, w):
        return x @ w

    linear.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))
    report = ls.autocast_report(lambda w, x: jnp.sum(linear(x, w)), W, X)
    (custom,) = [r for r in report.rows if r.primitive == "custom_vjp_call"]
    assert custom.rule is Rule.CUSTOM and "kept as written" in custom.note
    assert [r.in_dtypes for r in report.rows if r.primitive == "dot_general"] == []
    assert report.flops_by_dtype() == {}
    np.testing.assert_allclose(ls.autocast(lambda w, x: jnp.sum(linear(x, w)))(W, X),
                               jnp.sum(X @ W), rtol=1e-5)


def test_policy_sites_that_name_nothing_are_listed_and_paths_drop_transformations() -> None:
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="head")(x)

    model = Mlp()
    variables = model.init(jax.random.key(0), X)
    policy = ls.AutocastPolicy(float32=("head", "Mlp/head"))
    report = ls.autocast_report(ls.autocast(model.apply, policy=policy), variables, X)
    assert [s.path for s in report.unmatched] == ["head"]
    assert "policy sites that name no equation" in str(report)

    def vmapped(w, x):
        with jax.named_scope("head"):
            return jax.vmap(lambda row: row @ w)(x)

    (row,) = [r for r in ls.autocast_report(vmapped, W, X).rows if r.primitive == "dot_general"]
    assert row.path == "head"
    program = jax.make_jaxpr(ls.autocast(vmapped, policy=ls.AutocastPolicy(float32=("head",))))
    (dot,) = prims(program(W, X), "dot_general")
    assert dtypes_in(dot) == ["float32", "float32"]
