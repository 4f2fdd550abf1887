"""Fixtures shared by the test modules, and the tiers every test is marked with.

Tiers (README, "Tests"): ``unit`` (checks and parsing, no kernel), ``numerics`` (ops against the
reference on every path), ``integration`` (Relax passes, models, tuning, CLI, bundles); ``slow``
marks what ``pytest -m "not slow"`` leaves out to run in a few minutes: the integration modules
that tune or build bundles, the CUDA kernels' emulation and nvcc builds; ``gpu`` needs a device.
"""

from pathlib import Path

import pytest

_TIERS = {
    "unit": ("test_infer", "test_misuse", "test_threads", "test_packaging"),
    "numerics": ("test_flash_attn", "test_backward", "test_paged_attn", "test_hardening", "test_cpu_kernels",
                 "test_cuda_kernels", "test_reference_vs_torch", "test_gradient", "test_log_hardening",
                 "test_knob_paths", "test_expand", "test_reference_higher_order", "test_higher_order",
                 "test_second_order", "test_generic_schedules", "test_generic_differential", "test_autodiff",
                 "test_autodiff_attention",
                 "test_autodiff_shapes", "test_norm_backward", "test_train_imported"),
    "integration": ("test_models", "test_deploy", "test_cli", "test_tuning", "test_tuning_rpc", "test_fuse_attention",
                    "test_nn", "test_kv_cache", "test_script_and_compile", "test_log_portability",
                    "test_model_tuning"),
}
_SLOW_MODULES = ("test_models", "test_deploy", "test_cli", "test_tuning", "test_tuning_rpc", "test_cuda_kernels",
                 "test_model_tuning")


def pytest_collection_modifyitems(config, items):
    tier_of = {module: tier for tier, modules in _TIERS.items() for module in modules}
    for item in items:
        module = Path(str(item.fspath)).stem
        item.add_marker(getattr(pytest.mark, tier_of.get(module, "integration")))
        if module in _SLOW_MODULES or "cuda-emulated" in item.nodeid:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", params=["decomposed", "tuned", "cuda-emulated"])
def kernels(request) -> str:
    """Both halves of every op: the TE decomposition (floor) and the performance-path kernels,
    the CPU ones and the CUDA ones (their one-thread emulation on llvm: no GPU is needed)."""
    return request.param
