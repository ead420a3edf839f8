"""Corrupted checkpoints: every outcome is the saved state or an error, never another state.

* ``flax.serialization.to_bytes`` output of a scaler and of a whole optimizer state, with
  random bit flips, truncations and overwrites: ``ls.from_bytes`` gives the saved state or
  a ``ValueError`` naming the loss-scale state (nothing else, ever); corruption inside the
  loss scale's record is refused by its CRC-32 (``flax.serialization.from_bytes`` too).
* Orbax checkpoint directories written by ``ls.orbax_save_args``, with one file
  corrupted: ``ls.orbax_restore`` gives the saved loss scale or raises. When the loss-scale
  JSON and the arrays disagree it raises a ``ValueError``; an unreadable array file is
  Orbax's own error. (The params' bytes have no checksum in Orbax or flax: a flipped bit in
  a weight is a different weight. Only the loss scale is cross-checked.)
"""

from __future__ import annotations

import gc
import pathlib
import shutil
import tempfile

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loss_scaling as ls

INF = float("inf")


def bits(tree):
    return [(np.asarray(x).dtype, np.asarray(x).shape, np.asarray(x).tobytes())
            for x in jax.tree.leaves(tree)]


def scaler():
    s = ls.DynamicLossScale(init_scale=1000.0, growth_interval=5, hysteresis=3)
    for finite in (True, False, True, True):
        s = ls.update(s, finite)
    return s


def fresh_scaler():
    return ls.DynamicLossScale(init_scale=1.0, growth_interval=5, hysteresis=3)


def wrapped(s):
    tx = ls.with_loss_scaling(optax.adam(0.1), s)
    params = {"w": jnp.arange(3.0)}
    state = tx.init(params)
    for g in ([1.0, 2.0, 3.0], [INF, 0.0, 1.0]):
        _, state = tx.update({"w": jnp.array(g)}, state, params)
    return {"params": params, "opt_state": state}


CASES = {
    "scaler": (scaler(), fresh_scaler()),
    "static": (ls.StaticLossScale(3.0e4), ls.StaticLossScale(3.0e4)),
    "opt_state": (wrapped(scaler()), wrapped(fresh_scaler())),
}


