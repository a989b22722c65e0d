import os
import sys

import numpyro

# Correctness tests run in float64 (the split must match NumPyro to round-off).
numpyro.enable_x64()
sys.path.insert(0, os.path.dirname(__file__))

SHARED_DATA = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "shared", "data")

import pytest  # noqa: E402

import jax  # noqa: E402

# JAX's persistent compilation cache: tests build the same programs many times over (a method
# per test, the same model in several tests), and compiling is most of a small run's time.
# One folder per test process (pytest-xdist's workers each have theirs): JAX writes an entry
# without a lock unless the cache has a size limit, whose eviction then rescans the whole folder
# at every write (measured: 26 of 60 samples of a make test run in that scan and its lock), so
# processes do not share one. This process's setting only: the processes that tests start
# (Ray's workers, Flower's nodes, subprocesses) compile as before. JAX_COMPILATION_CACHE_DIR=""
# turns it off (``make clean`` removes the folders).
if os.environ.get("JAX_COMPILATION_CACHE_DIR", None) != "":
    jax.config.update(
        "jax_compilation_cache_dir",
        os.path.join(
            os.environ.get("JAX_COMPILATION_CACHE_DIR")
            or os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, ".jax_cache"),
            os.environ.get("PYTEST_XDIST_WORKER", "main"),
        ),
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


@pytest.fixture(params=["float64", "float32"])
def precision(request):
    """Runs the test in float64 (the tests' default) or float32 (NumPyro's default)."""
    if request.param == "float32":
        jax.config.update("jax_enable_x64", False)
    try:
        yield request.param
    finally:
        jax.config.update("jax_enable_x64", True)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session (small, no dashboard), shut down at the end."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'numpyro_fed[ray]')")
    import warnings

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    started = not ray.is_initialized()
    if started:
        with warnings.catch_warnings():
            # Ray starts its processes with fork+exec; JAX warns of fork in a threaded process.
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_federation(ray_session):
    """One RayFederation for a test module: each test starts its clients with its own program
    (the actors are reused: starting a process that imports JAX is what costs)."""
    from numpyro_fed import RayFederation

    federation = RayFederation(timeout=120.0)  # the first call compiles on each worker: a loaded machine
    yield federation
    federation.close()


