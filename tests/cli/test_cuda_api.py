"""torch.cuda APIs under CUDA compatibility, each checked in a real subprocess (the results
back the table in docs/compatibility.md)."""

import json
import os
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_api_probe.py")


@pytest.fixture(scope="module")
def results(node):
    proc = subprocess.run([sys.executable, PROBE, node.address], capture_output=True, text=True, timeout=180)
    line = next((line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")), None)
    assert line, proc.stdout + proc.stderr
    return json.loads(line[len("RESULTS "):])


WORKS = ["is_available", "device_count", "get_device_name", "get_device_properties", "get_device_capability",
         "mem_get_info", "current_device", "set_device", "is_bf16_supported",
         "memory_allocated/max_memory_allocated/reset_peak/empty_cache", "synchronize", "Event.elapsed_time", "Stream",
         "manual_seed/get_rng_state/set_rng_state", "tensor.cuda()", "to('cuda:0')", "device=torch.device('cuda')",
         "is_cuda", "device.type == 'cuda'", "Module.cuda()", "set_default_device('cuda')", "pin_memory + non_blocking",
         "autocast('cuda')", "autocast('cuda', dtype=torch.float32)", "nn.LSTM on cuda (no cuDNN warning)", "torch.profiler with ProfilerActivity.CUDA", "Tensor.record_stream", "torch functions that make tensors on the input's device",
         "custom autograd.Function backward making cuda tensors", "flex_attention (eager)",
         "sync debug mode and memory history", "RNNs under autocast", "out of memory as libraries see it",
         "GradScaler('cuda')", "torch.save/torch.load(map_location='cuda')",
         "torch.load(map_location=lambda storage, loc: storage.cuda())",
         "set_default_tensor_type('torch.cuda.FloatTensor')",
         "torch.save tags cuda:0; torch.jit.load(map_location='cuda')", "torch.cuda.initial_seed",
         "cuda:1 refused with one GPU", "torch.cuda.default_generators", "torch.compile", "nn.DataParallel",
         "torch.accelerator", "torch.cuda.nvtx", "double backward through attention", "Generator(device='cuda')", "torch.cuda.FloatTensor and friends",
         "set_per_process_memory_fraction", "torch.cuda.device / device_of / StreamContext",
         "synchronize('cpu') refused", "device mismatch messages name cuda:0",
         "streams are distinct; _cuda_setStream", "C++ warnings shown at the program's line",
         "Python warnings shown at the caller's line",
         "get_per_process_memory_fraction, memory_stats_as_nested_dict, device_memory_used",
         "torch._refs / prims / torch.nested on cuda tensors", "torch.export of a model on cuda tensors",
         "is_current_stream_capturing", "can_device_access_peer / get_allocator_backend",
         "pinned factories, safetensors load_file/safe_open(device='cuda')",
         "extension op with a CPU kernel on cuda tensors", "numpy() of a cuda tensor refused as CUDA does"]


@pytest.mark.parametrize("api", WORKS)
def test_cuda_api_works(results, api):
    assert results[api]["ok"], results[api]
    value = results[api]["value"]
    assert value is not False and not (isinstance(value, list) and any(v is False for v in value)), results[api]


def test_reported_values(results):
    assert results["is_available"]["value"] is True
    assert results["device_count"]["value"] == 1
    assert "gpuwire" in results["get_device_name"]["value"]
    assert results["tensor.cuda()"]["value"] == "cuda:0"
    assert results["autocast('cuda')"]["value"] == ["torch.float16", "torch.float32", "torch.bfloat16"]
    assert results["autocast('cuda', dtype=torch.float32)"]["value"] == [True, "torch.float32", "torch.float32"]
    assert results["torch.save/torch.load(map_location='cuda')"]["value"] == "cuda:0"


def test_device_properties_nvml_readings_and_nccl_version_answer_as_on_cuda(results):
    # printed (scripts log it) as CUDA's `_CudaDeviceProperties(...)`, not `namespace(...)`
    printed = results["get_device_properties printed as CUDA's"]["value"]
    assert printed.startswith("_CudaDeviceProperties(name='gpuwire") and "total_memory=" in printed, printed
    # pynvml-backed readings raised ModuleNotFoundError; utilization is the node's (idle here)
    readings = results["NVML readings"]
    assert readings["ok"] and all(isinstance(v, int) and 0 <= v <= 100 for v in readings["value"]), readings
    assert results["torch.cuda.nccl.version"] == {"ok": True, "value": [2, 27, 5]}
    for refused in ("jiterator refused", "caching_allocator_alloc refused"):
        assert not results[refused]["ok"] and "not supported by gpuwire" in results[refused]["error"], results[refused]


def test_reference_ops_and_nested_factories_make_cuda_tensors(results):
    assert results["torch._refs / prims / torch.nested on cuda tensors"]["value"] == ["cuda:0"] * 4 + [True]


def test_cuda_graphs_fail_with_a_clear_message(results):
    for refused in ("torch.cuda.graphs", "torch.cuda.MemPool"):  # (MemPool: graphs' private memory)
        assert not results[refused]["ok"]
        assert "not supported by gpuwire" in results[refused]["error"]


def test_storage_cuda_in_map_location_loads_onto_the_remote_gpu(results):
    """``torch.load(path, map_location=lambda storage, loc: storage.cuda())`` (older scripts)
    reached ``torch.UntypedStorage(n, device="cuda")``, which PyTorch refused on a machine
    without CUDA: the tensors load onto the remote GPU with their values."""
    value = results["torch.load(map_location=lambda storage, loc: storage.cuda())"]
    assert value["ok"], value
    assert value["value"] == ["cuda:0", "cuda:0", [0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], "gpuwire", 8]


def test_default_tensor_type_cuda_puts_new_tensors_on_the_remote_gpu(results):
    """``torch.set_default_tensor_type('torch.cuda.FloatTensor')`` raised ("only floating-point
    types"): factories, ``torch.Tensor(...)`` and modules make cuda tensors as on a CUDA machine
    (``torch.FloatTensor`` stays the CPU type there too); a CPU type puts it back."""
    value = results["set_default_tensor_type('torch.cuda.FloatTensor')"]
    assert value["ok"], value
    assert value["value"] == ["cuda:0", "cuda:0", "cuda:0", "cuda:0", "cpu", [1.5, 2.5], [2, 3],
                              "torch.float64", "cuda:0", "cpu", "cpu", "torch.float32"]


def test_what_a_program_saves_is_tagged_cuda_and_torchscript_maps_to_the_remote_gpu(results):
    value = results["torch.save tags cuda:0; torch.jit.load(map_location='cuda')"]
    assert value["ok"], value
    assert value["value"] == ["cuda:0", "cuda:0", True, "cuda:0"]


def test_initial_seed_is_the_seed_the_device_was_given(results):
    assert results["torch.cuda.initial_seed"] == {"ok": True, "value": [77, 5]}


def test_a_device_index_past_the_sessions_gpus_is_refused(results):
    assert results["cuda:1 refused with one GPU"] == {"ok": True, "value": [True, True, True, True, True, True, True,
                                                                              "cuda:0", True]}


def test_default_generators_is_the_sessions_generator(results):
    assert results["torch.cuda.default_generators"] == {"ok": True, "value": [1, "cuda:0", 3, True, True]}
