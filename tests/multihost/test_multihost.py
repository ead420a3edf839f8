"""Many hosts for real: the wrapper on a multi-process ``jax.distributed`` run (CPU, gloo).

Each test module fixture starts N processes of ``multihost_worker.py`` (N = 2, and 4 with
``LS_MULTIHOST_PROCESSES=2,4``; two virtual CPU devices each) on one coordinator at
``127.0.0.1:PORT`` (a free port, picked by
binding port 0), plus the single-process runs they are compared with, and asserts on what
every process wrote. Nothing is read through a collective: each process reports the bytes
of its own device buffers.

What runs (``docs/multihost.md`` says the same for users):

* ``train``: the README's sharded-``jit`` step (a ("data", "model") mesh, hidden units
  split over "model") and its ``shard_map`` step (vma-checked), plus a ``shard_map`` step
  with ``check_vma=False`` and the plain optax path, whose gradient mean is taken in a
  fixed order and whose NaN is injected *after* it, so that only the wrapper's one
  ``pmin`` can carry it to the other processes; and the README's ``pmap`` step, its NaN
  after its ``pmean`` likewise. 8 steps over a global batch of 24 rows,
  each process feeding its own rows (``jax.make_array_from_process_local_data``); an
  inf in the last process's rows at step 2 and a NaN in the last device's gradients at
  step 5. Every process and device skips those steps and backs off together; the state
  agrees bit for bit across processes after every step, and equals a single process with
  the same device count (bit for bit where the gradient mean has a fixed order; the
  scale, counters and skip decisions exactly everywhere; params and moments to float
  rounding where the runtime's all-reduce picks the order of the sum). A control without
  ``axis_name`` shows that the test sees processes drift apart.
* ``fail_closed``: always overflowing from 2**-124, the third backoff leaves the float32
  range; ``ls.check(opt_state)`` raises the same ``ls.LossScaleError`` on every process.
* ``save`` / ``resume``: an Orbax checkpoint with the README's recipe, written by the
  multi-process run on a mesh whose "model" axis spans the processes (each process writes
  its own shards, process 0 the loss-scale configuration as JSON), restored in a fresh
  multi-process run (continues bit-identically) and in one process with 6 devices.

Marked ``multihost`` and ``slow``: ``pytest -m "not slow"`` skips them, ``.ci/run`` runs
them. A process that dies or hangs fails the test with its name and the tail of its
stderr; the others are killed.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "multihost_worker.py"
GUIDE = ROOT / "docs" / "multihost.md"

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

# Two processes by default (CI's 2 cores); LS_MULTIHOST_PROCESSES=2,4 adds four (about two
# minutes more on 2 cores).
PROCESS_COUNTS = tuple(int(n) for n in os.environ.get("LS_MULTIHOST_PROCESSES", "2").split(","))
DEVICES_PER_PROCESS = 2
SINGLE_DEVICES = 6  # the single-process restore: a device count no multi-process run has
TIMEOUT_S = 300  # per launch; the whole module takes about 2 minutes on 2 cores

# The worker's schedule (kept in step with multihost_worker.py, which the tests do not
# import: importing it would import jax in the pytest process with its device count).
N_STEPS = 8
GLOBAL_BATCH = 24
BAD_ROW = GLOBAL_BATCH - 1
SKIPPED = (2, 5)
SAVE_AT = 4
# init_scale 1024, growth every 2nd clean step, halved on each skipped step.
EXPECTED_SCALES = [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
PATHS = ("jit", "shard_map", "shard_map_unchecked", "pmap")
EXACT_PATHS = ("shard_map_unchecked",)  # the gradient mean in a fixed order
METRICS = ("loss_scale", "growth_tracker", "skipped_steps", "consecutive_skips",
           "last_step_applied")
HUNG = "hung"  # what a hanging stand-in prints where it hangs (STAND_IN)
PORT_TAKEN = re.compile(r"Failed to start RPC server|Failed to add port|address already in use",
                        re.IGNORECASE)


# ------------------------------------------------------------------------ the launcher


class WorkerFailure(Exception):
    """A process of a launch died, hung or could not start; the message says which."""


def free_port() -> int:
    """A port nobody listens on now (the coordinator binds 127.0.0.1 only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, chars: int) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    text = "\n".join(line for line in text.splitlines() if not line.startswith("[Gloo]"))
    return text[-chars:]


