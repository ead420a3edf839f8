"""Equinox: ls.value_and_grad on eqx Modules, ls.equinox.apply_gradients, stateful layers.

The same shape of test as tests/test_nnx.py: a float16-compute / float32-params CNN with
eqx.nn.Conv2d, eqx.nn.BatchNorm (its statistics in an eqx.nn.State) and eqx.nn.Dropout
(a key per step), trained 52 steps with overflows injected into the backward pass only,
and checked step by step against the same step written with eqx.filter_value_and_grad
and a bare optax.adam (the loss scaled and the gradients unscaled by hand).
"""

import bitwise
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loss_scaling as ls

eqx = pytest.importorskip("equinox")

MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, eqx.filter_jit],
                                    ids=["eager", "jit"])
F16, F32 = jnp.float16, jnp.float32
LR = 1e-2
INIT_SCALE, GROWTH_INTERVAL = 2.0**20, 8     # 2**20 overflows float16 at first
POISONED = {3, 11, 12, 25, 26, 27, 40, 49}
STEPS = 52


@jax.custom_vjp
def overflow_if(x, poison):
    """Identity; its cotangent is inf where ``poison`` > 0 (an injected overflow)."""
    return x


def _overflow_fwd(x, poison):
    return x, poison


def _overflow_bwd(poison, ct):
    return jnp.where(poison > 0, jnp.full_like(ct, jnp.inf), ct), jnp.zeros_like(poison)


overflow_if.defvjp(_overflow_fwd, _overflow_bwd)


class CNN(eqx.Module):
    """Conv -> BatchNorm -> relu -> Dropout -> Linear, on one example (vmap it)."""

    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    drop: eqx.nn.Dropout
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(1, 4, 3, key=k1)
        self.bn = eqx.nn.BatchNorm(4, axis_name="batch", momentum=0.9, mode="ema")
        self.drop = eqx.nn.Dropout(0.25)
        self.out = eqx.nn.Linear(4 * 6 * 6, 3, key=k2)

    def __call__(self, x, state, key, poison):
        h, state = self.bn(self.conv(x).astype(F32), state)   # statistics in float32
        h = self.drop(jax.nn.relu(h.astype(F16)), key=key)
        return overflow_if(self.out(h.reshape(-1)), poison), state


def make():
    return eqx.nn.make_with_state(CNN)(jax.random.key(0))


def half(model):
    """float16 compute: the float32 params cast on the way in (grads flow back as float32)."""
    return jax.tree.map(lambda a: a.astype(F16) if eqx.is_inexact_array(a) else a, model)


def loss_fn(model, state, x, y, key, poison):
    keys = jax.random.split(key, x.shape[0])
    logits, state = jax.vmap(half(model), axis_name="batch", in_axes=(0, None, 0, None),
                             out_axes=(0, None))(x.astype(F16), state, keys, poison)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), y).mean()
    return loss, state


def data(step):
    key = jax.random.fold_in(jax.random.key(42), step)
    x = jax.random.normal(key, (8, 1, 8, 8), F32)
    y = jnp.argmax(x.reshape(8, -1) @ jax.random.normal(jax.random.key(7), (64, 3)), -1)
    return x, y, jax.random.fold_in(jax.random.key(1), step)   # the step's dropout key


def make_tx():
    return ls.with_loss_scaling(
        optax.adam(LR), ls.DynamicLossScale(init_scale=INIT_SCALE,
                                            growth_interval=GROWTH_INTERVAL))


def params_of(model):
    return eqx.filter(model, eqx.is_inexact_array)


def bits(tree):
    return bitwise.bits(params_of(tree))


def assert_bit_identical(a_bits, tree):
    bitwise.assert_bit_identical(a_bits, params_of(tree))


