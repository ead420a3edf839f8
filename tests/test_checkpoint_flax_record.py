"""flax.serialization (loss_scaling/checkpoint/flax_record.py): a scaler's state dict is a
checked record (CRC-32), ``flax.serialization.from_bytes`` and ``ls.from_bytes`` restore it
into the target's configuration and layout, and refuse bad, corrupted or flipped bytes
naming the loss-scale state.
"""

from __future__ import annotations

import math
import re

import chex
import doc_blocks
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_states import (
    ALL_STATES,
    INF,
    MAYBE_JIT,
    NAN,
    STATES,
    assert_bit_identical,
    config_of,
    dynamic_after_overflows,
    junk,
    saved_state,
    target,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import loss_scaling as ls
from loss_scaling import state_dict

# ------------------------------------------------------------------ flax.serialization


def test_flax_state_dict_is_a_checked_record_and_names_the_leaves_of_placeholders():
    s = saved_state()
    assert flax.serialization.to_state_dict(ls.NoOpLossScale()) == {}
    record = flax.serialization.to_state_dict({"scaler": s})["scaler"]
    # magic, kind, ndim 0, four 4-byte leaves, CRC-32: 26 bytes, one msgpack bin.
    assert isinstance(record, bytes) and record[:4] == b"LSR1" and len(record) == 26
    assert record[6:10] == np.float32(s.loss_scale).tobytes()
    assert len(flax.serialization.to_state_dict(ls.StaticLossScale(2.0))) == 14
    # Placeholders have no values to check: their leaves by name, as before.
    abstract = flax.serialization.to_state_dict(jax.eval_shape(lambda: s))
    assert set(abstract) == {"loss_scale", "growth_tracker", "nonfinite_tracker", "failure"}
    assert abstract["growth_tracker"] == jax.ShapeDtypeStruct((), jnp.int32)


@ALL_STATES
def test_flax_msgpack_round_trip_inside_a_dict(make):
    s = make()
    tree = {"scaler": s, "step": jnp.int32(7)}
    encoded = flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(tree))
    # A static factor is configuration: the target must have the saved one.
    fresh_scaler = s if isinstance(s, ls.StaticLossScale) else jax.tree.map(jnp.zeros_like, s)
    fresh = {"scaler": fresh_scaler, "step": jnp.int32(0)}
    restored = flax.serialization.from_state_dict(
        fresh, flax.serialization.msgpack_restore(encoded))
    assert_bit_identical(restored["scaler"], s)
    assert_bit_identical(flax.serialization.from_bytes(fresh, flax.serialization.to_bytes(tree)),
                         jax.tree.map(jnp.asarray, tree))
    assert_bit_identical(jax.jit(ls.update)(restored["scaler"], False), ls.update(s, False))


def test_flax_restore_keeps_the_target_configuration():
    saved = saved_state()
    new = target(growth_interval=50, max_scale=None)
    restored = flax.serialization.from_bytes(new, flax.serialization.to_bytes(saved))
    assert config_of(restored) == config_of(new)
    assert float(restored.loss_scale) == float(saved.loss_scale)
    assert int(restored.growth_tracker) == 3


