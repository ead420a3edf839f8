"""Marks the tests that make the suite slow, so that ``pytest -m "not slow"`` is quick.

CI (``.ci/run``) runs everything. The quick subset (2.4 min on 2 cores of an AMD EPYC,
2026-12-06) runs one parametrization of each test function (the first jitted one, or the
first; the others are marked slow), and none of
the tests that start other processes (8 virtual devices, several hosts, a fresh resume, the
type checker), execute the notebooks, build the docs, run the demo, import torch or search
with hypothesis. Marked here, by module, node id or fixture, rather than in each file; a test can
also carry ``@pytest.mark.slow`` itself.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

# Every test of these modules (paths relative to the repository root).
SLOW_MODULES = (
    "tests/distributed/",  # one subprocess on 8 virtual devices runs every scenario
    "tests/multihost/",  # several jax.distributed processes
    "tests/test_notebooks.py",  # executes the notebooks
    "tests/test_static_checks.py",  # mypy and ruff over the package
    "tests/test_update_rule.py",  # hypothesis against the reference model
    "tests/test_torch_reference.py",  # imports torch; PyTorch's kernels on every bit pattern
    "tests/test_checkpoint_devices.py",  # subprocesses on 8 devices and on 2 processes
    "tests/test_checkpoint_fuzz.py",  # hypothesis over corrupted bytes and checkpoint files
    "tests/test_policy_runs.py",  # four short float16 training runs of the demo model
    "tests/test_autocast_zoo.py",  # seven models, their gradients and 150-step trainings
)

# Tests that use these (module-scoped, expensive) fixtures.
SLOW_FIXTURES = (
    "demo_run",  # three short training runs of the demo
)

# Single tests (node ids without parameters, relative to the repository root).
SLOW_TESTS = (
    "tests/test_checkpoint_recipe.py::test_resume_in_a_fresh_process_is_bit_identical",
    "tests/test_conftest.py::test_a_process_the_tests_start_reads_what_they_compiled_and_writes_nothing",
    "tests/test_demo.py::test_runs_as_a_module",
    "tests/test_demo.py::test_the_default_run_matches_what_getting_started_claims",  # 4x1000 steps
    "tests/test_demo.py::test_the_train_step_compiles_once_and_skips_non_finite_steps",
    "tests/test_demo.py::test_docs_demo_train_step_runs",  # 9 float16 layers to compile
    "tests/test_skipping.py::test_noop_scale_unscale_and_update_add_no_ops_to_the_wrapper_step",
    "tests/test_skipping.py::test_docs_gan_snippet_backs_off_only_the_overflowing_scaler",
    "tests/test_composition.py::test_ls_train_state_fused_matches_flax_train_state_plain_and_skips_exactly",
    "tests/test_docs.py::test_site_builds_with_warnings_as_errors",
    "tests/test_exactness.py::test_lbfgs_sees_the_unscaled_grad_extra_argument",
    "tests/test_wrapper_inputs.py::test_ls_train_state_assigns_the_fp8_overwrite_collection_exactly_as_flax_does",
    # Whole training runs of the framework integrations, step by step against references.
    "tests/test_nnx.py::test_training_matches_nnx_value_and_grad_without_the_wrapper",
    "tests/test_nnx.py::test_value_and_grad_threads_rng_and_batch_stats_exactly_like_nnx",
    "tests/test_nnx.py::test_plain_and_fused_paths_agree_step_by_step",
    "tests/test_nnx.py::test_plain_and_fused_paths_agree",
    "tests/test_nnx.py::test_value_and_grad_returns_aux_and_differentiates_several_arguments",
    "tests/test_nnx.py::test_orbax_resume_is_bit_identical_to_the_uninterrupted_run",
    "tests/test_equinox.py::test_training_matches_filter_value_and_grad_without_the_wrapper",
    "tests/test_equinox.py::test_value_and_grad_on_an_eqx_module_is_filtered_and_threads_the_state",
    "tests/test_equinox.py::test_plain_and_fused_paths_agree_step_by_step",
    "tests/test_equinox.py::test_plain_and_fused_paths_agree",
    "tests/test_equinox.py::test_a_skipped_step_keeps_the_forward_pass_state_and_nothing_else",
    "tests/test_docs.py::test_python_block_runs_on_virtual_devices",
    "tests/test_nnx.py::test_value_and_grad_uses_the_optimizers_wrt_filter",
    "tests/test_nnx.py::test_a_skipped_step_keeps_the_forward_pass_updates_and_nothing_else",
    "tests/test_checkpoint_orbax.py::test_nnx_resume_through_the_orbax_helpers_is_bit_identical",
    "tests/test_checkpoint_orbax.py::test_nnx_helpers_refuse_a_changed_config",
    "tests/test_checkpoint_recipe.py::test_the_guides_blocks_run",
    "tests/test_nnx.py::test_ls_nnx_optimizer_without_loss_scaling_is_a_plain_nnx_optimizer",
    "tests/test_nnx.py::test_metrics_through_nnx_state_equal_the_optimizers",
    "tests/test_nnx.py::test_check_reads_a_failure_from_the_optimizer_its_state_and_split",
    "tests/test_equinox.py::test_a_wrong_first_argument_says_what_it_must_be",
    "tests/test_skipping.py::test_loss_scale_for_in_a_wrapper_train_step",
    # Recipes and checks that train a model or compile many steps (the quick subset's
    # budget is 90 s on 2 cores).
    "tests/test_composition.py::test_docs_batchnorm_dropout_recipe_trains_and_a_skip_keeps_the_new_batch_stats",
    "tests/test_diagnostics.py::test_the_getting_started_check_shows_a_model_that_needs_loss_scaling",
    "tests/test_transform.py::test_the_default_fused_step_adds_a_fixed_number_of_kernels_whatever_the_leaf_count",
    "tests/test_debug.py::test_the_readiness_report_matches_a_hand_computation_on_two_layers",
    "tests/test_nnx.py::test_a_wrong_first_argument_says_what_it_must_be",
    "tests/test_wrapper_inputs.py::test_a_skipped_step_keeps_every_float_dtype_bit_for_bit_but_where_xla_cpu_flushes",
    "tests/test_wrapper_inputs.py::test_line_searches_lbfgs_and_sam_run_inside_the_wrapper",
    "tests/test_wrapper_inputs.py::test_metrics_grad_norm_is_the_unscaled_global_norm_and_nonfinite_on_a_skip",
    "tests/test_composition.py::test_docs_optax_snippet_runs_both_paths_and_skips_nan_steps",
    "tests/test_composition.py::test_docs_train_state_snippet_runs_and_skips_a_nan_step",
    "tests/test_nnx.py::test_get_loss_scale_and_metrics_accept_the_optimizer_its_state_and_split",
    "tests/test_diagnostics.py::test_nothing_is_compiled_when_the_diagnostics_are_off",
    "tests/test_diagnostics.py::test_integer_and_bool_params_pass_through_as_in_optax",
    # The debugging tools run op by op: a real model is hundreds of eager compiles.
    "tests/test_debug.py::test_a_function_sharded_over_8_virtual_devices",  # subprocess
    "tests/test_debug.py::test_the_train_steps_compiled_text_is_unchanged_by_the_feature",
    "tests/test_debug.py::test_the_readiness_report_on_the_demo_model_sorts_its_layers_by_headroom",
    "tests/test_debug.py::test_the_readiness_report_on_a_small_transformer",
    "tests/test_debug.py::test_inside_nnx_scan_the_layer_index_and_line_are_reported",
    "tests/test_debug.py::test_a_frameworks_own_cell_is_placed_at_the_users_line_that_calls_it",
    # the GRU's stepwise reference checked on its own, and at more scales
    "tests/test_debug_gru.py::test_the_model_overflows_where_the_stepwise_reference_says",
    "tests/test_debug_gru.py::test_the_reference_and_the_report_agree_at_larger_scales",
)


# The numerics-sensitive tests: they compare floating results of float16 / bfloat16 arithmetic
# (in ulps) or assert the bits the library promises (unscale, skipped steps). XLA's float16
# arithmetic depends on the CPU's instruction set, so .ci/run runs these once more under
# XLA_FLAGS=--xla_cpu_max_isa=AVX2 (`pytest -m numerics`): green in CI is then green on CPUs
# with and without native float16 arithmetic.
NUMERICS_MODULES = (
    "tests/test_tree.py",  # scale / unscale / all_finite, bit for bit
    # which steps overflow float16 decides the run table's counts (benchmarks/policy_runs.py)
    "tests/test_policy_runs.py",
)
NUMERICS_TESTS = (
    # the exact reciprocal, the exact finite test, narrow and wide dtypes (the hypothesis
    # searches of the skip decision run once, natively: they test the decision's logic)
    "tests/test_exactness.py::test_unscale_matches_the_float64_reference",
    "tests/test_exactness.py::test_unscale_above_2_126_is_not_flushed_to_zero",
    "tests/test_exactness.py::test_the_reciprocal_is_rounded_once_for_every_scale_above_2_126",
    "tests/test_exactness.py::test_sums_that_overflow_no_longer_skip_finite_steps",
    "tests/test_exactness.py::test_a_float16_leaf_that_rounds_to_65504_is_finite",
    "tests/test_exactness.py::test_a_scale_above_2_126_trains_on_the_true_gradient",
    "tests/test_exactness.py::test_complex_gradients_are_checked_and_unscaled",
    "tests/test_exactness.py::test_float8_and_float4_leaves_scale_unscale_and_step",
    "tests/test_exactness.py::test_float64_subnormal_params_on_a_skipped_step",
    "tests/test_transform.py::test_finite_steps_equal_inner_on_true_gradients",
    "tests/test_transform.py::test_clipping_inside_the_inner_chain_sees_true_gradients",
    "tests/test_composition.py::test_ls_train_state_fused_matches_flax_train_state_plain_and_skips_exactly",
)


# The order in which CI's two workers start the work (`--dist loadscope
# --no-loadscope-reorder`: a file's tests are one unit, a test class's too, handed out in
# collection order): the longest first, so that no long unit starts last and runs alone at
# the end. Each notebook's execution is a class of tests/test_notebooks.py: a unit of its own.
LONGEST_FIRST = (
    "tests/distributed/",  # the 8-device worker
    "tests/test_notebooks.py::TestDiagnosticsAndGuards",
    "tests/multihost/",  # launches of 2 processes and their references
    "tests/test_notebooks.py::TestMixedPrecisionTraining",
    "tests/test_policy_runs.py",
    "tests/test_docs.py",  # builds the site
    "tests/test_exactness.py",
    "tests/test_transform.py",
    "tests/test_static_checks.py",  # mypy
    "tests/test_checkpoint_devices.py",
    "tests/test_torch_reference.py",
    "tests/test_notebooks.py::TestHeadroomAndReplay",
    "tests/test_notebooks.py::TestScalerDynamics",
    "tests/test_demo.py",
    "tests/test_checkpoint_recipe.py",
    "tests/test_debug.py",
    "tests/test_nnx.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath

    def rank(item: pytest.Item) -> int:
        scope = item.nodeid.rsplit("::", 1)[0]  # xdist's unit: the file, or the class
        return next((i for i, p in enumerate(LONGEST_FIRST) if scope.startswith(p)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the files keep their order among equals

    def node_of(item: pytest.Item) -> tuple[str, str]:
        path = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return path, f"{path}::{getattr(item, 'originalname', item.name)}"

    # One parametrization per test function stays quick: the first one that is not eager
    # (op-by-op eager runs are the slow ones; the jitted run is what users run), or else
    # the first.
    quick: dict[str, str] = {}
    for item in items:
        _, node = node_of(item)
        if hasattr(item, "callspec") and (
                node not in quick or ("eager" in quick[node] and "eager" not in item.name)):
            quick[node] = item.name
    for item in items:
        path, node = node_of(item)
        repeated = hasattr(item, "callspec") and quick.get(node) != item.name
        searches = getattr(getattr(item, "obj", None), "is_hypothesis_test", False)
        if (repeated or searches or path.startswith(SLOW_MODULES) or node in SLOW_TESTS
                or not SLOW_FIXTURES_SET.isdisjoint(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.slow)
        if path.startswith(NUMERICS_MODULES) or node in NUMERICS_TESTS:
            item.add_marker(pytest.mark.numerics)


SLOW_FIXTURES_SET = frozenset(SLOW_FIXTURES)
NUMERICS_FILES = frozenset(NUMERICS_MODULES) | {t.split("::")[0] for t in NUMERICS_TESTS}


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    """``pytest -m numerics`` (.ci/run's second pass) collects only the files that hold
    numerics tests: importing the other test modules on each worker costs more than the
    tests themselves."""
    if config.option.markexpr != "numerics" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    path = collection_path.relative_to(config.rootpath).as_posix()
    return None if path.startswith(tuple(NUMERICS_FILES)) else True


# One compilation cache for the whole run: a folder made by the run's first process and
# named to every later one through the environment (xdist's workers, the subprocesses the
# tests start, the notebook kernels and the multihost workers all inherit it; jax reads
# JAX_* variables when it is imported).
CACHE_FOLDER = "JAX_COMPILATION_CACHE_DIR"
# What a process that did not run this file does with the folder: it reads (a hit skips
# XLA's compile) and never writes, since jax writes an entry in place, where a process
# could read it half-written. The test processes write, each entry to a file of its own
# first, then renamed into place (atomic_put below).
CACHE_READ_ONLY = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1e9"}


def atomic_put(self, key: str, value: bytes) -> None:
    """``jax._src.lru_cache.LRUCache.put`` without a size limit (jax's default), the entry
    written whole under a name of this process's own and then renamed: a reader sees no
    entry or all of it, and two processes writing the same entry both write all of it."""
    from jax._src import lru_cache

    path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
    if path.exists():
        return
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(value)
    os.replace(partial, path)


def pytest_configure(config: pytest.Config) -> None:
    """Every process of a run compiles a program that another process of it compiled
    already (the same step from a new closure, the same small model in another test file,
    a fresh process that rebuilds the run it resumes) once: XLA's executables go to one
    persistent compilation cache per run, a fresh folder removed at the run's end (nothing
    is reused from an earlier run). The test processes read and write it; the processes
    they start read it. A hit needs the same program text (debug info aside), XLA flags
    and backend, so the AVX2 pass, a run of its own, compiles anew; programs with host
    callbacks are never cached (jax's rule). Tracing and lowering still run in every test.
    ``LS_TEST_COMPILATION_CACHE=0`` turns it off."""
    if os.environ.get("LS_TEST_COMPILATION_CACHE", "1") == "0":
        return
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the run's first process makes the folder
        folder = tempfile.mkdtemp(prefix="ls-test-xla-cache-")
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        os.environ.update(CACHE_READ_ONLY, **{CACHE_FOLDER: folder})
        if getattr(config.option, "numprocesses", None):
            return  # xdist's controller runs no test
    import jax
    from jax._src import lru_cache

    lru_cache.LRUCache.put = atomic_put
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_FOLDER])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