def assert_close(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(jax.tree.leaves(params_of(a)), jax.tree.leaves(params_of(b)), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# ------------------------------------------------------------- value_and_grad semantics


@MAYBE_JIT
def test_value_and_grad_on_an_eqx_module_is_filtered_and_threads_the_state(maybe_jit):
    scale = 2.0**10
    model, state = make()
    tx = ls.with_loss_scaling(optax.sgd(LR), ls.StaticLossScale(scale))
    opt_state = tx.init(params_of(model))
    x, y, key = data(0)
    poison = jnp.zeros((), F32)

    @maybe_jit
    def ours(opt_state, model, state):
        return ls.value_and_grad(loss_fn, has_aux=True)(opt_state, model, state, x, y, key,
                                                        poison)

    @maybe_jit
    def by_hand(model, state):
        def scaled(model):
            loss, state_ = loss_fn(model, state, x, y, key, poison)
            return loss * scale, (loss, state_)
        (_, aux), grads = eqx.filter_value_and_grad(scaled, has_aux=True)(model)
        return aux, grads

    (loss, new_state), grads = ours(opt_state, model, state)
    (true_loss, true_state), true_grads = by_hand(model, state)
    assert float(loss) == float(true_loss)                 # the unscaled loss
    assert grads.bn.ema_state_index is None or jax.tree.leaves(grads.bn.ema_state_index) == []
    assert grads.drop.p == true_grads.drop.p               # non-arrays: left as in eqx
    assert jax.tree.structure(grads) == jax.tree.structure(true_grads)
    bitwise.assert_bit_identical(bitwise.bits(true_grads), grads)
    bitwise.assert_bit_identical(bitwise.bits(true_state), new_state)
    with pytest.raises(AssertionError):                    # BatchNorm's statistics moved
        bitwise.assert_bit_identical(bitwise.bits(state), new_state)
    # The same through ls.equinox.filter_value_and_grad, which ls.value_and_grad calls.
    (loss2, _), grads2 = maybe_jit(ls.equinox.filter_value_and_grad(loss_fn, has_aux=True))(
        opt_state, model, state, x, y, key, poison)
    assert float(loss2) == float(loss)
    bitwise.assert_bit_identical(bitwise.bits(grads), grads2)


def test_a_wrong_first_argument_says_what_it_must_be():
    model, state = make()
    x, y, key = data(0)
    with pytest.raises(ValueError, match="takes the loss scale first"):
        ls.value_and_grad(loss_fn, has_aux=True)(model, state, x, y, key, jnp.zeros(()))


# ------------------------------------------------------------------ the training run


def wrapper_step(fused):
    tx = make_tx()

    @eqx.filter_jit
    def step(model, state, opt_state, x, y, key, poison):
        (loss, state), grads = ls.value_and_grad(loss_fn, has_aux=True)(
            opt_state, model, state, x, y, key, poison)
        if fused:
            model, opt_state = ls.equinox.apply_gradients(tx, grads, opt_state, model,
                                                          loss=loss)
        else:
            updates, opt_state = tx.update(grads, opt_state, params_of(model), loss=loss)
            model = eqx.apply_updates(model, updates)
        return model, state, opt_state, loss, ls.metrics(opt_state)

    return tx, step


@eqx.filter_jit
def reference_step(model, state, adam_state, scale, x, y, key, poison):
    """eqx.filter_value_and_grad and a bare optax.adam; loss scaling written by hand."""
    def scaled(model):
        loss, state_ = loss_fn(model, state, x, y, key, poison)
        return loss * scale, (loss, state_)

    (_, (loss, state)), grads = eqx.filter_value_and_grad(scaled, has_aux=True)(model)
    grads = jax.tree.map(lambda g: g * (1 / scale), grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    updates, new_adam = optax.adam(LR).update(grads, adam_state, params_of(model))
    new_model = eqx.apply_updates(model, updates)
    model, adam_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b),
                                     (params_of(new_model), new_adam),
                                     (params_of(model), adam_state))
    return model, state, adam_state, loss, finite


def run(fused, steps=STEPS):
    tx, step = wrapper_step(fused)
    model, state = make()
    opt_state = tx.init(params_of(model))
    record = {"applied": [], "losses": [], "lockstep": []}
    for i in range(steps):
        x, y, key = data(i)
        poison = jnp.asarray(float(i in POISONED), F32)
        scale = ls.get_loss_scale(opt_state).loss_scale
        ref = reference_step(model, state, opt_state.inner_state, scale, x, y, key, poison)
        model, state, opt_state, loss, m = step(model, state, opt_state, x, y, key, poison)
        ref_params, ref_state, ref_adam, ref_loss, finite = ref
        record["applied"].append(bool(m["last_step_applied"]))
        record["losses"].append(float(loss))
        record["lockstep"].append(dict(
            decision=bool(finite) == bool(m["last_step_applied"]),
            loss=np.isclose(float(loss), float(ref_loss), rtol=1e-6, atol=0),
            state=all(np.array_equal(a, b) for a, b in zip(
                bitwise.bits(ref_state), bitwise.bits(state), strict=True)),
            params=all(np.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(
                jax.tree.leaves((ref_params, ref_adam)),
                jax.tree.leaves((params_of(model), opt_state.inner_state)), strict=True))))
    return model, state, opt_state, record


@pytest.fixture(scope="module")
def runs():
    return {fused: run(fused) for fused in (False, True)}


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_training_matches_filter_value_and_grad_without_the_wrapper(fused, runs):
    model, state, opt_state, record = runs[fused]
    skipped = {i for i, ok in enumerate(record["applied"]) if not ok}
    assert POISONED < skipped and 0 in skipped        # and natural overflows at 2**20
    # Step by step from the same state: the same skip decision; BatchNorm's State bit
    # for bit (the forward pass is kept on a skipped step, as without the wrapper);
    # params and adam's state to rounding.
    assert all(all(r.values()) for r in record["lockstep"]), [
        (i, r) for i, r in enumerate(record["lockstep"]) if not all(r.values())]
    m = ls.metrics(opt_state)
    assert int(m["skipped_steps"]) == len(skipped)
    assert np.mean(record["losses"][-15:]) < 0.85 * np.mean(record["losses"][:15])
    assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(params_of(model)))


