"""flax nnx as a first-class citizen: ls.value_and_grad on real layers, ls.nnx.Optimizer.

The model computes in float16 with float32 params and has a Conv, BatchNorm, Dropout and
a custom counter Variable. Overflows are injected into the backward pass only (an
identity whose cotangent is inf on flagged steps), so the forward pass, and with it
BatchNorm's statistics and the Dropout RNG stream, is the same whether a step is applied
or skipped. The reference runs are written with plain ``nnx.value_and_grad`` and a bare
``nnx.Optimizer``: the loss scaled and the gradients unscaled by hand, the scale kept on
the host by the same rule, the update left out on the steps the wrapper skips.
"""


import bitwise
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import loss_scaling as ls

MAYBE_JIT = pytest.mark.parametrize("maybe_jit", [lambda f: f, nnx.jit], ids=["eager", "jit"])
F16, F32 = jnp.float16, jnp.float32
LR = 1e-2
INIT_SCALE, GROWTH_INTERVAL = 2.0**20, 8   # 2**20 overflows float16 at first
POISONED = {3, 11, 12, 25, 26, 27, 40, 51}   # steps whose backward pass overflows
STEPS = 56


def keyless(tree):
    """Typed PRNG keys (nnx's RngKey) as their raw data, so that they can be compared."""
    is_key = lambda x: jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)  # noqa: E731
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def bits(tree):
    return bitwise.bits(keyless(tree))


def assert_bit_identical(a_bits, tree):
    bitwise.assert_bit_identical(a_bits, keyless(tree))


class Counter(nnx.Variable):
    """A custom mutable variable: neither a Param nor BatchStat nor RngState."""


@jax.custom_vjp
def overflow_if(x, poison):
    """Identity; its cotangent is inf where ``poison`` > 0 (an injected overflow)."""
    return x


def _overflow_fwd(x, poison):
    return x, poison


def _overflow_bwd(poison, ct):
    return jnp.where(poison > 0, jnp.full_like(ct, jnp.inf), ct), jnp.zeros_like(poison)


overflow_if.defvjp(_overflow_fwd, _overflow_bwd)


class CNN(nnx.Module):
    """float16 compute, float32 params: Conv -> BatchNorm -> relu -> Dropout -> Linear."""

    def __init__(self, rngs: nnx.Rngs):
        kw = dict(dtype=F16, param_dtype=F32, rngs=rngs)
        self.conv = nnx.Conv(1, 4, (3, 3), padding="VALID", **kw)
        self.bn = nnx.BatchNorm(4, momentum=0.9, **kw)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(4 * 6 * 6, 3, **kw)
        self.calls = Counter(jnp.zeros((), jnp.int32))

    def __call__(self, x, poison):
        self.calls[...] += 1
        h = self.drop(nnx.relu(self.bn(self.conv(x.astype(F16)))))
        return overflow_if(self.out(h.reshape(h.shape[0], -1)), poison).astype(F32)


def make_model():
    return CNN(nnx.Rngs(params=0, dropout=1))


def data(step):
    """A small generated classification batch (a fixed linear teacher), per step."""
    key = jax.random.fold_in(jax.random.key(42), step)
    x = jax.random.normal(key, (8, 8, 8, 1), F32)
    y = jnp.argmax(x.reshape(8, -1) @ jax.random.normal(jax.random.key(7), (64, 3)), -1)
    return x, y


