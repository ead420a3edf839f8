"""Checkpoints written by every version since 250089d restore bit for bit and continue
exactly (tests/fixtures/checkpoints/: one folder per version, written by its generate.py).

Each route restores as a user would: ``ls.from_state_dict``, ``ls.from_bytes``,
``ls.orbax_restore``, and Orbax's and flax's own API through ``ls.target_as_saved`` /
``ls.upgrade_restored``. Every leaf is compared with the one the generator saw, by key
path: values bit for bit, dtypes, and the scaler's configuration. A field that a later
version removed must agree with the fields that replace it; a field a later version added
must hold the value ``FIELD_CHANGES`` declares. Then one more step from the restored state
must equal the generator's own next step, bit for bit (every value of the runs is exact in
float32, so this holds on any CPU: generate.py says why).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import loss_scaling as ls
from loss_scaling.checkpoint.upgrade import FIELD_CHANGES, FieldAdded, FieldRemoved

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"
VERSIONS = sorted(p.name for p in FIXTURES.iterdir() if (p / "manifest.json").is_file())
_spec = importlib.util.spec_from_file_location("checkpoint_fixtures_generate",
                                               FIXTURES / "generate.py")
assert _spec is not None and _spec.loader is not None
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

BYTES_ITEMS = ("optimizer_states", "flax_train_state")
ORBAX_ITEMS = ("orbax_dict", "ls_train_state", "nnx_optimizer")


def manifest(version: str) -> dict[str, Any]:
    return json.loads((FIXTURES / version / "manifest.json").read_text())


def reference(version: str, name: str) -> dict[str, np.ndarray]:
    data = (FIXTURES / version / "reference" / f"{name}.msgpack").read_bytes()
    return flax.serialization.msgpack_restore(data)


def field_of(path: str) -> str:
    """The field a leaf's key path ends in (an nnx Variable's ``/value`` skipped)."""
    parts = path.split("/")
    return parts[-2] if parts[-1] == "value" else parts[-1]


def assert_like_generator(version: str, name: str, tree: Any) -> None:
    """Every leaf of ``tree`` as the generator saw it: the same key paths, bits and dtypes,
    but for the fields ``FIELD_CHANGES`` declares between that version and today."""
    want, got = reference(version, name), gen.leaves_by_path(tree)
    removed = {c.name: c for c in FIELD_CHANGES if isinstance(c, FieldRemoved)}
    added = {c.name: c for c in FIELD_CHANGES if isinstance(c, FieldAdded)}
    for path in sorted(set(want) - set(got)):
        assert field_of(path) in removed, f"{name}: {path} was not restored"
        # the fields that replace it hold the same fact (the upgrade checked it too): the
        # state's own, or those of the state that holds it (a wrapper's, for its scaler)
        change = removed[field_of(path)]
        before, after = path.rsplit(field_of(path), 1)
        if change.holder is not None:
            before = before.rstrip("/").rsplit("/", 1)[0] + "/"
        siblings = {field_of(p): got[p] for p in got
                    if p.startswith(before) and p.endswith(after)
                    and "/" not in p[len(before):len(p) - len(after)]}
        assert np.array_equal(change.derived(siblings), want[path]), (name, path)
    for path in sorted(set(got) - set(want)):
        change = added.get(field_of(path))
        assert change is not None, f"{name}: {path} appeared from nowhere"
        assert got[path].dtype == np.dtype(change.dtype), (name, path)
        assert (got[path] == change.value).all(), (name, path, got[path])
    for path in sorted(set(want) & set(got)):
        assert got[path].dtype == want[path].dtype, (name, path, got[path].dtype)
        assert got[path].shape == want[path].shape, (name, path)
        assert got[path].tobytes() == want[path].tobytes(), (
            name, path, got[path].tolist(), want[path].tolist())


def assert_config(version: str, run: str, scaler: Any) -> None:
    assert ls.state_dict(scaler)["config"] == manifest(version)["runs"][run]["config"]


def copied(version: str, item: str, tmp_path: Path) -> Path:
    """The item's files, copied: Orbax must not write into the committed fixture."""
    source = FIXTURES / version / gen.ITEMS[item]["path"]
    if source.is_dir():
        return Path(shutil.copytree(source, tmp_path / source.name))
    return source