# Correctness checks that take more than about 10 s each on a quiet 2-core machine (long runs
# against NUTS or closed forms, every variant of a protocol end to end): marked ``long``, run by
# ``make test-long``, not by ``make test`` nor CI (an engine test in LONG is left out of
# ``make test-engine``, CI's run of the engine tests). Each algorithm keeps faster checks of its
# distribution in ``make test``. By node id prefix (a parametrized test: all of its cases).
LONG = (
    "tests/potential/test_row_deterministic.py::test_every_algorithm_returns_the_group_effects_with_the_plate_as_their",
    "tests/potential/test_initial_point.py::test_the_algorithms_agree_with_nuts_at_defaults_where_the_first",
    "tests/flower/test_flower_node_store.py::test_rows_that_change_to_the_same_shapes",
    "tests/flower/test_flower_node_store.py::test_a_new_flower_run_never_runs",
    "tests/flower/test_flower_node_store.py::test_a_node_without_a_cache_folder",
    "tests/flower/test_flower_node_store.py::test_a_new_process_answers_an_update",
    "tests/privacy/test_private_randomness.py::test_deployed_private_runs_draw_noise_the_server_cannot_replay",
    "tests/infer/zigzag/test_zigzag_robust.py::test_float32_mode_search_reaches_the_mode_of_a_regression_on_raw",
    "tests/infer/consensus/test_consensus.py::test_linear_gaussian",
    "tests/infer/consensus/test_consensus.py::test_inference_data_has_every_clients_diagnostics",
    "tests/infer/consensus/test_consensus.py::test_logistic_regression_with_large_clients_agrees_with_nuts",
    "tests/infer/consensus/test_consensus.py::test_small_skewed_clients_warn_with_the_statistic",
    "tests/infer/consensus/test_consensus.py::test_halfcauchy_scale_is_combined_unconstrained_and_returned",
    "tests/infer/consensus/test_consensus.py::test_any_numpyro_kernel_runs_the_sub_posteriors",
    "tests/infer/consensus/test_consensus.py::test_client_local_latents_stay_with_their_clients",
    "tests/infer/consensus/test_consensus.py::test_flat_prior_gives_least_squares",
    "tests/infer/consensus/test_consensus_engines.py::test_deployment_in_process_is_the_simulation",
    "tests/infer/zigzag/test_zigzag.py::test_vectorized_chains",
    "tests/infer/zigzag/test_zigzag.py::test_gradient_bound_agrees_with_nuts_and_too_small_a_bound_is_reported",
    "tests/infer/zigzag/test_zigzag.py::test_warmup_then_run_and_post_warmup_state_continue_the_chain",
    "tests/infer/zigzag/test_zigzag.py::test_second_order_control_variates_match_closed_form_without_spurious",
    "tests/infer/zigzag/test_zigzag.py::test_subsampling_and_deployment_on_the_mean_of_a_normal",
    "tests/infer/zigzag/test_zigzag.py::test_client_local_latents_agree_with_nuts",
    "tests/infer/zigzag/test_zigzag.py::test_logistic_regression_over_unequal_clients_agrees_with_nuts",
    "tests/infer/zigzag/test_zigzag.py::test_preconditioned_sampler_matches_closed_form",
    "tests/infer/zigzag/test_zigzag.py::test_laplace_preconditioning_speeds_up_a_correlated_posterior",
    "tests/infer/zigzag/test_zigzag.py::test_hessian_bound_on_logistic_regression_agrees_with_nuts",
    "tests/infer/zigzag/test_zigzag.py::test_gaussian_target_with_prior_redistribution",
    "tests/infer/zigzag/test_zigzag_federation.py::test_one_round_per_switch_and_same_posterior_as_in_process",
    "tests/infer/zigzag/test_zigzag_federation.py::test_deployment_equals_simulation_bit_for_bit",
    "tests/infer/zigzag/test_zigzag_subsample.py::test_second_order_user_third_bound_is_summed_per_coordinate",
    "tests/infer/zigzag/test_zigzag_subsample.py::test_curvature_not_finite_away_from_the_posterior_is_warned",
    "tests/infer/zigzag/test_zigzag_warmup.py::test_adapted_interval_follows_the_smallest_posterior_sd",
    "tests/federation/test_federation_variational.py::test_deployment_in_process_is_the_simulation",
    "tests/federation/test_federation_variational.py::test_a_client_fault_stops_the_run_and_the_checkpoint_resumes",
    "tests/federation/test_federation_variational.py::test_pdsvgd_ledger_counts_local_particles_up",
    "tests/federation/test_federation_variational.py::test_dsvgd_ledger_counts_particles_between_server_and_sched",
    "tests/federation/test_federation_variational.py::test_dppvi_ledger_counts_what_the_protocol_sends",
    "tests/federation/test_federation_variational.py::test_udsvgd_ledger_counts_the_global_particles_and_the_round",
    "tests/infer/stein/test_svgd.py::test_minibatch_runs_reach_the_posterior",
    "tests/infer/stein/test_svgd.py::test_udsvgd_and_pdsvgd_conjugate_moments",
    "tests/infer/stein/test_svgd.py::test_mixture_kl_beats_gaussian_pvi_and_approaches_svgd",
    "tests/infer/stein/test_svgd.py::test_minibatch_gradient_is_unbiased_and_full_when_the_batch_covers_the_client",
    "tests/infer/stein/test_svgd_units.py::test_a_change_of_units_changes_nothing",
    "tests/infer/stein/test_dsvgd_local.py",
    "tests/infer/pvi/test_dppvi_local.py",
    "tests/infer/pvi/test_pvi_priors.py::test_halfcauchy_and_flat_priors_agree_with_nuts",
    "tests/infer/pvi/test_dppvi.py::test_virtual_with_one_shard_is_parameter_perturbation",
    "tests/infer/pvi/test_accounting.py::test_calibration_hits_target_from_below",
    "tests/infer/test_kernel.py::test_a_good_run_is_silent_and_numpyros_own_kernels_are_untouched",
    "tests/infer/test_ledger.py::test_a_variational_run_and_a_decentralized_run_have_ledgers_of_one_shape",
    "tests/infer/admm/test_admm.py::test_newton_proximal_steps_under_vectorized_chains",
    "tests/infer/admm/test_admm.py::test_draws_that_collapse_a_funnel_warn",
    "tests/zoo/test_zoo_real.py::test_zoo_real_fast",
    "tests/infer/zigzag/test_zigzag.py::test_default_mixes_on_raw_covariates_as_nuts_does",
    "tests/infer/stein/test_svgd_units.py::test_the_auto_kde_keeps_the_particles_correlations",
    "tests/infer/admm/test_admm_scaling.py",
    "tests/federation/test_federation_local_latents.py::test_deployed_in_process_is_the_simulation_bit_for_bit",
    # engine tests that CI leaves to make test-long (each over 100 s): DSVGD's correction with
    # client-local latents on Ray (its rounds there are test_deployed_on_ray_is_the_in_process_
    # deployment[DSVGD]'s) and one Ray federation reused by three algorithms in turn
    "tests/federation/test_federation_local_latents.py::test_dsvgd_correction_and_draws_of_local_latents_on_ray",
    "tests/federation/test_federation.py::test_one_ray_federation_runs_a_server_algorithm_then_a_decentralized",
    # a dropped client: make test keeps the float64 case of each algorithm
    "tests/federation/test_dropout.py::test_pvi_round_goes_on_without_a_client_and_keeps_its_factor[synchronous-float32]",
    "tests/federation/test_dropout.py::test_dsvgd_skips_the_update_of_a_client_that_fails[float32]",
)


def pytest_collection_modifyitems(config, items):
    """A test that starts Ray workers (it uses the ``ray_session`` fixture) or Flower's
    simulation (``tests/flower/test_flower.py``) is an ``engine`` test, one in :data:`LONG` a
    ``long`` one: ``make test-long`` runs both, ``make test`` neither, ``make test-engine`` (CI)
    the engine tests that are not long."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()) or item.nodeid.startswith("tests/flower/test_flower.py"):
            item.add_marker(pytest.mark.engine)
        if item.nodeid.startswith(LONG):
            item.add_marker(pytest.mark.long)
