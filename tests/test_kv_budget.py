"""The KV cache's bytes under --gpu-memory-utilization: the fraction of the GPU, less the weights and
the activations, and a clear error where that is not free or holds nothing."""

import pytest

from tailrace.engine.config import EMBEDDED_MODEL, EngineConfig
from tailrace.engine.kv_budget import activation_bytes, fixed_kv_cache_bytes, gpu_kv_cache_bytes
from tailrace.model.loading.loader import load_model_config

GIB = 2**30


def test_the_cache_gets_the_fraction_less_weights_and_activations():
    kv = gpu_kv_cache_bytes(0.9, total=100 * GIB, free_before_load=99 * GIB, free_after_load=83 * GIB,
                            activations=4 * GIB)
    assert kv == 90 * GIB - 16 * GIB - 4 * GIB


def test_other_processes_memory_is_not_counted_against_the_fraction():
    alone = gpu_kv_cache_bytes(0.4, 100 * GIB, 99 * GIB, 83 * GIB, 4 * GIB)
    beside_another = gpu_kv_cache_bytes(0.4, 100 * GIB, 55 * GIB, 39 * GIB, 4 * GIB)
    assert alone == beside_another == 20 * GIB


def test_a_fraction_larger_than_the_free_memory_is_refused():
    with pytest.raises(ValueError, match="only 50.0 GiB were free"):
        gpu_kv_cache_bytes(0.9, 100 * GIB, 50 * GIB, 40 * GIB, 1 * GIB)


def test_a_fraction_that_leaves_no_room_for_the_cache_is_refused():
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        gpu_kv_cache_bytes(0.2, 100 * GIB, 99 * GIB, 81 * GIB, 4 * GIB)


def test_activations_grow_with_the_step_token_budget():
    mc = load_model_config(EMBEDDED_MODEL)
    small = activation_bytes(EngineConfig(max_num_batched_tokens=512), mc, dtype_bytes=2)
    large = activation_bytes(EngineConfig(max_num_batched_tokens=4096), mc, dtype_bytes=2)
    assert large > small > 0


def test_without_the_fraction_the_cache_has_its_fixed_size():
    assert fixed_kv_cache_bytes(EngineConfig(kv_cache_memory_gb=0.25)) == GIB // 4


@pytest.mark.parametrize("value", [0.0, 1.5])
def test_the_engine_config_refuses_a_fraction_outside_zero_to_one(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value).validate()