def loss_fn(model, x, y, poison):
    logits = model(x, poison)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def scaler():
    return ls.DynamicLossScale(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def make_optimizer(model, fused, tx=None):
    tx = tx or ls.with_loss_scaling(optax.adam(LR), scaler())
    return (ls.nnx.Optimizer if fused else nnx.Optimizer)(model, tx, wrt=nnx.Param)


def other_state(model):
    """Everything but the Params: BatchNorm statistics, RNG streams, the counter."""
    return nnx.state(model, nnx.Not(nnx.Param))


# ------------------------------------------------------------- value_and_grad semantics


@MAYBE_JIT
def test_value_and_grad_threads_rng_and_batch_stats_exactly_like_nnx(maybe_jit):
    scale = 2.0**10
    ours, theirs = make_model(), make_model()
    optimizer = make_optimizer(ours, fused=False,
                               tx=ls.with_loss_scaling(optax.sgd(LR), ls.StaticLossScale(scale)))
    x, y = data(0)
    poison = jnp.zeros((), F32)

    @maybe_jit
    def with_wrapper(optimizer, model):
        return ls.value_and_grad(loss_fn)(optimizer, model, x, y, poison)

    @maybe_jit
    def by_hand(model):
        def scaled(model):
            loss = loss_fn(model, x, y, poison)
            return loss * scale, loss
        (_, loss), grads = nnx.value_and_grad(scaled, has_aux=True)(model)
        return loss, grads

    before = bits(other_state(ours))
    loss, grads = with_wrapper(optimizer, ours)
    true_loss, true_grads = by_hand(theirs)
    assert np.asarray(loss).tobytes() == np.asarray(true_loss).tobytes()  # unscaled loss
    assert jax.tree.structure(grads) == jax.tree.structure(true_grads)     # only Params
    assert_bit_identical(bits(true_grads), grads)                          # scaled grads
    assert_bit_identical(bits(other_state(theirs)), other_state(ours))     # threaded state
    assert int(ours.calls[...]) == 1 and int(ours.drop.rngs.count[...]) == 1
    with pytest.raises(AssertionError):   # ... and it did change: stats, RNG count, counter
        assert_bit_identical(before, other_state(ours))


def test_value_and_grad_returns_aux_and_differentiates_several_arguments():
    scale = 4.0
    a, b = make_model(), make_model()
    optimizer = make_optimizer(a, fused=True,
                               tx=ls.with_loss_scaling(optax.sgd(LR), ls.StaticLossScale(scale)))
    x, y = data(1)
    w = jnp.ones(())

    def fn(model, w):
        loss = loss_fn(model, x, y, jnp.zeros(()))
        return loss * w, {"loss": loss}

    (loss, aux), (g_model, g_w) = ls.value_and_grad(fn, argnums=(0, 1), has_aux=True)(
        optimizer, a, w)
    def by_hand(model, w):
        loss, aux = fn(model, w)
        return loss * scale, aux

    (_, true_aux), (t_model, t_w) = nnx.value_and_grad(by_hand, argnums=(0, 1),
                                                       has_aux=True)(b, w)
    assert float(loss) == float(true_aux["loss"]) == float(aux["loss"])
    assert_bit_identical(bits((t_model, t_w)), (g_model, g_w))
    assert_bit_identical(bits(other_state(b)), other_state(a))


def test_value_and_grad_uses_the_optimizers_wrt_filter():
    model = make_model()
    only_out = nnx.All(nnx.Param, nnx.PathContains("out"))
    optimizer = ls.nnx.Optimizer(
        model, ls.with_loss_scaling(optax.sgd(LR), ls.StaticLossScale(64.0)), wrt=only_out)
    x, y = data(2)
    conv_before = bits(nnx.state(model.conv))
    out_before = bits(nnx.state(model.out))
    _, grads = ls.value_and_grad(loss_fn)(optimizer, model, x, y, jnp.zeros(()))
    assert set(grads.keys()) == {"out"}
    optimizer.update(model, grads)
    assert_bit_identical(conv_before, nnx.state(model.conv))  # not in wrt: untouched
    # ls.nnx.value_and_grad's wrt= overrides the default (nnx.Param for a bare scaler).
    _, grads = ls.nnx.value_and_grad(loss_fn, wrt=only_out)(
        ls.StaticLossScale(2.0), model, x, y, jnp.zeros(()))
    assert set(grads.keys()) == {"out"}
    _, grads = ls.value_and_grad(loss_fn)(ls.StaticLossScale(2.0), model, x, y, jnp.zeros(()))
    assert set(grads.keys()) == {"conv", "bn", "out"}
    with pytest.raises(AssertionError):
        assert_bit_identical(out_before, nnx.state(model.out))


@pytest.mark.parametrize("call", ["model_first", "forgot_optimizer", "array_first",
                                  "params_dict_first", "no_loss_scale"])
def test_a_wrong_first_argument_says_what_it_must_be(call):
    model = make_model()
    optimizer = make_optimizer(model, fused=True)
    x, y = data(0)
    p = jnp.zeros(())
    fn = ls.value_and_grad(loss_fn)
    args = {
        "model_first": (model, optimizer, x, y, p),
        "forgot_optimizer": (model, x, y, p),
        "array_first": (x, model, y, p),
        "params_dict_first": ({"w": x}, model, x, y, p),
        "no_loss_scale": (nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param), model, x, y, p),
    }[call]
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args)
    message = str(info.value)
    assert "takes the loss scale first" in message
    assert "ls.value_and_grad(loss_fn)(optimizer, model, *args)" in message
    if call in ("model_first", "forgot_optimizer"):
        assert info.type is TypeError and "CNN" in message and "model first" in message
    if call == "no_loss_scale":
        assert "with_loss_scaling" in message