def test_plain_and_fused_paths_agree(runs):
    # Over the whole run: the same skip decisions and scales (params only loosely: see
    # tests/test_nnx.py; the step-by-step test below is the tight one).
    (_, _, o_plain, plain), (_, _, o_fused, fused) = runs[False], runs[True]
    assert plain["applied"] == fused["applied"]
    mp, mf = ls.metrics(o_plain), ls.metrics(o_fused)
    assert all(np.array_equal(mp[k], mf[k]) for k in mp)
    np.testing.assert_allclose(plain["losses"], fused["losses"], rtol=2e-2)


def test_plain_and_fused_paths_agree_step_by_step():
    (_, plain_step), (_, fused_step) = wrapper_step(False), wrapper_step(True)
    tx = make_tx()
    model, state = make()
    opt_state = tx.init(params_of(model))
    for i in range(12):
        x, y, key = data(i)
        poison = jnp.asarray(float(i in POISONED), F32)
        p_model, p_state, p_opt, p_loss, p_m = plain_step(model, state, opt_state, x, y, key,
                                                          poison)
        model, state, opt_state, loss, m = fused_step(model, state, opt_state, x, y, key,
                                                      poison)
        bitwise.assert_bit_identical(bitwise.bits((p_state, p_loss, p_m)), (state, loss, m))
        assert_close(p_model, model)
        for a, b in zip(jax.tree.leaves(p_opt), jax.tree.leaves(opt_state), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert int(ls.metrics(opt_state)["skipped_steps"]) >= 4          # steps 0-3 skipped


@MAYBE_JIT
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_skipped_step_keeps_the_forward_pass_state_and_nothing_else(fused, maybe_jit):
    tx, _ = wrapper_step(fused)
    model, state = make()
    opt_state = tx.init(params_of(model))
    x, y, key = data(0)

    @maybe_jit
    def step(model, state, opt_state):
        (loss, state), grads = ls.value_and_grad(loss_fn, has_aux=True)(
            opt_state, model, state, x, y, key, jnp.ones((), F32))   # overflow injected
        if fused:
            model, opt_state = ls.equinox.apply_gradients(tx, grads, opt_state, model)
        else:
            updates, opt_state = tx.update(grads, opt_state, params_of(model))
            model = eqx.apply_updates(model, updates)
        return model, state, opt_state

    before = bits(model), bitwise.bits(opt_state.inner_state)
    new_model, new_state, opt_state = step(model, state, opt_state)
    assert_bit_identical(before[0], new_model)
    bitwise.assert_bit_identical(before[1], opt_state.inner_state)
    forward = maybe_jit(eqx.filter_value_and_grad(loss_fn, has_aux=True))
    (_, forward_state), _ = forward(model, state, x, y, key, jnp.zeros(()))
    bitwise.assert_bit_identical(bitwise.bits(forward_state), new_state)   # kept
    assert float(ls.get_loss_scale(opt_state).loss_scale) == INIT_SCALE / 2
    assert new_model.drop.p == model.drop.p and new_model.bn.axis_name == "batch"


# ------------------------------------------- integer and bool arrays (not trained)


class Masked(eqx.Module):
    """A linear layer behind a stored int mask and a bool mask (as a causal mask is)."""

    lin: eqx.nn.Linear
    keep: jax.Array    # int32
    causal: jax.Array  # bool

    def __init__(self, key):
        self.lin = eqx.nn.Linear(4, 4, key=key)
        self.keep = jnp.array([1, 0, 1, 1], jnp.int32)
        self.causal = jnp.tril(jnp.ones((4, 4), bool))

    def __call__(self, x, poison):
        h = jnp.where(self.causal, self.lin.weight.astype(F16), 0) @ x.astype(F16)
        return overflow_if(h * self.keep + self.lin.bias.astype(F16), poison)


def masked_loss(model, x, poison):
    return jnp.mean((jax.vmap(model, in_axes=(0, None))(x, poison).astype(F32) - 1.0) ** 2)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_int_and_bool_array_leaves_are_not_trained_and_a_skip_keeps_everything(fused):
    model = Masked(jax.random.key(0))
    tx = ls.with_loss_scaling(optax.adam(1e-1), ls.DynamicLossScale(init_scale=2.0**8))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    x = jax.random.normal(jax.random.key(1), (8, 4))

    @eqx.filter_jit
    def step(model, opt_state, poison):
        loss, grads = ls.value_and_grad(masked_loss)(opt_state, model, x, poison)
        if fused:
            model, opt_state = ls.equinox.apply_gradients(tx, grads, opt_state, model,
                                                          loss=loss)
        else:  # the plain recipe of docs/equinox.md
            params = eqx.filter(model, eqx.is_inexact_array)
            updates, opt_state = tx.update(grads, opt_state, params, loss=loss)
            model = eqx.apply_updates(model, updates)
        return model, opt_state, loss

    losses = []
    for i in range(6):
        before = bitwise.bits((model, opt_state.inner_state))
        model, opt_state, loss = step(model, opt_state, jnp.asarray(float(i == 2), F32))
        losses.append(float(loss))
        if i == 2:  # the injected overflow: skipped, every array bit-identical
            assert not bool(ls.metrics(opt_state)["last_step_applied"])
            bitwise.assert_bit_identical(before, (model, opt_state.inner_state))
    assert int(ls.metrics(opt_state)["skipped_steps"]) == 1
    assert losses[-1] < 0.5 * losses[0]
    assert model.keep.dtype == jnp.int32 and model.causal.dtype == jnp.bool_
    np.testing.assert_array_equal(model.keep, [1, 0, 1, 1])
    np.testing.assert_array_equal(model.causal, np.tril(np.ones((4, 4), bool)))


def test_a_state_initialised_on_is_array_of_a_model_with_int_leaves_is_refused_clearly():
    model = Masked(jax.random.key(0))
    tx = ls.with_loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    loss, grads = ls.value_and_grad(masked_loss)(opt_state, model, jnp.ones((2, 4)),
                                                 jnp.zeros((), F32))
    with pytest.raises(ValueError, match=r"eqx.is_inexact_array.*") as info:
        ls.equinox.apply_gradients(tx, grads, opt_state, model)
    assert "keep" in str(info.value) and "causal" in str(info.value)


@pytest.mark.parametrize("has_aux, match", [
    (True, r"has_aux=True.*pair `\(loss, aux\)`.*loss_fn returned an array of shape \(\)"),
    (False, r"has_aux=False.*scalar loss only.*returned a tuple of 2 elements.*"
            r"pass has_aux=True"),
])
@MAYBE_JIT
def test_value_and_grad_has_aux_misuse_names_has_aux_and_the_output(has_aux, match, maybe_jit):
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    opt_state = ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(8.0)).init(
        eqx.filter(model, eqx.is_inexact_array))

    def loss_fn(model):
        loss = jnp.sum(model(jnp.ones(2)) ** 2)
        return loss if has_aux else (loss, jnp.float32(3.0))   # the other one than declared

    grad_fn = maybe_jit(ls.value_and_grad(loss_fn, has_aux=has_aux))
    with pytest.raises(TypeError, match=match) as info:
        grad_fn(opt_state, model)
    assert "24" not in str(info.value)                         # the aux, scaled, not shown


