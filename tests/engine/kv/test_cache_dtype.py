"""--kv-cache-dtype below the engine: each name's torch dtype, CUDA's refusal, the pool's rounding
(e4m3fn saturated at ±448), and a budget that holds more pages the narrower the dtype."""

from __future__ import annotations

import pytest
import torch

from baton.checkpoint.load import Checkpoint
from baton.config import KV_CACHE_DTYPES, BatonConfig, ConfigurationError
from baton.engine.kv.cache_dtype import TORCH_DTYPES, kv_cache_dtype
from baton.engine.kv.pool import KVPool
from baton.engine.kv.sizing import kv_pool_pages, page_bytes

CPU = torch.device("cpu")


def test_every_name_but_auto_is_a_torch_dtype_and_fp8_is_e4m3() -> None:
    assert set(TORCH_DTYPES) == set(KV_CACHE_DTYPES) - {"auto"}
    assert kv_cache_dtype("fp8", torch.float32, CPU) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e4m3", torch.float32, CPU) == torch.float8_e4m3fn
    assert kv_cache_dtype("fp8_e5m2", torch.float32, CPU) == torch.float8_e5m2
    for compute in (torch.float32, torch.bfloat16):
        assert kv_cache_dtype("auto", compute, CPU) == compute
        assert kv_cache_dtype("float16", compute, CPU) == torch.float16


def test_cuda_takes_only_the_models_own_dtype() -> None:
    """FlashInfer and the CUDA graphs read the compute dtype's cache alone: anything else is
    refused at start-up in one line, not met as a kernel error mid-request."""
    cuda = torch.device("cuda")
    assert kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert kv_cache_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    for name in ("fp8", "fp8_e5m2", "float32"):
        with pytest.raises(ConfigurationError, match="not built for CUDA yet; use auto"):
            kv_cache_dtype(name, torch.bfloat16, cuda)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_the_pool_rounds_as_torch_rounds(dtype: torch.dtype) -> None:
    values = torch.randn(40, 2, 8, generator=torch.Generator().manual_seed(1)) * 30
    pool = KVPool(1, 10, 4, 2, 8, dtype, "cpu")
    slots = torch.arange(40).flip(0)
    pool.write(0, values, -values, slots)
    assert pool.k_cache(0).dtype == dtype
    caches = (pool.k_cache(0), pool.v_cache(0))
    stored_k, stored_v = (cache.reshape(40, 2, 8)[slots] for cache in caches)
    assert torch.equal(stored_k.float(), values.to(dtype).float())
    assert torch.equal(stored_v.float(), (-values).to(dtype).float())


def test_an_e4m3_pool_saturates_at_448() -> None:
    """e4m3fn has no infinity: what lies past ±448 is stored as ±448 (vLLM's kernels do so at
    scale 1.0); a NaN stays NaN."""
    values = torch.tensor([1e4, -1e4, 448.0, 470.0, float("inf"), -float("inf"), 0.3, float("nan")])
    pool = KVPool(1, 1, 1, 1, 8, torch.float8_e4m3fn, "cpu")
    pool.write(0, values.view(1, 1, 8), values.view(1, 1, 8), torch.tensor([0]))
    stored = pool.k_cache(0).reshape(8).float()
    assert stored[:7].tolist() == [448.0, -448.0, 448.0, 448.0, 448.0, -448.0, 0.3125]
    assert stored[7].isnan()


def test_the_budget_holds_pages_in_proportion_to_the_element_size(
    random_checkpoint: Checkpoint,
) -> None:
    model = random_checkpoint.config
    float32_page = page_bytes(model, 16, torch.float32)
    config = BatonConfig(kv_cache_memory_bytes=8 * float32_page, max_running_requests=1000)
    pages = [
        kv_pool_pages(config, model, dtype, 64)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    ]
    assert pages == [8, 16, 16, 32]
    assert page_bytes(model, 16, torch.float8_e5m2) == float32_page // 4