def test_plain_pytrees_keep_jax_value_and_grad():
    s = ls.StaticLossScale(8.0)
    loss, grads = ls.value_and_grad(lambda w: jnp.sum(w**2))(s, jnp.array([1.0, 2.0]))
    assert float(loss) == 5.0 and grads.tolist() == [16.0, 32.0]


# ----------------------------------------------------------------- skipped steps


@MAYBE_JIT
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_skipped_step_keeps_the_forward_pass_updates_and_nothing_else(fused, maybe_jit):
    """Documented: params and optimizer state bit-identical; BatchNorm statistics, RNG
    counts and counters keep the forward pass's update (as with nnx.value_and_grad)."""
    model, twin = make_model(), make_model()
    optimizer = make_optimizer(model, fused)
    x, y = data(0)

    @maybe_jit
    def step(optimizer, model, poison):
        loss, grads = ls.value_and_grad(loss_fn)(optimizer, model, x, y, poison)
        optimizer.update(model, grads)
        return loss

    @maybe_jit
    def forward_only(model):
        return nnx.value_and_grad(loss_fn)(model, x, y, jnp.zeros(()))

    params = bits(nnx.state(model, nnx.Param))
    opt_inner = bits(optimizer.opt_state.inner_state)
    step(optimizer, model, jnp.ones((), F32))              # overflow injected: skipped
    forward_only(twin)
    m = ls.metrics(optimizer)
    assert not bool(m["last_step_applied"]) and int(m["skipped_steps"]) == 1
    assert float(m["loss_scale"]) == INIT_SCALE / 2
    assert int(optimizer.step[...]) == 1                   # counts every call
    assert_bit_identical(params, nnx.state(model, nnx.Param))
    assert_bit_identical(opt_inner, optimizer.opt_state.inner_state)
    assert_bit_identical(bits(other_state(twin)), other_state(model))  # forward pass kept
    assert int(model.calls[...]) == 1 and int(model.drop.rngs.count[...]) == 1


# ------------------------------------------------------ 56 steps against the reference