def bytes_target(item: str) -> Any:
    if item == "flax_train_state":
        return gen.flax_train_state("failed")
    runs = gen.ITEMS[item]["runs"]
    return {key: {run: gen.dict_state(run)[key] for run in runs}
            for key in ("params", "opt_state")}


def restore_bytes(version: str, item: str, own_api: bool) -> Any:
    data = (FIXTURES / version / gen.ITEMS[item]["path"]).read_bytes()
    target = bytes_target(item)
    if not own_api:
        return ls.from_bytes(target, data)
    saved_target = ls.target_as_saved(target, data)
    return ls.upgrade_restored(flax.serialization.from_bytes(saved_target, data), target)


def next_bytes_state(item: str, restored: Any) -> Any:
    if item == "flax_train_state":
        return gen.next_step(item, "failed", restored)
    nexts = {run: gen.next_step(item, run, {key: restored[key][run] for key in restored})
             for run in gen.ITEMS[item]["runs"]}
    return {key: {run: nexts[run][key] for run in nexts} for key in ("params", "opt_state")}


def scalers_of(item: str, restored: Any) -> dict[str, Any]:
    if item == "flax_train_state":
        return {"failed": ls.get_loss_scale(restored)}
    return {run: ls.get_loss_scale(restored["opt_state"][run])
            for run in gen.ITEMS[item]["runs"]}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_json_state_dicts_restore_exactly(version):
    dicts = json.loads((FIXTURES / version / "state_dict.json").read_text())
    saved = reference(version, "optimizer_states")
    for run, d in dicts.items():
        scaler = ls.from_state_dict(d)
        assert ls.state_dict(scaler) == d
        if run in manifest(version)["runs"]:
            assert_config(version, run, scaler)
        if run in gen.ITEMS["optimizer_states"]["runs"]:  # the same run's bytes agree
            for name in ls.state_dict(scaler)["values"]:
                leaf = np.asarray(getattr(scaler, name))
                # a scaler's failure code is its wrapper's register (issue 41 on)
                key = f"opt_state/{run}/scaler/{name}"
                want = saved[key if key in saved else f"opt_state/{run}/{name}"]
                assert leaf.dtype == want.dtype and leaf.tobytes() == want.tobytes()
    assert float(dicts["static"]["values"]["loss_scale"]) == manifest(version)["static_scale"]
    assert isinstance(ls.from_state_dict(dicts["noop"]), ls.NoOpLossScale)


@pytest.mark.parametrize("own_api", [False, True], ids=["ls.from_bytes", "flax+upgrade"])
@pytest.mark.parametrize("item", BYTES_ITEMS)
@pytest.mark.parametrize("version", VERSIONS)
def test_flax_bytes_restore_bit_identically_and_continue_exactly(version, item, own_api):
    restored = restore_bytes(version, item, own_api)
    assert_like_generator(version, item, restored)
    for run, scaler in scalers_of(item, restored).items():
        assert_config(version, run, scaler)
    assert_like_generator(version, f"{item}_next", next_bytes_state(item, restored))


def orbax_target(item: str) -> Any:
    run = gen.ITEMS[item]["runs"][0]
    make = {"orbax_dict": gen.dict_state, "ls_train_state": gen.ls_train_state}[item]
    return run, jax.eval_shape(lambda: make(run))


@pytest.mark.parametrize("own_api", [False, True], ids=["ls.orbax_restore", "orbax+upgrade"])
@pytest.mark.parametrize("item", ["orbax_dict", "ls_train_state"])
@pytest.mark.parametrize("version", VERSIONS)
def test_orbax_restores_bit_identically_and_continues_exactly(version, item, own_api,
                                                              tmp_path):
    directory = copied(version, item, tmp_path)
    run, target = orbax_target(item)
    if own_api:  # Orbax's own API: the state item, the handlers named so metadata reads
        handlers = {"state": ocp.StandardCheckpointHandler(),
                    "loss_scale": ocp.JsonCheckpointHandler()}
        with ocp.CheckpointManager(directory, item_handlers=handlers) as mngr:
            saved_target = ls.target_as_saved(target, mngr.item_metadata(0)["state"])
            restored = ls.upgrade_restored(mngr.restore(0, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(saved_target)))["state"], target)
    else:
        with ocp.CheckpointManager(directory) as mngr:
            restored = ls.orbax_restore(mngr, target)
    assert_like_generator(version, item, restored)
    scaler = ls.get_loss_scale(restored if item == "ls_train_state" else restored["opt_state"])
    assert_config(version, run, scaler)
    assert_like_generator(version, f"{item}_next", gen.next_step(item, run, restored))