@st.composite
def corruptions(draw, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["flip", "flips", "truncate", "overwrite"]))
    out = bytearray(data)
    if kind == "truncate":
        return bytes(out[:draw(st.integers(0, len(data) - 1))])
    if kind in ("flip", "flips"):
        for _ in range(1 if kind == "flip" else draw(st.integers(2, 8))):
            bit = draw(st.integers(0, 8 * len(data) - 1))
            out[bit // 8] ^= 1 << (bit % 8)
    else:
        start = draw(st.integers(0, len(data) - 1))
        junk = draw(st.binary(min_size=1, max_size=16))
        out[start:start + len(junk)] = junk
    return bytes(out)


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_corrupted_to_bytes_gives_the_saved_state_or_a_value_error(case, data):
    saved, target = CASES[case]
    encoded = flax.serialization.to_bytes(saved)
    bad = data.draw(corruptions(encoded))
    try:
        restored = ls.from_bytes(target, bad)
    except ValueError as error:
        assert "loss-scale state" in str(error), error
        return
    if case == "opt_state":   # corruption outside the loss scale: only the loss scale is ours
        # (its record: the wrapper's fields, its failure register included, are flax's)
        restored_scaler = restored["opt_state"].scaler
        assert bits(restored_scaler) == bits(saved["opt_state"].scaler)
    else:
        assert bits(restored) == bits(saved)


def test_every_error_of_corrupted_scaler_bytes_is_a_value_error_in_flax_too():
    saved, target = CASES["scaler"]
    encoded = flax.serialization.to_bytes(saved)
    rng = np.random.default_rng(0)
    for _ in range(300):
        bad = bytearray(encoded)
        start = int(rng.integers(len(bad)))
        bad[start:start + 4] = rng.bytes(4)
        with pytest.raises(ValueError):   # msgpack's own errors are ValueErrors here
            flax.serialization.from_bytes(target, bytes(bad)[:len(encoded)])


# -------------------------------------------------------------------------------- Orbax


def make_state():
    tx = ls.with_loss_scaling(optax.adam(0.1), ls.DynamicLossScale(
        init_scale=1000.0, growth_interval=5, hysteresis=3))
    return ls.TrainState.create(apply_fn=None, params={"w": jnp.arange(4.0)}, tx=tx)


@pytest.fixture(scope="module")
def checkpoint():
    state = make_state()
    for p in (1.0, INF, 1.0):
        state = state.apply_gradients(grads={"w": jnp.full(4, p)})
    root = pathlib.Path(tempfile.mkdtemp())
    with ocp.CheckpointManager(root / "pristine") as mngr:
        mngr.save(3, args=ls.orbax_save_args(state))
        mngr.wait_until_finished()
    files = sorted(str(p.relative_to(root / "pristine")) for p in (root / "pristine").rglob("*")
                   if p.is_file())
    yield root, state, files
    shutil.rmtree(root)


# Orbax abandons its pending reads when one fails; their coroutines are then reported as
# unraisable exceptions ("Event loop is closed") when collected: Orbax's, not ours. They
# are collected in this test's teardown (the fixture below), where the filter applies.
@pytest.fixture
def collect_orbax_leftovers():
    yield
    gc.collect()


@pytest.mark.usefixtures("collect_orbax_leftovers")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_corrupted_orbax_checkpoint_gives_the_saved_loss_scale_or_an_error(checkpoint, data):
    root, saved, files = checkpoint
    # The loss-scale JSON and the array files are where the values live: corrupt them
    # most often.
    name = data.draw(st.sampled_from(files) | st.sampled_from(
        [f for f in files if f.endswith("loss_scale/metadata") or "/d/" in f]))
    work = pathlib.Path(tempfile.mkdtemp(dir=root))
    try:
        shutil.copytree(root / "pristine", work / "c")
        target = work / "c" / name
        target.write_bytes(data.draw(corruptions(target.read_bytes())))
        try:
            with ocp.CheckpointManager(work / "c") as mngr:
                restored = ls.orbax_restore(mngr, jax.eval_shape(make_state))
        except ValueError as error:
            # Ours: "cannot be read", "corrupted", a state-dict field, a config difference.
            assert str(error)
            return
        except Exception:  # Orbax's own: an unreadable array file or metadata
            return
        assert bits(ls.get_loss_scale(restored)) == bits(ls.get_loss_scale(saved))
        assert ls.get_loss_scale(restored).config == ls.get_loss_scale(saved).config
    finally:
        shutil.rmtree(work)


def test_a_json_scale_edited_to_another_valid_value_is_refused(checkpoint, tmp_path):
    root, _, _ = checkpoint
    shutil.copytree(root / "pristine", tmp_path / "c")
    metadata = tmp_path / "c" / "3" / "loss_scale" / "metadata"
    text = metadata.read_text()
    assert '"loss_scale": 1000.0' in text
    metadata.write_text(text.replace('"loss_scale": 1000.0', '"loss_scale": 1001.0'))
    with ocp.CheckpointManager(tmp_path / "c") as mngr:
        with pytest.raises(ValueError, match="its arrays say loss_scale 1000.0, its loss-scale "
                                             "JSON says 1001.0"):
            ls.orbax_restore(mngr, jax.eval_shape(make_state))


def test_plain_flax_from_bytes_fails_inside_flax_where_ls_from_bytes_gives_a_value_error():
    # flax decodes the whole message (and restores dicts and tuples with its own handlers)
    # before the loss scale's hook runs: single bit flips raise all sorts of errors there,
    # TypeError("unhashable type: 'dict'") among them. ls.from_bytes refuses each of those
    # with a ValueError naming the loss-scale state (docs/checkpoints.md says which route
    # validates what).
    saved, target = CASES["opt_state"]
    encoded = flax.serialization.to_bytes(saved)
    seen = set()
    for bit in range(8 * len(encoded)):
        bad = bytearray(encoded)
        bad[bit // 8] ^= 1 << (bit % 8)
        try:
            flax.serialization.from_bytes(target, bytes(bad))
            continue
        except ValueError:
            continue
        except Exception as error:  # noqa: BLE001 - what plain flax raises is the point
            seen.add(f"{type(error).__name__}: {error}"[:40])
        with pytest.raises(ValueError, match="loss-scale state"):
            ls.from_bytes(target, bytes(bad))
    assert "TypeError: unhashable type: 'dict'" in seen, seen