@nnx.jit
def ref_grads_of(model, x, y, poison, scale):
    """The scaled loss's gradients by hand, unscaled, and whether they are finite."""
    def scaled(model):
        loss = loss_fn(model, x, y, poison)
        return loss * scale, loss
    (_, loss), grads = nnx.value_and_grad(scaled, has_aux=True)(model)
    grads = jax.tree.map(lambda g: g * (1 / scale), grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    return loss, grads, finite


@nnx.jit
def ref_apply(optimizer, model, grads):
    optimizer.update(model, grads)


def reference_run(steps=STEPS):
    """nnx.value_and_grad + a bare nnx.Optimizer(adam), loss scaling written by hand."""
    model = make_model()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    scale, tracker, applied, losses = INIT_SCALE, 0, [], []
    for i in range(steps):
        x, y = data(i)
        poison = jnp.asarray(float(i in POISONED), F32)
        loss, grads, finite = ref_grads_of(model, x, y, poison, jnp.float32(scale))
        losses.append(float(loss))
        if bool(finite):
            ref_apply(optimizer, model, grads)
            tracker += 1
            if tracker == GROWTH_INTERVAL:
                scale, tracker = scale * 2, 0
        else:
            scale, tracker = scale / 2, 0
        applied.append(bool(finite))
    return model, optimizer, {"scale": scale, "tracker": tracker, "applied": applied,
                              "losses": losses}


def wrapper_run(fused, steps=STEPS, model=None, optimizer=None, start=0, lockstep=False):
    """The wrapped run. With ``lockstep``, every step is also taken by the reference
    (``nnx.value_and_grad``, a bare ``nnx.Optimizer(adam)``, scaling by hand) from a clone
    of the same state: the same skip decision; BatchNorm statistics, RNG state and
    counter bit for bit; loss, params and adam's state to rounding (other XLA programs)."""
    model = model or make_model()
    optimizer = optimizer or make_optimizer(model, fused)

    @nnx.jit
    def step(optimizer, model, x, y, poison):
        loss, grads = ls.value_and_grad(loss_fn)(optimizer, model, x, y, poison)
        optimizer.update(model, grads, loss=loss)
        return loss, ls.metrics(optimizer)

    def is_var(x):
        return isinstance(x, nnx.Variable)

    applied, losses, lockstep_equal = [], [], []
    if lockstep:
        twin = nnx.clone(model)
        ref_opt = nnx.Optimizer(twin, optax.adam(LR), wrt=nnx.Param)
    for i in range(start, steps):
        x, y = data(i)
        poison = jnp.asarray(float(i in POISONED), F32)
        if lockstep:   # the reference's step from the same state
            nnx.update(twin, nnx.state(model))
            for dst, src in zip(jax.tree.leaves(ref_opt.opt_state, is_leaf=is_var),
                                jax.tree.leaves(optimizer.opt_state.inner_state, is_leaf=is_var),
                                strict=True):
                dst.set_value(src.get_value())
            scale = ls.get_loss_scale(optimizer).loss_scale
        loss, m = step(optimizer, model, x, y, poison)
        applied.append(bool(m["last_step_applied"]))
        losses.append(float(loss))
        if lockstep:
            twin_loss, grads, finite = ref_grads_of(twin, x, y, poison, scale)
            if bool(finite):
                ref_apply(ref_opt, twin, grads)
            lockstep_equal.append(
                bool(finite) == applied[-1]
                and np.isclose(float(loss), float(twin_loss), rtol=1e-6, atol=0)
                and all(np.array_equal(a, b) for a, b in zip(
                    bits(other_state(twin)), bits(other_state(model)), strict=True))
                and all(np.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(
                    jax.tree.leaves((nnx.state(twin, nnx.Param), nnx.as_pure(ref_opt.opt_state))),
                    jax.tree.leaves((nnx.state(model, nnx.Param),
                                     nnx.as_pure(optimizer.opt_state.inner_state))),
                    strict=True)))
    return model, optimizer, {"applied": applied, "losses": losses,
                              "lockstep_equal": lockstep_equal}


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.fixture(scope="module")
def runs():
    # The fused run is checked step by step against the reference; the plain one against
    # the fused one (test_plain_and_fused_paths_agree_step_by_step).
    return {fused: wrapper_run(fused, lockstep=fused) for fused in (False, True)}


def assert_close(a, b, rtol=1e-3, atol=1e-4):
    for x, y in zip(jax.tree.leaves(keyless(a)), jax.tree.leaves(keyless(b)), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                                   rtol=rtol, atol=atol)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_training_matches_nnx_value_and_grad_without_the_wrapper(fused, reference, runs):
    ref_model, ref_opt, ref = reference
    model, optimizer, run = runs[fused]
    # The same steps skipped: every injected overflow, plus the natural float16 overflows
    # the growth provokes (the scale climbs every 8 clean steps).
    assert run["applied"] == ref["applied"]
    skipped = {i for i, ok in enumerate(ref["applied"]) if not ok}
    assert POISONED < skipped and 0 in skipped        # natural overflows: 2**20 is too big
    m = ls.metrics(optimizer)
    assert float(m["loss_scale"]) == ref["scale"] and int(m["growth_tracker"]) == ref["tracker"]
    assert int(m["skipped_steps"]) == len(skipped)
    assert int(optimizer.step[...]) == STEPS
    # RNG streams and the counter advance exactly as without the wrapper (every forward).
    rng = nnx.state(model, nnx.RngState)
    assert_bit_identical(bits(nnx.state(ref_model, nnx.RngState)), rng)
    assert int(model.drop.rngs.count[...]) == STEPS and int(model.calls[...]) == STEPS
    # Step by step, from the same state: the same skip decision; the forward pass's
    # updates (BatchNorm statistics, RNG state, counter) bit for bit; params and adam's
    # state to rounding (a few ulps).
    if fused:
        assert len(run["lockstep_equal"]) == STEPS and all(run["lockstep_equal"])
    # Over the whole run, only loosely: float16 compute turns a last-bit difference in a
    # float32 param into a float16 rounding difference, and 56 adam steps amplify it.
    assert_close(nnx.state(ref_model, nnx.BatchStat), nnx.state(model, nnx.BatchStat),
                 rtol=0.1, atol=2e-2)
    assert_close(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param),
                 rtol=0.1, atol=2e-2)
    np.testing.assert_allclose(run["losses"], ref["losses"], rtol=2e-2)
    assert np.mean(ref["losses"][-15:]) < 0.85 * np.mean(ref["losses"][:15])  # it learned


