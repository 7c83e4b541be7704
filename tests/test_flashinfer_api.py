"""The calls the flashinfer backend makes, bound to the installed flashinfer's own signatures.

The backend's CPU tests run it against a stand-in module (flashinfer_oracle.py). This test
records every constructor and plan() call the backend makes through that stand-in (eager
passes, graph passes, decode and prefill, masks) and binds each one to the real wrapper's
signature, so a parameter flashinfer does not take, or one it requires and is not given,
fails here. It runs wherever flashinfer imports (the GPU check installs it; on a CPU
machine it imports with `torch.cuda.get_device_properties` patched to describe an sm_90
device, and this test passes there too); elsewhere it is skipped.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from flashinfer_oracle import stand_in_module
from test_triton_attention import DECODES, MIXED, random_batch

from eaglesrv.kernels.attention.flashinfer_paged import FlashinferAttentionBackend
from eaglesrv.kernels.attention.torch_ref import TorchAttentionBackend

CPU = torch.device("cpu")
pytestmark = pytest.mark.gpu  # so that scripts/gpu_check.sh, which installs flashinfer, runs it


@pytest.fixture(scope="module")
def flashinfer():
    try:
        import flashinfer
    except Exception as error:  # not installed, or no GPU to import on
        pytest.skip(f"flashinfer does not import here ({type(error).__name__})")
    return flashinfer


def recorded_calls():
    """(wrapper class name, method, args, kwargs) of every call the backend makes."""
    module = stand_in_module()
    calls = []
    for name in ("BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper"):
        build = getattr(module, name)

        def recording(*args, _name=name, _build=build, **kwargs):
            calls.append((_name, "__init__", args, kwargs))
            wrapper = _build(*args, **kwargs)
            plan = wrapper.plan

            def recorded_plan(*plan_args, **plan_kwargs):
                calls.append((_name, "plan", plan_args, plan_kwargs))
                return plan(*plan_args, **plan_kwargs)

            wrapper.plan = recorded_plan
            return wrapper

        setattr(module, name, recording)
    backend = FlashinferAttentionBackend(16, CPU, module=module, workspace_bytes=16)
    heads = (8, 2, 16)
    for shape in (MIXED, DECODES):  # eager: prefill with masks, decode
        spans, k_cache, v_cache, q, k, v = random_batch(shape, heads, 16, torch.float32)
        backend.forward(q, k, v, k_cache, v_cache, backend.plan(spans), 0.25)
    for num_new in (1, 4):  # graph passes: decode and the draft extend, inside a planning session
        spans, k_cache, v_cache, q, k, v = random_batch([(9, num_new, False), (30, num_new, False)], heads, 16,
                                                        torch.float32)
        table = torch.tensor([span.page_table + [0] * (4 - len(span.page_table)) for span in spans], dtype=torch.int32)
        num_cached = torch.tensor([span.num_cached for span in spans], dtype=torch.int32)
        with backend.uniform_planner().session({"block_table": table, "num_cached": num_cached},
                                               {"block_table": table, "num_cached": num_cached}, graphed=True):
            metadata = backend.uniform_metadata(table, num_cached, num_new)
            out = backend.forward(q, k, v, k_cache, v_cache, metadata, 0.25)
        reference = TorchAttentionBackend(16, CPU)
        torch.testing.assert_close(out, reference.forward(q, k, v, k_cache.clone(), v_cache.clone(),
                                                          reference.plan(spans), 0.25))
    return calls


def test_every_call_binds_to_the_installed_signatures(flashinfer):
    calls = recorded_calls()
    seen = {(name, method) for name, method, _, _ in calls}
    assert seen == {(name, method) for name in ("BatchPrefillWithPagedKVCacheWrapper",
                                                 "BatchDecodeWithPagedKVCacheWrapper")
                    for method in ("__init__", "plan")}
    assert any(kwargs.get("use_cuda_graph") for _, method, _, kwargs in calls if method == "__init__")
    for name, method, args, kwargs in calls:
        real = getattr(getattr(flashinfer, name), method)
        signature = inspect.signature(real)
        signature.bind(None, *args, **kwargs)  # None for self
        if "kwargs" in signature.parameters and method == "plan":  # decode's plan forwards **kwargs
            inner = inspect.signature(getattr(flashinfer, name)._plan_impl)
            inner.bind(None, *args, **kwargs)