@MAYBE_JIT
def test_a_model_frozen_in_part_trains_only_its_trainable_arrays(maybe_jit):
    """Equinox's freezing recipe: eqx.partition(model, filter_spec), the optimizer on the
    trainable part. The fused step matches optax + eqx.apply_updates; a skip keeps all."""
    model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
    spec = jax.tree.map(lambda _: False, model)
    spec = eqx.tree_at(lambda m: m.layers[-1], spec,
                       replace=jax.tree.map(eqx.is_inexact_array, model.layers[-1]))
    tx = ls.with_loss_scaling(optax.adam(0.1), ls.StaticLossScale(4.0))
    opt_state = tx.init(eqx.filter(model, spec))
    diff, static = eqx.partition(model, spec)

    def loss_fn(diff, static, x):
        return jnp.mean(jax.vmap(eqx.combine(diff, static))(x) ** 2)

    x = jnp.ones((4, 3))
    _, grads = ls.value_and_grad(loss_fn)(opt_state, diff, static, x)
    step = maybe_jit(ls.equinox.apply_gradients)
    new_model, _ = step(tx, grads, opt_state, model)
    updates, _ = tx.update(grads, opt_state, eqx.filter(model, spec))
    bitwise.assert_trees_close_in_ulps(params_of(new_model),
                                       params_of(eqx.apply_updates(model, updates)))
    assert_bit_identical(bits(model.layers[0]), new_model.layers[0])  # frozen
    assert not np.array_equal(model.layers[-1].weight, new_model.layers[-1].weight)
    bad = jax.tree.map(lambda g: g * jnp.inf, grads)
    skipped, state = step(tx, bad, opt_state, model)
    assert_bit_identical(bits(model), skipped)
    assert int(ls.metrics(state)["skipped_steps"]) == 1
    with pytest.raises(ValueError, match=r"grads must have the model's structure"):
        ls.equinox.apply_gradients(tx, {"w": jnp.ones(2)}, opt_state, model)