def test_plain_and_fused_paths_agree(runs):
    (_, o_plain, plain), (_, o_fused, fused) = runs[False], runs[True]
    # Over the whole run: the same skip decisions and scales. (Params only to adam's
    # amplified rounding: a last-bit difference in a near-zero gradient is a whole
    # learning-rate step for adam; the step-by-step test below is the tight one.)
    assert plain["applied"] == fused["applied"]
    mp, mf = ls.metrics(o_plain), ls.metrics(o_fused)
    assert all(np.array_equal(mp[k], mf[k]) for k in mp if k != "grad_norm")
    # The last gradients' norm: of params equal only up to that rounding (the losses too).
    np.testing.assert_allclose(mp["grad_norm"], mf["grad_norm"], rtol=2e-2)
    np.testing.assert_allclose(plain["losses"], fused["losses"], rtol=2e-2)


@pytest.mark.parametrize("steps", [12])
def test_plain_and_fused_paths_agree_step_by_step(steps):
    model = make_model()
    fused_opt = make_optimizer(model, fused=True)

    @nnx.jit
    def step(optimizer, model, x, y, poison):
        loss, grads = ls.value_and_grad(loss_fn)(optimizer, model, x, y, poison)
        optimizer.update(model, grads, loss=loss)
        return loss

    twin = nnx.clone(model)
    plain_opt = make_optimizer(twin, fused=False)
    for i in range(steps):
        nnx.update(twin, nnx.state(model))                 # the same state, plain path
        nnx.update(plain_opt, nnx.state(fused_opt))
        x, y = data(i)
        poison = jnp.asarray(float(i in POISONED), F32)
        step(fused_opt, model, x, y, poison)
        step(plain_opt, twin, x, y, poison)
        assert_bit_identical(bits(other_state(twin)), other_state(model))
        assert_bit_identical(bits(ls.metrics(plain_opt)), ls.metrics(fused_opt))
        assert_close(nnx.state(twin, nnx.Param), nnx.state(model, nnx.Param),
                     rtol=1e-6, atol=1e-7)
        assert_close(nnx.as_pure(plain_opt.opt_state), nnx.as_pure(fused_opt.opt_state),
                     rtol=1e-6, atol=1e-9)
    assert int(ls.metrics(fused_opt)["skipped_steps"]) >= 4       # steps 0-3 were skipped


# ---------------------------------------- lookup, restore and Orbax resume through nnx


def holders(optimizer):
    return {"optimizer": optimizer, "state": nnx.state(optimizer),
            "split": nnx.split(optimizer)[1]}


def lookup_holders(optimizer, model):
    """holders(), and the dicts an Orbax checkpoint of model and optimizer saves."""
    return {**holders(optimizer),
            "checkpoint": {"model": nnx.state(model), "optimizer": nnx.state(optimizer)},
            "split_pair": {"model": nnx.split(model)[1],
                           "optimizer": nnx.split(optimizer)[1]},
            "nested": {"run": [nnx.state(model), {"opt": nnx.state(optimizer)}]}}


LOOKUP_HOLDERS = ["optimizer", "state", "split", "checkpoint", "split_pair", "nested"]


@pytest.mark.parametrize("holder", LOOKUP_HOLDERS)
def test_get_loss_scale_and_metrics_accept_the_optimizer_its_state_and_split(holder):
    model = make_model()
    optimizer = make_optimizer(model, fused=True)
    wrapper_run(True, steps=4, model=model, optimizer=optimizer)   # step 3 is poisoned
    source = lookup_holders(optimizer, model)[holder]
    s = ls.get_loss_scale(source)
    assert isinstance(s, ls.DynamicLossScale) and s.growth_interval == GROWTH_INTERVAL
    expected = ls.get_loss_scale(optimizer)
    assert_bit_identical(bits(expected), s)
    m = ls.metrics(source)
    assert int(m["skipped_steps"]) >= 1 and float(m["loss_scale"]) == float(expected.loss_scale)
    assert ls.state_dict(s) == ls.state_dict(expected)


