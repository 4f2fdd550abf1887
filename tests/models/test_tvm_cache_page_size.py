"""Page sizes TVM's runtime paged KV cache cannot serve are refused up front, naming the function,
``page_size``, the value given and the one needed (issue 55): never a cache whose first forward
dies inside TVM's append kernel (``Mismatched pages.strides``). Nothing here builds a kernel.

Where each size comes from (TVM 0.27, ``relax/frontend/nn/llm``): the append, copy and compact
kernels take the page size as a parameter (``_page_kernels.py``), so ``runtime_kernels`` with
fuel's slots serves any page size (``test_tvm_kv_cache.test_pages_of_8`` checks 8 against the
reference); TVM's tree-attention kernel over pages has 16 built in (``tree_attn.py``), and
``TIRPagedKVCache`` builds its append and compact kernels for the default 16 (``kv_cache.py``).
"""

from __future__ import annotations

import time

import pytest

from tvm_fuel.kv_cache import runtime_cache, runtime_kernels, TVM_PAGE_SIZE
from tvm_fuel.models import llama
from tvm_fuel.models.llama_tvm_cache import LlamaCacheEngine

pytestmark = pytest.mark.unit

SHAPE = dict(num_kv_heads=2, num_qo_heads=8, head_dim=64, dtype="float32", num_layers=2)


class BuiltFor16(dict):
    """Stands in for ``runtime_kernels``' answer (its ``page_size`` attribute) without building it."""

    page_size = 16


def test_tvms_own_slots_refuse_pages_other_than_16_before_building():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="kv_cache.runtime_kernels: page_size must be 16 with kernels='tvm' .*"
                                         "got 8; kernels='fuel' serves any page size"):
        runtime_kernels(2, 8, 64, "float32", num_layers=2, kernels="tvm", page_size=8)
    assert time.perf_counter() - start < 0.5  # refused before anything was built
    assert TVM_PAGE_SIZE == 16


@pytest.mark.parametrize("kernels", ["fuel", "tvm"])
@pytest.mark.parametrize("page_size, message", [(0, "page_size must be a positive int, got 0"),
                                                (-8, "page_size must be a positive int, got -8")])
def test_runtime_kernels_refuse_a_page_size_below_1(kernels, page_size, message):
    with pytest.raises(ValueError, match=f"kv_cache.runtime_kernels: {message}"):
        runtime_kernels(2, 8, 64, "float32", num_layers=2, kernels=kernels, page_size=page_size)


def test_runtime_cache_refuses_a_page_size_its_slots_were_not_built_for():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="kv_cache.runtime_cache: page_size must be 16, the page size "
                                         "runtime_kernels built these slots for .* got 8"):
        runtime_cache(BuiltFor16(), **SHAPE, page_size=8)
    with pytest.raises(ValueError, match="kv_cache.runtime_cache: page_size must be a positive int, got 0"):
        runtime_cache({}, **SHAPE, page_size=0)
    assert time.perf_counter() - start < 0.5


def test_llama_cache_engine_refuses_pages_other_than_16_before_building():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="LlamaCacheEngine: page_size must be 16 .* got 8"):
        LlamaCacheEngine(llama.LlamaConfig(head_dim=64), page_size=8)
    assert time.perf_counter() - start < 0.5