def exit_text(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def run_processes(argv: Callable[[int, int], list[str]], n_processes: int, folder: Path, *,
                  port: int, timeout: float, env: dict[str, str] | None = None,
                  timed_from: str | None = None) -> None:
    """Runs ``n_processes`` commands ``argv(process_id, port)`` at once, until all succeed.

    ``timed_from``: the ``timeout`` counts from when every process has written this text
    to its stderr (within :data:`TIMEOUT_S` of the start), not from the start: starting
    two processes and the coordinator took over 20 s on a busy 2-core machine.

    Raises:
      WorkerFailure: as soon as one process exits non-zero (the others are killed), or
        when ``timeout`` seconds have passed (all are killed); the message names the
        process, how it ended and the tail of its stderr.
    """
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    procs: list[subprocess.Popen] = []
    logs = [(folder / f"process_{i}.stdout", folder / f"process_{i}.stderr")
            for i in range(n_processes)]
    try:
        for i, (out, err) in enumerate(logs):
            with out.open("w") as stdout, err.open("w") as stderr:
                procs.append(subprocess.Popen(argv(i, port), cwd=ROOT, env=env, stdout=stdout,
                                              stderr=stderr, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + (timeout if timed_from is None else TIMEOUT_S)
        ended: list[int] = []  # the processes that failed, in the order they were seen
        while True:
            if timed_from is not None and all(timed_from in tail(err, 10_000)
                                              for _, err in logs):
                timed_from, deadline = None, time.monotonic() + timeout
            codes = [p.poll() for p in procs]
            ended += [i for i, code in enumerate(codes) if code not in (None, 0)
                      and i not in ended]
            if ended:
                _kill(procs)
                failures = "; ".join(f"process {i} of {n_processes} ended with "
                                     f"{exit_text(procs[i].returncode)}" for i in ended)
                raise WorkerFailure(_describe(f"{failures} (the others were killed)", ended,
                                              logs, port))
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                running = [i for i, code in enumerate(codes) if code is None]
                _kill(procs)
                waited = (f"{timeout:.0f}s" if timed_from is None else
                          f"{TIMEOUT_S:.0f}s, before every process wrote {timed_from!r}")
                raise WorkerFailure(_describe(
                    f"timed out after {waited}: process(es) {running} of {n_processes} "
                    "still running (all were killed)", running, logs, port))
            time.sleep(0.1)
    finally:
        _kill(procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=30)


def _describe(headline: str, culprits: list[int], logs: list[tuple[Path, Path]],
              port: int) -> str:
    stderrs = [tail(err, 200_000) for _, err in logs]
    if any(PORT_TAKEN.search(text) for text in stderrs):
        headline = (f"the coordinator port 127.0.0.1:{port} could not be bound (another "
                    f"process holds it?): {headline}")
    parts = [headline]
    for i, text in enumerate(stderrs):
        parts += [f"--- process {i}: stderr (tail) ---",
                  text[-6000:] if i in culprits else text[-800:]]
    return "\n".join(parts)


def launch(folder: Path, scenarios: list[str], n_processes: int, devices: int, *,
           checkpoint: Path | None = None, port: int | None = None,
           timeout: float = TIMEOUT_S, timed_from: str | None = None) -> list[dict[str, Any]]:
    """Runs the worker's ``scenarios`` on ``n_processes`` processes of ``devices`` devices.

    Returns one result dict per process. With no ``port``, picks a free one, and picks
    another once if it was taken between the pick and the coordinator's bind.
    ``timed_from``: as for :func:`run_processes`.
    """
    def argv(i: int, port: int) -> list[str]:
        return [sys.executable, str(WORKER), "--num-processes", str(n_processes),
                "--process-id", str(i), "--port", str(port), "--devices", str(devices),
                "--out", str(folder), *(["--checkpoint", str(checkpoint)] if checkpoint
                                        else []), *scenarios]

    for attempt in (0, 1):
        try:
            run_processes(argv, n_processes, folder, port=port or free_port(), timeout=timeout,
                          timed_from=timed_from)
            break
        except WorkerFailure as failure:
            if port is not None or attempt or "could not be bound" not in str(failure):
                raise
    return [pickle.loads((folder / f"process_{i}.pkl").read_bytes())
            for i in range(n_processes)]


def launched(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    try:
        return launch(*args, **kwargs)
    except WorkerFailure as failure:
        pytest.fail(str(failure), pytrace=False)


# -------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=PROCESS_COUNTS, ids=lambda n: f"{n}proc")
def runs(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every launch for one process count: the multi-process runs and their references."""
    n = request.param
    tmp = tmp_path_factory.mktemp(f"multihost_{n}")
    checkpoint = tmp / "checkpoint"
    yield {
        "n": n,
        "checkpoint": checkpoint,
        "multi": launched(tmp / "multi", ["train", "fail_closed", "save"], n,
                          DEVICES_PER_PROCESS, checkpoint=checkpoint),
        "single": launched(tmp / "single", ["train", "fail_closed"], 1,
                           n * DEVICES_PER_PROCESS)[0],
        "resumed": launched(tmp / "resumed", ["resume"], n, DEVICES_PER_PROCESS,
                            checkpoint=checkpoint),
        "resumed_single": launched(tmp / "resumed_single", ["resume"], 1, SINGLE_DEVICES,
                                   checkpoint=checkpoint)[0],
    }


def value(result: dict[str, Any], scenario: str) -> Any:
    entry = result[scenario]
    assert entry["error"] is None, f"{scenario} raised:\n{entry['error']}"
    assert entry["warnings"] == [], entry["warnings"]
    return entry["value"]


def per_process(runs: dict[str, Any], scenario: str, key: str | None = None) -> list[Any]:
    values = [value(r, scenario) for r in runs["multi"]]
    return values if key is None else [v[key] for v in values]


# ----------------------------------------------------------------------------- helpers


def shard_bytes(snapshots: list[dict[str, Any]]) -> dict[tuple[str, Any], set[bytes]]:
    """(leaf, shard index) -> the distinct byte patterns of its copies, over processes."""
    out: dict[tuple[str, Any], set[bytes]] = {}
    for snap in snapshots:
        for leaf, info in snap.items():
            for index, copies in info["shards"].items():
                out.setdefault((leaf, index), set()).update(copies)
    return out


def assert_one_pattern_per_shard(snapshots: list[dict[str, Any]], what: str) -> None:
    for (leaf, index), patterns in shard_bytes(snapshots).items():
        assert len(patterns) == 1, f"{what}: {leaf} shard {index} has {len(patterns)} values"


def assemble(snapshots: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """The global value of every leaf, put together from the shards all processes hold."""
    out = {}
    for leaf, info in snapshots[0].items():
        array = np.zeros(info["shape"], info["dtype"])
        seen = np.zeros(info["shape"], bool)
        for snap in snapshots:
            for index, copies in snap[leaf]["shards"].items():
                where = tuple(slice(a, b) for a, b in index)
                array[where] = np.frombuffer(copies[0], info["dtype"]).reshape(array[where].shape)
                seen[where] = True
        assert seen.all(), f"{leaf}: no process holds some of it"
        out[leaf] = array
    return out


def metric(steps: list[dict[str, Any]], name: str) -> list[Any]:
    """One value per step, after checking that every device agrees on it."""
    values = []
    for i, step in enumerate(steps):
        copies = step["metrics"][name]
        assert len(set(copies)) == 1, f"{name} differs between devices after step {i}: {copies}"
        values.append(copies[0])
    return values


def leaf_filter(snapshot: dict[str, Any], pick: Callable[[str], bool]) -> dict[str, Any]:
    return {k: v for k, v in snapshot.items() if pick(k)}


def is_float(info: dict[str, Any]) -> bool:
    return np.issubdtype(np.dtype(info["dtype"]), np.floating)


# ------------------------------------------------------------------------ the runtime


def test_the_processes_form_one_runtime(runs):
    n = runs["n"]
    metas = [r["meta"] for r in runs["multi"]]
    assert [m["process_index"] for m in metas] == list(range(n))
    for m in metas:
        assert m["process_count"] == n
        assert m["collectives"] == "gloo"
        assert len(m["devices"]) == n * DEVICES_PER_PROCESS
        assert {p for _, p in m["devices"]} == set(range(n))
    local = [d for m in metas for d in m["local_devices"]]
    assert len(local) == len(set(local)) == n * DEVICES_PER_PROCESS


@pytest.mark.parametrize("path", PATHS)
def test_each_process_feeds_its_own_rows(runs, path):
    n = runs["n"]
    rows = [p[path]["fed_rows"]["x"] for p in per_process(runs, "train")]
    assert all(len(r) == 1 for r in rows), rows  # one contiguous block per process
    blocks = [r[0] for r in rows]
    assert blocks == [(i * GLOBAL_BATCH // n, (i + 1) * GLOBAL_BATCH // n) for i in range(n)]
    owners = [i for i, (start, stop) in enumerate(blocks) if start <= BAD_ROW < stop]
    assert owners == [n - 1]  # the injected overflow is in the last process's rows only
    assert value(runs["single"], "train")[path]["fed_rows"]["x"] == [(0, GLOBAL_BATCH)]


# --------------------------------------------------------------- skipping together


@pytest.mark.parametrize("path", PATHS)
def test_every_process_skips_and_backs_off_together(runs, path):
    results = per_process(runs, "train", path)
    for i in range(N_STEPS):
        steps = [r["steps"][i] for r in results]
        # Params and the whole optimizer state: one byte pattern per shard, over every
        # copy on every device of every process.
        assert_one_pattern_per_shard([s["state"] for s in steps], f"after step {i}")
        for name in METRICS:
            copies = [c for s in steps for c in s["metrics"][name]]
            assert len(copies) == runs["n"] * DEVICES_PER_PROCESS
            assert len(set(copies)) == 1, (i, name, copies)
    for r in results:
        assert metric(r["steps"], "loss_scale") == EXPECTED_SCALES
        assert metric(r["steps"], "last_step_applied") == [i not in SKIPPED
                                                         for i in range(N_STEPS)]
        assert metric(r["steps"], "skipped_steps") == [sum(j in SKIPPED for j in range(i + 1))
                                                      for i in range(N_STEPS)]
        for i in SKIPPED:  # a skipped step leaves params and the inner state bit-identical
            before, after = r["steps"][i - 1]["state"], r["steps"][i]["state"]
            for leaf in before:
                if leaf.startswith("['params']") or ".inner_state" in leaf:
                    assert before[leaf]["shards"] == after[leaf]["shards"], (i, leaf)


@pytest.mark.parametrize("path", [p for p in PATHS if p != "pmap"])  # pmap has no cache
def test_compiles_once(runs, path):
    assert [r["cache_size"] for r in per_process(runs, "train", path)] == [1] * runs["n"]


@pytest.mark.parametrize("path", PATHS)
def test_equals_one_process_over_the_same_global_batch(runs, path):
    """The same program on one process with the same device count (so the same mesh
    and shard layout) and the whole batch."""
    results = per_process(runs, "train", path)
    reference = value(runs["single"], "train")[path]
    assert len(reference["steps"]) == N_STEPS
    for i, expected in enumerate(reference["steps"]):
        multi = [r["steps"][i] for r in results]
        for name in METRICS:  # exactly, everywhere
            copies = {c for s in multi for c in s["metrics"][name]}
            assert copies == set(expected["metrics"][name]), (i, name)
        got = shard_bytes([s["state"] for s in multi])
        want = shard_bytes([expected["state"]])
        assert got.keys() == want.keys()  # the same leaves, sharded the same way
        for (leaf, index), patterns in want.items():
            info = expected["state"][leaf]
            if path in EXACT_PATHS or not is_float(info):  # bit for bit
                assert got[leaf, index] == patterns, f"{leaf} {index} after step {i}"
            else:  # the all-reduce adds the devices' gradients in its own order
                a, b = (np.frombuffer(next(iter(p)), info["dtype"])
                        for p in (got[leaf, index], patterns))
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7,
                                           err_msg=f"{leaf} {index} after step {i}")


def test_without_the_pmin_the_processes_drift_apart(runs):
    """The control: no axis_name, so the NaN in the last device's gradients (after
    their mean) makes that device alone skip. The tests above would see it."""
    n = runs["n"]
    results = per_process(runs, "train", "control")
    first_bad = SKIPPED[1]
    for i in range(first_bad):
        assert_one_pattern_per_shard([r["steps"][i]["state"] for r in results], str(i))
    finite = [c for r in results for c in r["steps"][first_bad]["metrics"]["last_step_applied"]]
    assert finite == [True] * (n * DEVICES_PER_PROCESS - 1) + [False]
    patterns = shard_bytes([r["steps"][first_bad]["state"] for r in results])
    assert max(len(p) for p in patterns.values()) == 2
    scales = [r["steps"][first_bad]["metrics"]["loss_scale"] for r in results]
    assert scales[-1][-1] == scales[0][0] / 2  # halved on the last device only


# ------------------------------------------------------------------------ fail closed


@pytest.mark.parametrize("path", ["jit", "shard_map", "pmap"])
def test_fail_closed_reports_the_same_error_on_every_process(runs, path):
    results = per_process(runs, "fail_closed", path)
    messages = [r["check"] for r in results]
    assert messages[0] is not None, "ls.check must raise after the failed backoff"
    assert messages[0].startswith("LossScaleError: ")
    assert "loss scale" in messages[0].lower()
    assert messages == [messages[0]] * runs["n"]  # the same failure on every process
    assert messages[0] == value(runs["single"], "fail_closed")[path]["check"]
    for r in results:
        # 2**-124 -> 2**-125 -> 2**-126 (the smallest normal); the third backoff fails and
        # the scale stays at its last valid value; every step was skipped.
        assert metric(r["steps"], "loss_scale") == [2.0**-125] + [2.0**-126] * 4
        assert metric(r["steps"], "skipped_steps") == [1, 2, 3, 4, 5]
        assert metric(r["steps"], "failed") == [False, False, True, True, True]
        params = leaf_filter(r["initial"]["state"], lambda k: k.startswith("['params']"))
        for step in r["steps"]:
            for leaf, info in params.items():
                assert step["state"][leaf]["shards"] == info["shards"], leaf
    assert_one_pattern_per_shard([r["steps"][-1]["state"] for r in results], "after failing")


# ------------------------------------------------------------------------- checkpoints


def test_each_process_writes_its_shards_and_the_config_once(runs):
    step_dir = runs["checkpoint"] / str(SAVE_AT)
    state_dir = step_dir / "state"
    written = sorted(p.name for p in state_dir.glob("ocdbt.process_*"))
    assert written == [f"ocdbt.process_{i}" for i in range(runs["n"])]
    for name in written:  # each process wrote data of its own
        assert any(f.is_file() for f in (state_dir / name / "d").iterdir()), name
    # The configuration: one JSON document (written by process 0 alone).
    documents = [p for p in step_dir.rglob("*") if p.is_file() and _is_json(p)]
    documents = [p for p in documents if "config" in json.loads(p.read_text())]
    assert [p.relative_to(step_dir).parts[0] for p in documents] == ["loss_scale"]
    saved = json.loads(documents[0].read_text())
    assert saved["config"]["growth_interval"] == 2
    assert saved["values"] == {"loss_scale": 1024.0, "growth_tracker": 1,
                               "nonfinite_tracker": 0}


def _is_json(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (UnicodeDecodeError, ValueError):
        return False


def test_the_saving_run_sharded_its_state_over_the_processes(runs):
    saved = [value(r, "save")["saved"] for r in runs["multi"]]
    w1 = [set(s["['params']['w1']"]["shards"]) for s in saved]
    for i in range(len(w1)):
        for j in range(i):
            assert not w1[i] & w1[j], "every process must hold shards no other holds"


def test_restores_in_a_fresh_multiprocess_run_and_continues_bit_identically(runs):
    saved = [value(r, "save") for r in runs["multi"]]
    resumed = [value(r, "resume") for r in runs["resumed"]]
    for before, after in zip(saved, resumed, strict=True):
        assert after["latest_step"] == SAVE_AT
        assert after["restored"] == before["saved"]  # every shard of every process
        assert after["restored_metrics"] == before["saved_metrics"]
        assert len(after["steps"]) == len(before["steps"]) == N_STEPS - SAVE_AT
        for i, (a, b) in enumerate(zip(before["steps"], after["steps"], strict=True)):
            assert a == b, f"step {SAVE_AT + i} differs after the resume"
    assert metric(resumed[0]["steps"], "loss_scale") == [2048.0, 2048.0, 4096.0, 4096.0]


def test_restores_in_one_process_with_another_device_count(runs):
    saved = [value(r, "save") for r in runs["multi"]]
    single = value(runs["resumed_single"], "resume")
    assert single["latest_step"] == SAVE_AT
    got, want = assemble([single["restored"]]), assemble([s["saved"] for s in saved])
    assert got.keys() == want.keys()
    for leaf in want:  # bit for bit, dtypes and shapes included
        assert got[leaf].dtype == want[leaf].dtype and got[leaf].shape == want[leaf].shape
        assert got[leaf].tobytes() == want[leaf].tobytes(), leaf
    assert single["shardings"]["['params']['w1']"] == "P(None, 'model')"
    assert single["shardings"]["['opt_state'].scaler.loss_scale"] == "P()"
    # Trained on over 6 devices instead of 2x2 or 4x2: the same decisions and scale; the
    # params to float rounding (the gradient sums are split differently).
    for name in METRICS:
        assert metric(single["steps"], name) == metric(saved[0]["steps"], name), name
    for i, step in enumerate(single["steps"]):
        got = assemble([step["state"]])
        want = assemble([s["steps"][i]["state"] for s in saved])
        for leaf in want:
            if leaf.startswith("['params']"):
                np.testing.assert_allclose(got[leaf], want[leaf], rtol=1e-5, atol=1e-7,
                                           err_msg=f"{leaf} after step {SAVE_AT + i}")


# ------------------------------------------------------------- when a process fails

# The harness's own tests. What run_processes does with a process that dies or hangs does
# not depend on what the processes run, so those two launch this stand-in, which starts no
# jax: the last process dies (or hangs), the others wait for it as they would in a
# collective. A coordinator that cannot bind its port is jax's own failure: the one launch
# of the worker here.
STAND_IN = f"""
import sys, time
process, count, action = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if process == count - 1:
    if action == "die":
        print(f"process {{process}}: dying on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    print(f"process {{process}}: hanging on purpose ({HUNG})", file=sys.stderr, flush=True)
    time.sleep(3600)
print(f"process {{process}}: waiting for the last process ({HUNG})", file=sys.stderr,
      flush=True)
time.sleep(3600)
"""


def stand_ins(action: str, n_processes: int) -> Callable[[int, int], list[str]]:
    return lambda i, port: [sys.executable, "-c", STAND_IN, str(i), str(n_processes), action]


def test_a_process_that_dies_fails_the_test_with_its_stderr(tmp_path):
    with pytest.raises(WorkerFailure) as failure:
        run_processes(stand_ins("die", 2), 2, tmp_path, port=free_port(), timeout=120)
    message = str(failure.value)
    assert "process 1 of 2 ended with exit code 3" in message.splitlines()[0]
    assert "--- process 1: stderr (tail) ---\nprocess 1: dying on purpose" in message


def test_a_hung_process_fails_the_test_instead_of_hanging(tmp_path):
    """The timeout counts from when both processes are where they hang (each says so):
    under load, starting the worker's processes took longer than the timeout, and the
    message had no stderr to show yet (it failed once in a full run)."""
    started = time.monotonic()
    with pytest.raises(WorkerFailure) as failure:
        run_processes(stand_ins("hang", 2), 2, tmp_path, port=free_port(), timeout=5,
                      timed_from=HUNG)
    # Killed, not waited for: the processes sleep for an hour.
    assert time.monotonic() - started < TIMEOUT_S + 5 + 60
    message = str(failure.value)
    assert message.startswith("timed out after 5s: process(es) [0, 1] of 2 still running")
    assert "process 1: hanging on purpose" in message
    assert "process 0: waiting for the last process" in message


def test_a_taken_coordinator_port_fails_the_test_clearly(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(WorkerFailure) as failure:
            launch(tmp_path, ["train"], 2, DEVICES_PER_PROCESS, port=port, timeout=120)
    message = str(failure.value)
    assert message.startswith(f"the coordinator port 127.0.0.1:{port} could not be bound")
    # The coordinator's process (jax 0.10.2 sometimes segfaults on its way out).
    assert "process 0 of 2 ended with" in message.splitlines()[0]
    assert PORT_TAKEN.search(message.split("\n", 1)[1])  # jax's own words, in the stderr


def test_free_port_is_free():
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # would raise if it were taken


# ------------------------------------------------------------------ the guide's program


def guide_program() -> str:
    """The complete program in docs/multihost.md (its python block)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    programs = [b for b in blocks if "jax.distributed.initialize" in b]
    assert len(programs) == 1, "docs/multihost.md must hold exactly one complete program"
    return programs[0]


def test_the_guides_program_trains_saves_and_resumes_on_two_processes(tmp_path):
    program = tmp_path / "train_multihost.py"
    program.write_text(guide_program())
    checkpoint = tmp_path / "checkpoint"

    def argv(i: int, port: int) -> list[str]:
        return [sys.executable, str(program), "--process-id", str(i), "--num-processes", "2",
                "--coordinator", f"127.0.0.1:{port}", "--checkpoint", str(checkpoint),
                "--cpu-devices", str(DEVICES_PER_PROCESS)]

    for run, step in (("first", 4), ("resumed", 8)):
        try:
            run_processes(argv, 2, tmp_path / run, port=free_port(), timeout=TIMEOUT_S)
        except WorkerFailure as failure:
            pytest.fail(f"the guide's program ({run} run): {failure}", pytrace=False)
        for i in range(2):
            out = (tmp_path / run / f"process_{i}.stdout").read_text()
            lines = [line for line in out.splitlines() if line.startswith("process ")]
            assert lines == [f"process {i}: step {step}, skipped_steps 1, "
                             "loss_scale 16384.0"], out
        assert sorted(p.name for p in checkpoint.iterdir()) == (
            ["4"] if step == 4 else ["4", "8"])