def test_a_plain_nnx_optimizers_state_is_refused_naming_the_fix():
    # Issue 41: no config-less scaler is built from it (metrics and check refused it too
    # only halfway); the optimizer itself, or ls.nnx.Optimizer's state, has the config.
    optimizer = make_optimizer(make_model(), fused=False)
    state = nnx.state(optimizer)
    for read in (ls.get_loss_scale, ls.metrics, ls.check):
        with pytest.raises(ValueError, match="loss_scaling.nnx.Optimizer.*Pass the optimizer "
                                             "itself instead"):
            read(state)
    assert ls.get_loss_scale(optimizer).growth_interval == GROWTH_INTERVAL
    assert float(ls.metrics(optimizer)["loss_scale"]) == INIT_SCALE
    assert ls.check(optimizer) is None
    fused = nnx.state(make_optimizer(make_model(), fused=True))
    assert ls.get_loss_scale(fused).growth_interval == GROWTH_INTERVAL


@pytest.mark.parametrize("holder", ["optimizer", "state", "split"])
def test_restore_loss_scale_on_nnx(holder):
    saved = ls.state_dict(ls.update(ls.update(scaler(), False), True))   # 16384, tracker 1
    optimizer = make_optimizer(make_model(), fused=True)
    source = holders(optimizer)[holder]
    out = ls.restore_loss_scale(source, saved)
    s = ls.get_loss_scale(out)
    assert (float(s.loss_scale), int(s.growth_tracker)) == (INIT_SCALE / 2, 1)
    if holder == "optimizer":
        assert out is optimizer                                    # set in place
    else:
        assert float(ls.get_loss_scale(optimizer).loss_scale) == INIT_SCALE  # not modified
        nnx.update(optimizer, out)
        assert float(ls.get_loss_scale(optimizer).loss_scale) == INIT_SCALE / 2
    other = ls.state_dict(ls.DynamicLossScale(init_scale=2.0, growth_interval=3))
    with pytest.raises(ValueError, match="growth_interval"):
        ls.restore_loss_scale(source, other)


@pytest.mark.parametrize("holder", ["optimizer", "state"])
def test_a_failed_scaler_restored_into_nnx_fails_the_wrapper(holder):
    # The wrapper's register is the one a step and ls.check read: the restore carries the
    # scaler's failure code into it.
    failed = jax.jit(ls.update)(ls.DynamicLossScale(   # under jit: recorded, not raised
        init_scale=2.0**-126, growth_interval=GROWTH_INTERVAL), False)
    optimizer = make_optimizer(make_model(), fused=True)
    out = ls.restore_loss_scale(holders(optimizer)[holder], ls.state_dict(failed))
    assert int(ls.metrics(out)["failure"]) == ls.Failure.BACKOFF_UNDERFLOW
    with pytest.raises(ls.LossScaleError, match="loss scale backoff failed"):
        ls.check(out)


def test_orbax_resume_is_bit_identical_to_the_uninterrupted_run(tmp_path, runs):
    model, optimizer, _ = runs[True]                 # the uninterrupted fused run
    half = 26                                        # inside a run of poisoned steps
    m1 = make_model()
    o1 = make_optimizer(m1, fused=True)
    wrapper_run(True, steps=half, model=m1, optimizer=o1)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(half, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"model": nnx.state(m1), "optimizer": nnx.state(o1)}),
            loss_scale=ocp.args.JsonSave(ls.state_dict(ls.get_loss_scale(o1)))))
        mngr.wait_until_finished()
        del m1, o1
        m2 = CNN(nnx.Rngs(params=123, dropout=456))  # a fresh run, other seeds
        o2 = make_optimizer(m2, fused=True)
        target = {"model": nnx.state(m2), "optimizer": nnx.state(o2)}
        restored = mngr.restore(half, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), loss_scale=ocp.args.JsonRestore()))
    opt_state = ls.restore_loss_scale(restored.state["optimizer"], restored.loss_scale)
    nnx.update(m2, restored.state["model"])
    nnx.update(o2, opt_state)
    wrapper_run(True, steps=STEPS, model=m2, optimizer=o2, start=half)
    assert_bit_identical(bits(nnx.state(model)), nnx.state(m2))
    assert_bit_identical(bits(nnx.state(optimizer)), nnx.state(o2))


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_check_reads_a_failure_from_the_optimizer_its_state_and_split(fused):
    model = make_model()
    tx = ls.with_loss_scaling(optax.adam(LR), ls.DynamicLossScale(init_scale=2.0**-126))
    optimizer = make_optimizer(model, fused, tx=tx)
    # A plain nnx.Optimizer's state holds no configuration: only the optimizer itself.
    sources = lookup_holders(optimizer, model) if fused else {"optimizer": optimizer}
    for source in sources.values():
        assert ls.check(source) is None
    step = nnx.jit(lambda optimizer, model, x, y, poison: optimizer.update(
        model, ls.value_and_grad(loss_fn)(optimizer, model, x, y, poison)[1]))
    x, y = data(0)
    params = bits(nnx.state(model, nnx.Param))
    step(optimizer, model, x, y, jnp.ones((), F32))   # overflow: the backoff underflows
    step(optimizer, model, x, y, jnp.zeros((), F32))  # sticky: this clean step is skipped
    assert_bit_identical(params, nnx.state(model, nnx.Param))
    for source in sources.values():
        assert bool(ls.metrics(source)["failed"])
        with pytest.raises(ls.LossScaleError, match="(?i)backoff"):
            ls.check(source)