@pytest.mark.parametrize("version", VERSIONS)
def test_the_nnx_optimizer_restores_bit_identically_and_continues_exactly(version,
                                                                         tmp_path):
    model, optimizer = gen.nnx_build("nnx")
    with ocp.CheckpointManager(copied(version, "nnx_optimizer", tmp_path)) as mngr:
        restored = ls.orbax_restore(mngr, gen.nnx_saved(model, optimizer))
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])
    assert_like_generator(version, "nnx_optimizer", gen.nnx_saved(model, optimizer))
    assert_config(version, "nnx", ls.get_loss_scale(optimizer))
    gen.next_step("nnx_optimizer", "nnx", (model, optimizer))
    assert_like_generator(version, "nnx_optimizer_next", gen.nnx_saved(model, optimizer))


@pytest.mark.parametrize("item", BYTES_ITEMS)
def test_last_step_finite_of_250089d_is_last_step_applied(item):
    restored = restore_bytes("250089d", item, own_api=False)
    saved = reference("250089d", item)
    states = ({"failed": restored.opt_state} if item == "flax_train_state"
              else restored["opt_state"])
    for run, state in states.items():
        key = "opt_state/last_step_finite" if item == "flax_train_state" else (
            f"opt_state/{run}/last_step_finite")
        assert bool(state.last_step_applied) == bool(saved[key])
    assert {bool(saved[k]) for k in saved if k.endswith("last_step_finite")} == {True, False} \
        or item == "flax_train_state"


def test_every_version_has_every_item_and_the_fixtures_stay_small():
    assert {"250089d", "b4e3e57", "issue42", "issue41"} <= set(VERSIONS)
    for version in VERSIONS:
        assert manifest(version)["items"].keys() == gen.ITEMS.keys()
        for spec in gen.ITEMS.values():
            assert (FIXTURES / version / spec["path"]).exists(), (version, spec["path"])
        size = sum(f.stat().st_size for f in (FIXTURES / version).rglob("*") if f.is_file())
        assert size < 150_000, (version, size)


def test_each_versions_fields_differ_from_todays_only_by_declared_changes():
    today = set(ls.LossScalingState._fields)
    removed = {c.name for c in FIELD_CHANGES if isinstance(c, FieldRemoved)}
    added = {c.name for c in FIELD_CHANGES if isinstance(c, FieldAdded)}
    for version in VERSIONS:
        saved = set(manifest(version)["wrapper_fields"])
        assert saved - today <= removed, version
        assert today - saved <= added, version


def test_issue41s_scalers_hold_no_copy_of_their_wrappers_failure():
    # Issue 41: the wrapper's failure is the one register; before, each held scaler kept a
    # copy, equal to it in every fixture (what FIELD_CHANGES checks on restore).
    for version in VERSIONS:
        saved = reference(version, "optimizer_states")
        copies = {path: leaf for path, leaf in saved.items()
                  if path.endswith("/scaler/failure")}
        if version == "issue41":
            assert copies == {}
            continue
        assert set(copies) == {f"opt_state/{run}/scaler/failure"
                               for run in gen.ITEMS["optimizer_states"]["runs"]}
        for path, copy in copies.items():
            assert copy == saved[path.replace("/scaler/failure", "/failure")], path
    dicts = json.loads((FIXTURES / "issue41" / "state_dict.json").read_text())
    assert dicts["failed"]["values"]["failure"] == ls.Failure.TOO_MANY_SKIPS  # as before