@pytest.mark.parametrize(
    ("state", "text"),
    [
        ({"loss_scale": np.float32(NAN), "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0},
         "loss_scale"),
        ({"loss_scale": np.float32(1e-39), "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0},
         "loss_scale"),
        ({"loss_scale": np.float32(0.01), "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0},
         "loss_scale"),                                            # below min_scale 0.1
        ({"loss_scale": np.float32(8.0), "growth_tracker": 5, "nonfinite_tracker": 0,
          "failure": 0},
         "restore_with_config"),                                   # not below growth_interval
        ({"loss_scale": np.float32(8.0), "growth_tracker": 0, "nonfinite_tracker": -1,
          "failure": 0},
         "nonfinite_tracker"),
        ({"loss_scale": np.int32(8), "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0},
         "floating"),
        ({"loss_scale": "8", "growth_tracker": 0, "nonfinite_tracker": 0,
          "failure": 0}, "loss_scale"),
        ({"loss_scale": np.float32(8.0), "growth_tracker": 0.5, "nonfinite_tracker": 0,
          "failure": 0},
         "integer"),
        ({"loss_scale": np.float32(8.0), "growth_tracker": 0}, "nonfinite_tracker"),
        ({"loss_scale": 8.0, "growth_tracker": 0, "nonfinite_tracker": 0, "x": 1}, "'x'"),
        ([8.0, 0, 0], "loss_scale"),
    ],
    ids=repr,
)
def test_flax_restore_refuses_bad_state_with_its_path(state, text):
    with pytest.raises(ValueError) as info:
        flax.serialization.from_state_dict({"opt": {"scaler": saved_state()}},
                                           {"opt": {"scaler": state}})
    assert "'./opt/scaler'" in str(info.value)
    assert text in str(info.value)


def test_flax_restore_into_placeholder_targets():
    s = saved_state()
    state = flax.serialization.to_state_dict(s)
    for placeholder in (jax.tree.map(lambda _: None, s), jax.eval_shape(lambda: s)):
        assert_bit_identical(flax.serialization.from_state_dict(placeholder, state), s)


def test_flax_round_trip_of_a_wrapped_optax_state():
    params = {"w": jnp.array([1.0, -2.0, 3.0])}
    tx = ls.with_loss_scaling(optax.adam(0.1), ls.DynamicLossScale(
        init_scale=2.0**10, growth_interval=2, hysteresis=2))
    opt_state = tx.init(params)
    for grads in ([1.0, 2.0, 3.0], [NAN, 0.0, 1.0], [INF, 0.0, 0.0], [0.5, 0.5, 0.5]):
        updates, opt_state = tx.update({"w": jnp.array(grads)}, opt_state, params)
        params = optax.apply_updates(params, updates)
    encoded = flax.serialization.to_bytes((params, opt_state))
    restored = flax.serialization.from_bytes((params, tx.init(params)), encoded)
    chex.assert_trees_all_equal(restored, (params, opt_state))
    chex.assert_trees_all_equal_dtypes(restored, (params, opt_state))
    assert_bit_identical(ls.get_loss_scale(restored[1]), ls.get_loss_scale(opt_state))
    assert not math.isnan(float(ls.get_loss_scale(restored[1]).loss_scale))



# ----------------------------------------------- flax.serialization: layout and record

def flax_restore(target, state):
    return flax.serialization.from_state_dict({"opt": {"scaler": target}},
                                              {"opt": {"scaler": state}})["opt"]["scaler"]


@pytest.mark.parametrize("bad", [
    np.zeros((0,), np.float32), np.full((2, 2), 8.0, np.float32), [8.0], [[8.0]],
    np.full((1,), 8.0, np.float32)], ids=["empty", "2d", "list", "nested_list", "replicated"])
def test_flax_restore_checks_shapes_against_the_target(bad):
    state = {"loss_scale": bad, "growth_tracker": np.int32(0), "nonfinite_tracker": np.int32(0),
             "failure": np.int32(0)}
    with pytest.raises(ValueError, match=r"'./opt/scaler'.*loss_scale has shape"):
        flax_restore(saved_state(), state)
    with pytest.raises(ValueError, match=r"loss_scale has shape"):
        flax_restore(ls.StaticLossScale(8.0), {"loss_scale": bad})


def test_flax_bytes_of_a_replicated_state_restore_only_into_a_replicated_target():
    s = saved_state()
    replicated = jax.tree.map(lambda x: jnp.stack([x] * 2), s)
    data = flax.serialization.to_bytes(replicated)
    with pytest.raises(ValueError, match=r"loss_scale has shape \(2,\), the target's has "
                                         r"shape \(\): .*replicate"):
        flax.serialization.from_bytes(s, data)
    restored = flax.serialization.from_bytes(jax.tree.map(jnp.zeros_like, replicated), data)
    assert_bit_identical(restored, replicated)
    # ...and the other way round: unreplicated bytes into a replicated target.
    with pytest.raises(ValueError, match=r"shape \(\), the target's has shape \(2,\)"):
        flax.serialization.from_bytes(replicated, flax.serialization.to_bytes(s))


@MAYBE_JIT
def test_a_restored_scalar_state_keeps_scalar_params_scalar(maybe_jit):
    # The symptom: a (1,) scale from replicated bytes turned scalar params into (1,).
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=8.0))
    params = jnp.float32(1.0)
    opt_state = tx.init(params)
    data = flax.serialization.to_bytes(opt_state)
    restored = flax.serialization.from_bytes(tx.init(params), data)
    updates, _ = maybe_jit(tx.update)(jnp.float32(8.0), restored, params)
    assert optax.apply_updates(params, updates).shape == ()


def test_flax_restore_refuses_a_different_static_factor_and_accepts_a_placeholder():
    data = flax.serialization.to_bytes({"scaler": ls.StaticLossScale(128.0)})
    with pytest.raises(ValueError, match=r"'./scaler'.*loss_scale: saved \[?128.0\]?, the "
                                         r"target's StaticLossScale factor is \[?1024.0"):
        flax.serialization.from_bytes({"scaler": ls.StaticLossScale(1024.0)}, data)
    same = flax.serialization.from_bytes({"scaler": ls.StaticLossScale(128.0)}, data)
    assert float(same["scaler"].loss_scale) == 128.0
    placeholder = jax.tree.map(lambda _: None, {"scaler": ls.StaticLossScale(1024.0)})
    assert float(flax.serialization.from_bytes(placeholder, data)["scaler"].loss_scale) == 128.0


def test_flax_bytes_from_before_the_record_and_the_failure_leaf_are_refused():
    """Pre-release bytes (named leaves without ``failure``, before the CRC record) are no
    longer completed: 0.1.0 was never released without the record."""
    s = saved_state()
    old_dict = {"loss_scale": np.asarray(s.loss_scale), "growth_tracker": np.int32(3),
                "nonfinite_tracker": np.int32(0)}          # no `failure`, no record
    old_bytes = flax.serialization.msgpack_serialize({"scaler": old_dict})
    with pytest.raises(ValueError, match="checked record of the keys"):
        flax.serialization.from_bytes({"scaler": target()}, old_bytes)
    restored = flax.serialization.from_bytes({"scaler": target()},
                                             flax.serialization.to_bytes({"scaler": s}))
    assert_bit_identical(restored["scaler"], s)


def flip(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_a_bit_flip_in_the_scale_that_stays_in_range_is_refused():
    s = saved_state()
    data = flax.serialization.to_bytes(s)
    offset = data.index(np.float32(s.loss_scale).tobytes())
    for bit in range(23):              # every mantissa bit: another valid, in-range scale
        with pytest.raises(ValueError, match=r"'\.'.*fails its CRC-32 check"):
            flax.serialization.from_bytes(target(), flip(data, 8 * offset + bit))


@pytest.mark.parametrize("make", [dynamic_after_overflows, STATES["static"]],
                         ids=["dynamic", "static"])
def test_every_single_bit_flip_and_truncation_of_to_bytes_is_refused(make):
    s = make()
    fresh = s if isinstance(s, ls.StaticLossScale) else target()
    data = flax.serialization.to_bytes(s)
    corrupted = [flip(data, bit) for bit in range(8 * len(data))]
    corrupted += [data[:n] for n in range(len(data))]
    named = 0
    for bad in corrupted:
        with pytest.raises(ValueError, match="loss-scale state") as info:
            ls.from_bytes(fresh, bad)
        # flax's own from_bytes: a ValueError too; it names the field unless msgpack itself
        # failed on the record's 2-byte header or on a truncation.
        with pytest.raises(ValueError) as flax_info:
            flax.serialization.from_bytes(fresh, bad)
        named += "loss-scale state" in str(flax_info.value)
        assert "cannot" in str(info.value)
    assert named >= 8 * (len(data) - 2) - 16   # all but the header's bits and truncations


def test_from_bytes_turns_decoding_errors_outside_the_loss_scale_into_value_errors():
    tx = ls.with_loss_scaling(optax.sgd(0.1), ls.DynamicLossScale(init_scale=8.0))
    tree = {"params": np.arange(3.0, dtype=np.float32), "opt": tx.init(jnp.zeros(3))}
    data = flax.serialization.to_bytes(tree)
    # A dtype name of the params array made undecodable: flax raises TypeError there.
    name = data.index(b"float32")
    bad = data[:name] + b"\xffloat32" + data[name + 7:]
    with pytest.raises(Exception) as info:
        flax.serialization.from_bytes(tree, bad)
    assert not isinstance(info.value, ValueError) or "loss-scale" not in str(info.value)
    with pytest.raises(ValueError, match=r"loss-scale state at './opt/scaler'"):
        ls.from_bytes(tree, bad)


leaf_junk = (junk | st.binary(max_size=40)
             | st.builds(np.asarray, st.lists(st.floats(width=32), max_size=3))
             | st.sampled_from([np.array(5, "datetime64[ns]"), np.array(1.0, dtype=object),
                                np.zeros((0,), np.int32), np.float16(2.0), np.int8(1)]))


@settings(max_examples=150, deadline=None)
@given(state=leaf_junk | st.fixed_dictionaries(
    {"loss_scale": leaf_junk, "growth_tracker": leaf_junk, "nonfinite_tracker": leaf_junk},
    optional={"failure": leaf_junk}))
def test_flax_restore_of_hostile_state_is_a_valid_state_or_a_value_error(state):
    try:
        restored = flax_restore(saved_state(), state)
    except ValueError as error:
        assert "'./opt/scaler'" in str(error)
        return
    # Accepted: scalars of the right dtypes, valid for the target's configuration.
    assert isinstance(restored, ls.DynamicLossScale)
    for leaf, dtype in zip(jax.tree.leaves(restored), (jnp.float32,) + (jnp.int32,) * 3,
                           strict=True):
        assert leaf.shape == () and leaf.dtype == dtype
    ls.from_state_dict(state_dict(restored))   # it is a valid state


def test_every_recipe_restores_flax_bytes_through_the_validating_route():
    # Plain flax.serialization.from_bytes raises flax's own errors (TypeError: unhashable
    # type: 'dict', KeyError, ...) on corrupted bytes: the recipes use ls.from_bytes.
    offenders = [block.id for block in doc_blocks.python_blocks()
                 if re.search(r"(?<!ls\.)\bserialization\.from_bytes\b", block.code)]
    assert offenders == []