def test_ls_nnx_optimizer_without_loss_scaling_is_a_plain_nnx_optimizer():
    ours, theirs = make_model(), make_model()
    a = ls.nnx.Optimizer(ours, optax.sgd(0.1), wrt=nnx.Param)
    b = nnx.Optimizer(theirs, optax.sgd(0.1), wrt=nnx.Param)
    x, y = data(0)
    for optimizer, model in ((a, ours), (b, theirs)):
        grads = nnx.grad(loss_fn)(model, x, y, jnp.zeros(()))
        optimizer.update(model, grads)
    assert_bit_identical(bits(nnx.state(theirs)), nnx.state(ours))
    assert int(a.step[...]) == int(b.step[...]) == 1


@pytest.mark.parametrize("underflow_diagnostics", [False, True])
def test_metrics_through_nnx_state_equal_the_optimizers(underflow_diagnostics):
    model = make_model()
    tx = ls.with_loss_scaling(optax.adam(LR), scaler(),
                              underflow_diagnostics=underflow_diagnostics)
    optimizer = make_optimizer(model, fused=True, tx=tx)
    wrapper_run(True, steps=6, model=model, optimizer=optimizer)
    expected = ls.metrics(optimizer)
    for source in holders(optimizer).values():
        got = ls.metrics(source)
        assert got.keys() == expected.keys()
        assert_bit_identical(bits(expected), got)


@pytest.mark.parametrize("has_aux, match", [
    (True, r"has_aux=True.*pair `\(loss, aux\)`.*loss_fn returned an array of shape \(\)"),
    (False, r"has_aux=False.*scalar loss only.*returned a tuple of 2 elements.*"
            r"pass has_aux=True"),
])
@MAYBE_JIT
def test_value_and_grad_has_aux_misuse_names_has_aux_and_the_output(has_aux, match, maybe_jit):
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = ls.nnx.Optimizer(
        model, ls.with_loss_scaling(optax.sgd(0.1), ls.StaticLossScale(8.0)), wrt=nnx.Param)

    def loss_fn(model):
        loss = jnp.sum(model(jnp.ones((1, 2))) ** 2)
        return loss if has_aux else (loss, jnp.float32(3.0))   # the other one than declared

    grad_fn = maybe_jit(ls.value_and_grad(loss_fn, has_aux=has_aux))
    with pytest.raises(TypeError, match=match) as info:
        grad_fn(optimizer, model)
    assert "24" not in str(info.value)                         # the aux, scaled, not shown


@MAYBE_JIT
def test_update_with_the_arguments_swapped_is_refused_and_changes_nothing(maybe_jit):
    model = make_model()
    optimizer = make_optimizer(model, fused=True)
    x, y = data(0)
    _, grads = ls.value_and_grad(loss_fn)(optimizer, model, x, y, jnp.zeros(()))
    before = bits((nnx.state(model), nnx.state(optimizer)))
    swapped = maybe_jit(lambda optimizer, model, grads: optimizer.update(grads, model))
    with pytest.raises(TypeError, match=r"`grads` is a Module \(CNN\) and `model` an "
                                        r"nnx.State: the two are swapped.*update\(model, grads\)"):
        swapped(optimizer, model, grads)
    with pytest.raises(TypeError, match=r"`model` must be the nnx Module, got .*dict"):
        optimizer.update({"w": jnp.ones(2)}, grads)
    assert_bit_identical(before, (nnx.state(model), nnx.state(optimizer)))
