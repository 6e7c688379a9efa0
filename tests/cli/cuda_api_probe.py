"""Exercises torch.cuda APIs under CUDA compatibility; prints one JSON object of results.

Run in a subprocess by test_cuda_api.py (compatibility patches are process-wide)."""

import json
import os
import sys
import tempfile

import torch

import gpuwire

gpuwire.attach(sys.argv[1], cuda_compat=True)
results = {}


def check(name, fn):
    try:
        value = fn()
        results[name] = {"ok": True, "value": value if isinstance(value, (int, float, str, bool, list, type(None))) else repr(value)}
    except Exception as exc:  # noqa: BLE001
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}


check("is_available", lambda: torch.cuda.is_available())
check("device_count", lambda: torch.cuda.device_count())
check("get_device_name", lambda: torch.cuda.get_device_name(0))
check("get_device_properties", lambda: torch.cuda.get_device_properties(0).total_memory > 0)
check("get_device_capability", lambda: list(torch.cuda.get_device_capability()))
check("mem_get_info", lambda: list(torch.cuda.mem_get_info()))
check("current_device", lambda: torch.cuda.current_device())
check("set_device", lambda: torch.cuda.set_device(0))
check("is_bf16_supported", lambda: torch.cuda.is_bf16_supported())
check("get_device_properties printed as CUDA's", lambda: repr(torch.cuda.get_device_properties(0)))
check("NVML readings", lambda: [torch.cuda.utilization(), torch.cuda.temperature(), torch.cuda.power_draw(),
                                torch.cuda.clock_rate(), torch.cuda.memory_usage()])
check("torch.cuda.nccl.version", lambda: list(torch.cuda.nccl.version()))
# (made at import by modules, PyTorch's OpInfo database among them: refused only when called)
jiterator_kernel = torch.cuda.jiterator._create_jit_fn("template <typename T> T f(T x) { return x; }")
check("jiterator refused", lambda: jiterator_kernel(torch.ones(2, device="cuda")))
check("caching_allocator_alloc refused", lambda: torch.cuda.caching_allocator_alloc(1024))


def memory_stats():
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    x = torch.empty(1 << 20, device="cuda")
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    del x
    torch.cuda.empty_cache()
    return [after - before >= 4 << 20, peak >= after]


check("memory_allocated/max_memory_allocated/reset_peak/empty_cache", memory_stats)
check("synchronize", lambda: torch.cuda.synchronize())


def synchronize_refuses_the_cpu():
    try:
        torch.cuda.synchronize("cpu")
    except ValueError as exc:
        return "Expected a cuda device" in str(exc)
    return False


check("synchronize('cpu') refused", synchronize_refuses_the_cpu)


def device_mismatch_messages():
    """A host tensor among "cuda" ones: the message names cuda:0 (PyTorch's own checks said
    gpuwire:0) and, for ``host @ cuda``, the host operand (it named an ``out`` the program never
    passed)."""
    host, gpu = torch.ones(2, 2), torch.ones(2, 2, device="cuda")
    said = []
    for call in (lambda: host + gpu, lambda: host @ gpu, lambda: gpu @ host):
        try:
            call()
            said.append("no error")
        except RuntimeError as exc:
            said.append(str(exc))
    return [all("cuda:0" in s and "gpuwire" not in s for s in said), "got self is on cpu" in said[1],
            "got mat2 is on cpu" in said[2]]


check("device mismatch messages name cuda:0", device_mismatch_messages)


def warnings_at_the_programs_line():
    """A warning from PyTorch's C++ during a torch call was shown at gpuwire's
    ``__torch_function__`` line (cuda_compat.py), as if gpuwire raised it."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        float(torch.ones(1, device="cuda", requires_grad=True))
    return [w.filename for w in caught if "requires_grad=True to a scalar" in str(w.message)] == [__file__]


check("C++ warnings shown at the program's line", warnings_at_the_programs_line)


def python_warnings_at_the_callers_line():
    """A torch function written in Python warns of its caller's arguments (``stacklevel=2``):
    under the mode that named ``__torch_function__``'s frame or torch's own line, so two
    calling lines were warned once, and a ``module=`` filter of the program never matched."""
    import warnings

    import torch.nn.functional as F
    x = torch.randn(4, 3, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        F.dropout2d(x, 0.25)  # (a 2-D input: deprecated)
        F.dropout2d(x, 0.25)
    lines = [(w.filename, w.lineno) for w in caught if "dropout2d" in str(w.message)]
    here = python_warnings_at_the_callers_line.__code__.co_firstlineno
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="dropout2d", module="__main__")
        try:
            F.dropout2d(x, 0.25)
            filtered = False
        except UserWarning:
            filtered = True
    return lines == [(__file__, here + 10), (__file__, here + 11)] and filtered


check("Python warnings shown at the caller's line", python_warnings_at_the_callers_line)


def memory_queries_of_torch_2_13():
    """Memory functions newer scripts call; each raised AttributeError for a missing torch._C
    function before session 40."""
    torch.cuda.set_per_process_memory_fraction(0.25)
    fraction = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.set_per_process_memory_fraction(1.0)
    x = torch.empty(1000, device="cuda")
    nested = torch.cuda.memory_stats_as_nested_dict()
    used = torch.cuda.device_memory_used()
    torch.cuda.reset_peak_host_memory_stats()
    return [fraction == 0.25, torch.cuda.get_per_process_memory_fraction() == 1.0,
            nested["allocated_bytes"]["all"]["current"] == torch.cuda.memory_allocated() >= 4000,
            used >= 4000, isinstance(torch.cuda.host_memory_stats(), dict), x.numel() == 1000]


check("get_per_process_memory_fraction, memory_stats_as_nested_dict, device_memory_used",
      memory_queries_of_torch_2_13)


def reference_ops_and_nested_factories():
    """PyTorch's Python-level op layers on "cuda" tensors (found by PyTorch's test_ops.py run
    under gpuwire run: 868 of its CUDA tests failed on these): a prim's Python kernel read
    ``a.device`` as "cuda" with the mode off and asked PyTorch's CUDA backend for its result;
    ``torch._refs`` ops refused the patched ``Tensor.device`` getter; ``torch.nested``'s
    factories handed "cuda" straight to C++."""
    import torch._refs
    from torch._prims.context import TorchRefsMode
    x = torch.rand(3, device="cuda")
    with TorchRefsMode():
        masked = torch.masked_fill(x, x > 0.5, 0.0)
    return [str(torch.ops.prims.sqrt(x).device), str(torch._refs.add(x, x).device), str(masked.device),
            str(torch.nested.nested_tensor([], device="cuda").device),
            torch.equal(torch.ops.prims.sqrt(x).cpu(), x.cpu().sqrt())]


check("torch._refs / prims / torch.nested on cuda tensors", reference_ops_and_nested_factories)


def export_of_a_cuda_model():
    """``torch.export`` traces with fake tensors: the fake of a "cuda" tensor landed on a real
    ``cuda:0`` beside its factories' gpuwire ones ("found at least two devices")."""
    class AddRange(torch.nn.Module):
        def forward(self, x):
            return x * 2 + torch.arange(3.0, device=x.device)

    x = torch.randn(3, device="cuda")
    exported = torch.export.export(AddRange(), (x,))
    return torch.equal(exported.module()(x).cpu(), (x * 2 + torch.arange(3.0, device="cuda")).cpu())


check("torch.export of a model on cuda tensors", export_of_a_cuda_model)


def events():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) > 0


check("Event.elapsed_time", events)


def streams():
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = torch.ones(3, device="cuda") + 1
    torch.cuda.current_stream().wait_stream(s)
    return y.sum().item()


check("Stream", streams)


def stream_identity():
    """Streams are distinct objects (every stream was equal to every other, and the current
    stream never changed); PyTorch's test harness switches them with ``torch._C._cuda_setStream``
    (an AttributeError before session 40, before every CUDA test of a TestCase that asks for it)."""
    default, first, second = torch.cuda.default_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    distinct = default != first and first != second and len({default, first, second}) == 3
    with torch.cuda.stream(first):
        inside = torch.cuda.current_stream() == first
    restored = torch.cuda.current_stream() == default
    torch._C._cuda_setStream(stream_id=second.stream_id, device_index=second.device_index,
                             device_type=second.device_type)
    switched = torch.cuda.current_stream() == second
    torch._C._cuda_setStream(stream_id=0, device_index=0, device_type=default.device_type)
    torch._C._cuda_setDevice(torch._C._cuda_getDevice())
    return [distinct, inside, restored, switched, torch.cuda.current_stream() == default, default.cuda_stream == 0]


check("streams are distinct; _cuda_setStream", stream_identity)


def rng():
    torch.cuda.manual_seed(3)
    a = torch.randn(4, device="cuda").tolist()
    torch.cuda.manual_seed_all(3)
    b = torch.randn(4, device="cuda").tolist()
    state = torch.cuda.get_rng_state()
    c = torch.rand(4, device="cuda").tolist()
    torch.cuda.set_rng_state(state)
    d = torch.rand(4, device="cuda").tolist()
    return a == b and c == d


check("manual_seed/get_rng_state/set_rng_state", rng)
check("tensor.cuda()", lambda: str(torch.ones(2).cuda().device))
check("to('cuda:0')", lambda: str(torch.ones(2).to("cuda:0").device))
check("device=torch.device('cuda')", lambda: str(torch.zeros(2, device=torch.device("cuda")).device))
check("is_cuda", lambda: torch.ones(2, device="cuda").is_cuda)
check("device.type == 'cuda'", lambda: torch.ones(2, device="cuda").device.type == "cuda")
check("Module.cuda()", lambda: next(torch.nn.Linear(2, 2).cuda().parameters()).is_cuda)


def default_device():
    torch.set_default_device("cuda")
    try:
        return str(torch.ones(2).device)
    finally:
        torch.set_default_device("cpu")


check("set_default_device('cuda')", default_device)
check("pin_memory + non_blocking", lambda: torch.ones(3).pin_memory().to("cuda", non_blocking=True).sum().item())


def autocast():
    a = torch.randn(8, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        mm = a @ a
        soft = torch.softmax(mm, -1)
    with torch.cuda.amp.autocast(dtype=torch.bfloat16):
        lin = torch.nn.functional.linear(a, a)
    return [str(mm.dtype), str(soft.dtype), str(lin.dtype)]


check("autocast('cuda')", autocast)


def autocast_float32():
    """CUDA's autocast takes float32 (nanoGPT's float32 config): enabled, no warning, and
    lower-precision ops run in float32."""
    import warnings
    a = torch.randn(8, 8, device="cuda").bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cuda", dtype=torch.float32):
            enabled = torch.is_autocast_enabled("cuda")
            mm = a @ a
        with torch.cuda.amp.autocast(dtype=torch.float32):
            lin = torch.nn.functional.linear(a, a)
    return [enabled, str(mm.dtype), str(lin.dtype)]


check("autocast('cuda', dtype=torch.float32)", autocast_float32)


def lstm_quietly():
    """nn.LSTM on "cuda": flatten_parameters asks cuDNN about the weights (.cuda(), forward); a
    gpuwire tensor is never cuDNN's, without the "compiled without cuDNN" warning; equal to CPU."""
    import copy
    import warnings
    torch.manual_seed(0)
    local = torch.nn.LSTM(8, 16, num_layers=2)
    x = torch.randn(5, 3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remote = copy.deepcopy(local).cuda()  # Module._apply flattens the weights
        out, _ = remote(x.cuda())
    return torch.equal(out.cpu(), local(x)[0])


check("nn.LSTM on cuda (no cuDNN warning)", lstm_quietly)


def profiler_with_cuda_activity():
    """torch.profiler with ProfilerActivity.CUDA (and the legacy use_cuda=True): CUDA kernel
    timings cannot be collected here; the profile of this process is, without a "Failed to
    record CUDA event" printed (by C++, on fd 2) for every op."""
    from torch.profiler import ProfilerActivity, profile
    model = torch.nn.Linear(16, 16).cuda()
    x = torch.randn(4, 16, device="cuda")
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model(x).relu().sum().item()
            with torch.autograd.profiler.profile(use_cuda=True) as legacy:
                model(x).sum().item()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        stderr = captured.read().decode(errors="replace")
    names = {event.key for event in prof.key_averages()}
    return ["Failed to record CUDA event" not in stderr, "aten::addmm" in names,
            any(event.name == "aten::addmm" for event in legacy.function_events)]


check("torch.profiler with ProfilerActivity.CUDA", profiler_with_cuda_activity)


def record_stream():
    x = torch.ones(3, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x * 2
    y.record_stream(side)
    x.record_stream(torch.cuda.current_stream())
    torch.cuda.current_stream().wait_stream(side)
    return y.sum().item() == 6.0


check("Tensor.record_stream", record_stream)


def functions_that_make_tensors_on_their_inputs_device():
    """Python-level torch functions create tensors with ``device=input.device`` while the
    compatibility mode is off (PyTorch pops a mode while its handler runs): F.embedding_bag of
    a 2-D input (its offsets), multi-head attention with add_zero_attn. User code, hooks and
    custom backward functions still see "cuda"."""
    F = torch.nn.functional
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(10, 4, mode="mean")
    ids = torch.randint(0, 10, (3, 5))
    expected = bag(ids)
    same_bag = torch.equal(bag.cuda()(ids.cuda()).cpu(), expected)
    mha = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True)
    q = torch.randn(5, 2, 8)
    local_out = mha(q, q, q)[0]
    q_cuda = q.cuda()  # one tensor, as locally: MHA packs the projections only when q is k is v
    same_mha = torch.equal(mha.cuda()(q_cuda, q_cuda, q_cuda)[0].cpu(), local_out)
    seen = []
    z = torch.randn(3, requires_grad=True, device="cuda")
    z.register_hook(lambda grad: seen.append(str(grad.device)))
    (F.softplus(z) * 2).sum().backward()
    return [same_bag, same_mha, seen == ["cuda:0"], str(z.device), "device='cuda:0'" in repr(z)]


check("torch functions that make tensors on the input's device", functions_that_make_tensors_on_their_inputs_device)


def python_backward_code_makes_cuda_tensors():
    """Autograd runs backward on its device thread; the program's backward code there (a custom
    ``autograd.Function.backward``, a reentrant checkpoint) still has ``"cuda"`` rewritten."""
    class Shift(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(str(grad.device))
            return grad * 2 + torch.ones(3, device="cuda") + torch.zeros(3, device=grad.device)

    seen = []
    x = torch.randn(3, device="cuda", requires_grad=True)
    Shift.apply(x).sum().backward()
    lin = torch.nn.Linear(3, 3).cuda()
    y = torch.randn(4, 3, device="cuda", requires_grad=True)
    torch.utils.checkpoint.checkpoint(lambda t: lin(t).relu() + torch.ones(3, device="cuda"), y,
                                      use_reentrant=True).sum().backward()
    z = torch.randn(3, device="cuda", requires_grad=True)
    z.register_hook(lambda grad: grad + torch.ones(3, device="cuda"))  # a gradient hook, same thread
    (z * 2).sum().backward()
    return [x.grad.tolist() == [3.0, 3.0, 3.0], seen == ["cuda:0"], y.grad is not None,
            z.grad.tolist() == [3.0, 3.0, 3.0]]


check("custom autograd.Function backward making cuda tensors", python_backward_code_makes_cuda_tensors)


def flex_attention_eager():
    """``flex_attention`` without torch.compile runs a higher-order op's Python implementation,
    which makes its index tensors on the inputs' device; equal to CPU, and its backward runs."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    score_mod = lambda s, b, h, qi, kv: s + (qi - kv) * 0.05  # noqa: E731
    causal = lambda b, h, qi, kv: qi >= kv  # noqa: E731
    local = flex_attention(q, k, v, score_mod=score_mod, block_mask=create_block_mask(causal, 1, 2, 32, 32, device="cpu"))
    qc, kc, vc = (t.cuda().requires_grad_() for t in (q, k, v))
    remote = flex_attention(qc, kc, vc, score_mod=score_mod,
                            block_mask=create_block_mask(causal, 1, 2, 32, 32, device="cuda"))
    remote.sum().backward()
    # the same attention in plain ops, for the gradients (CPU has no flex_attention backward)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    i = torch.arange(32)
    scores = qr @ kr.transpose(-2, -1) / 8 ** 0.5 + (i[:, None] - i[None, :]) * 0.05
    (scores.masked_fill(i[:, None] < i[None, :], float("-inf")).softmax(-1) @ vr).sum().backward()
    grads = all(torch.allclose(a.grad.cpu(), b.grad, atol=1e-5) for a, b in ((qc, qr), (kc, kr), (vc, vr)))
    return [torch.equal(remote.detach().cpu(), local), grads, str(remote.device)]


check("flex_attention (eager)", flex_attention_eager)


def debugging_aids():
    """Sync debug mode and memory-history recording: accepted (scripts turn them on); the
    snapshot is empty since the allocations live in the node's allocator."""
    torch.cuda.set_sync_debug_mode("warn")
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.memory._record_memory_history(max_entries=1000)
    torch.randn(10, device="cuda").sum().item()
    path = os.path.join(tempfile.mkdtemp(), "snapshot.pickle")
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    return [mode == 1, torch.cuda.get_sync_debug_mode() == 0, sorted(torch.cuda.memory._snapshot()) ==
            ["allocator_settings", "device_traces", "segments"], os.path.getsize(path) > 0,
            torch.cuda.memory_snapshot() == []]


check("sync debug mode and memory history", debugging_aids)


def rnns_under_autocast():
    """cuDNN's autocast wrapper runs RNNs in float16 whatever the autocast dtype; so do they
    here: outputs and hidden states float16 (close to the float32 CPU run), gradients float32."""
    torch.manual_seed(0)
    found = []
    for cls in (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN):
        rnn = cls(8, 16, num_layers=2, batch_first=True)
        x = torch.randn(4, 5, 8)
        with torch.no_grad():
            reference = rnn(x)[0]
        rnn = rnn.cuda()
        for dtype in (torch.float16, torch.bfloat16):
            with torch.autocast("cuda", dtype=dtype):
                out, hidden = rnn(x.cuda())
            out.float().sum().backward()
            h = hidden[0] if isinstance(hidden, tuple) else hidden
            found.append([str(out.dtype), str(h.dtype), float((out.float().cpu() - reference).abs().max()) < 1e-2,
                          str(rnn.weight_ih_l0.grad.dtype)])
            rnn.zero_grad()
    return [found == [["torch.float16", "torch.float16", True, "torch.float32"]] * 6, repr(found)]


check("RNNs under autocast", rnns_under_autocast)


def grad_scaler():
    model = torch.nn.Linear(4, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(8, 4, device="cuda")).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale()


check("GradScaler('cuda')", grad_scaler)


def checkpoint():
    path = os.path.join(tempfile.mkdtemp(), "m.pt")
    model = torch.nn.Linear(3, 3).cuda()
    torch.save(model.state_dict(), path)
    loaded = torch.load(path, map_location="cuda")
    return str(loaded["weight"].device)


check("torch.save/torch.load(map_location='cuda')", checkpoint)


def checkpoint_mapped_by_storage():
    # older scripts: map_location=lambda storage, loc: storage.cuda()
    path = os.path.join(tempfile.mkdtemp(), "m.pt")
    torch.save({"w": torch.arange(4.0)}, path)
    loaded = [torch.load(path, map_location=lambda storage, loc: storage.cuda())["w"],
              torch.load(path, map_location=lambda storage, loc: storage.cuda(0))["w"]]
    moved = torch.UntypedStorage(8).cuda()
    return [str(w.device) for w in loaded] + [w.tolist() for w in loaded] + [moved.device.type, moved.nbytes()]


check("torch.load(map_location=lambda storage, loc: storage.cuda())", checkpoint_mapped_by_storage)


def saved_as_cuda():
    # what a program saves from its cuda tensors is tagged cuda:0, as on a CUDA machine (it was
    # gpuwire:0: nothing without gpuwire could load it); TorchScript loads with map_location="cuda"
    path = os.path.join(tempfile.mkdtemp(), "m.pt")
    weight = torch.nn.Linear(2, 2).cuda().weight.detach()
    torch.save({"w": weight}, path)
    scripted = os.path.join(os.path.dirname(path), "s.pt")
    torch.jit.script(torch.nn.Linear(2, 2)).save(scripted)
    loaded = torch.jit.load(scripted, map_location="cuda")
    return [torch.serialization.location_tag(weight.untyped_storage()), str(torch.load(path)["w"].device),
            torch.equal(torch.load(path)["w"].cpu(), weight.cpu()), str(next(loaded.parameters()).device)]


check("torch.save tags cuda:0; torch.jit.load(map_location='cuda')", saved_as_cuda)


def initial_seed_is_the_devices():
    torch.cuda.manual_seed(77)
    torch.rand(1, device="cuda")
    first = torch.cuda.initial_seed()
    torch.manual_seed(5)
    return [first, torch.cuda.initial_seed()]


check("torch.cuda.initial_seed", initial_seed_is_the_devices)


def cuda_1_is_refused_as_cuda_does():
    # it became cuda:0 without a word: a model split over two GPUs ran on one
    refused = []
    for make in (lambda: torch.ones(2, device="cuda:1"), lambda: torch.ones(2).to("cuda:1"),
                 lambda: torch.ones(2).to(torch.device("cuda", 3))):
        try:
            make()
        except RuntimeError as exc:
            refused.append("invalid device ordinal" in str(exc) and "torchrun" in str(exc))
    # as CUDA's: set_device raises a RuntimeError ("invalid device ordinal"), the property
    # functions an AssertionError ("Invalid device id"); they described a device 2 that was not there
    try:
        torch.cuda.set_device(1)
        refused.append(False)
    except RuntimeError as exc:
        refused.append("invalid device ordinal" in str(exc))
    for describe in (torch.cuda.get_device_name, torch.cuda.get_device_properties, torch.cuda.get_device_capability):
        try:
            describe(2)
            refused.append(False)
        except AssertionError as exc:
            refused.append("Invalid device id" in str(exc))
    torch.cuda.set_device(0)
    return refused + [str(torch.ones(1, device="cuda:0").device), torch.cuda.get_device_name(0) == torch.cuda.get_device_name()]


check("cuda:1 refused with one GPU", cuda_1_is_refused_as_cuda_does)


def default_generators():
    # the tuple was empty while device_count() said 1 (Megatron/DeepSpeed RNG trackers index it)
    g = torch.cuda.default_generators[0]
    g.manual_seed(3)
    first = torch.rand(2, device="cuda").tolist()
    state = g.get_state()
    second = torch.rand(2, device="cuda").tolist()
    g.set_state(state)
    again = torch.rand(2, device="cuda").tolist()
    torch.manual_seed(3)
    return [len(torch.cuda.default_generators), str(g.device), g.initial_seed(), second == again,
            torch.rand(2, device="cuda").tolist() == first]


check("torch.cuda.default_generators", default_generators)
check("nn.DataParallel", lambda: torch.nn.DataParallel(torch.nn.Linear(4, 4)).cuda()(torch.randn(2, 4)).shape[0])
check("torch.cuda.graphs", lambda: torch.cuda.CUDAGraph())
check("torch.cuda.MemPool", lambda: torch.cuda.MemPool())
check("torch.compile", lambda: torch.compile(torch.nn.Linear(2, 2).cuda())(torch.ones(1, 2, device="cuda")).shape[1])


def accelerator():
    device = torch.accelerator.current_accelerator()
    x = torch.ones(3, device=device) * 2
    torch.accelerator.synchronize()
    # the program is told "cuda", as its tensors' devices say (pytorch/examples' --accel picks
    # its device this way and autocasts on its type); it named "gpuwire" before session 31
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = x[None] @ x[:, None]
    return [torch.accelerator.is_available(), torch.accelerator.device_count() == 1, x.sum().item() == 6.0,
            device.type == "cuda", x.device.type == device.type, y.dtype == torch.bfloat16,
            torch.get_device_module(device) is torch.cuda]


check("torch.accelerator", accelerator)


def device_classes():
    # PyTorch's own code tests isinstance(x, torch.cuda.device): memory_cached, StreamContext
    with torch.cuda.device(0), torch.cuda.device("cuda:0"), torch.cuda.device_of(torch.ones(1, device="cuda")):
        with torch.cuda.StreamContext(torch.cuda.current_stream()):
            pass
    return [isinstance(torch.cuda.device(0), torch.cuda.device), torch.cuda.memory_cached() >= 0,
            torch.cuda.memory.mem_get_info()[1] > 0]


check("torch.cuda.device / device_of / StreamContext", device_classes)


def safetensors_onto_cuda():
    # safetensors stages a load onto "cuda" in pinned host buffers (torch.empty(..., pin_memory=True))
    from safetensors.torch import load_file, safe_open, save_file
    path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    save_file({"w": torch.arange(6.0).reshape(2, 3).cuda()}, path)
    loaded = load_file(path, device="cuda")["w"]
    with safe_open(path, framework="pt", device="cuda") as f:
        sliced = f.get_slice("w")[1:]
    return [str(loaded.device), loaded.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]],
            sliced.cpu().tolist() == [[3.0, 4.0, 5.0]], torch.empty(3, pin_memory=True).shape[0] == 3]


check("pinned factories, safetensors load_file/safe_open(device='cuda')", safetensors_onto_cuda)
# asked by SyncBatchNorm's forward before a host read, and by transformers
check("is_current_stream_capturing", lambda: torch.cuda.is_current_stream_capturing() is False)
check("can_device_access_peer / get_allocator_backend",
      lambda: [torch.cuda.can_device_access_peer(0, 0) is False, torch.cuda.get_allocator_backend() == "native"])


def nvtx():
    torch.cuda.nvtx.range_push("step")
    with torch.cuda.nvtx.range("inner"):
        torch.cuda.nvtx.mark("here")
    torch.cuda.nvtx.range_pop()
    return True


check("torch.cuda.nvtx", nvtx)


def double_backward_through_attention():
    # under this mode the recomputed attention's decomposition was sent back to the fused op,
    # which recomputed it again, for ever (the program hung)
    def penalty(device):
        x = torch.arange(48.0).div(17).sin().view(1, 2, 6, 4).to(device).requires_grad_()
        out = torch.nn.functional.scaled_dot_product_attention(x, x * 2, x.cos(), is_causal=True)
        (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        gx.square().sum().backward()
        return [out.detach().cpu(), gx.detach().cpu(), x.grad.cpu()]
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        want, got = penalty("cpu"), penalty("cuda")
    return [torch.equal(want[0], got[0]), torch.equal(want[1], got[1]),
            torch.allclose(want[2], got[2], rtol=1e-5, atol=1e-6)]


check("double backward through attention", double_backward_through_attention)


def generator():
    first = torch.randn(4, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    again = torch.randn(4, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    other = torch.randn(4, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    return [torch.equal(first.cpu(), again.cpu()), not torch.equal(first.cpu(), other.cpu())]


check("Generator(device='cuda')", generator)


def legacy_types():
    x = torch.cuda.FloatTensor([1.5, 2.5])
    empty = torch.cuda.LongTensor(2, 3)
    cast = torch.ones(2).type(torch.cuda.DoubleTensor)
    by_name = torch.ones(2).type("torch.cuda.HalfTensor")
    return [str(x.device) == "cuda:0", x.tolist() == [1.5, 2.5], isinstance(x, torch.cuda.FloatTensor),
            not isinstance(x, torch.cuda.LongTensor), x.type() == "torch.cuda.FloatTensor",
            empty.shape == (2, 3) and empty.dtype == torch.int64, cast.dtype == torch.float64 and cast.is_cuda,
            by_name.dtype == torch.float16 and by_name.is_cuda,
            torch.cuda.FloatTensor().shape == (0,)]  # (no arguments: an empty tensor, as CUDA's)


check("torch.cuda.FloatTensor and friends", legacy_types)


def memory_fraction():
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.5)
    try:
        torch.empty(int(total * 0.6) // 4, device="cuda")
        return False
    except torch.OutOfMemoryError as exc:
        refused_past_the_cap = "memory budget" in str(exc)
    # a later call replaces the cap (it only ever lowered it before session 40), and its
    # argument is checked as CUDA's is
    torch.cuda.set_per_process_memory_fraction(0.01)
    torch.cuda.set_per_process_memory_fraction(1.0)
    fits_again = torch.empty(int(total * 0.02) // 4, device="cuda").numel() > 0
    try:
        torch.cuda.set_per_process_memory_fraction(1)
        type_checked = False
    except TypeError as exc:
        type_checked = "must be `float`" in str(exc)
    return [refused_past_the_cap, fits_again, type_checked]


check("set_per_process_memory_fraction", memory_fraction)


def out_of_memory_as_libraries_see_it():
    """An allocation past the device's memory raises at its line (not at the next sync point),
    as torch.cuda.OutOfMemoryError with CUDA's wording, so batch-size finders recognise it:
    accelerate's find_executable_batch_size halves the batch until a step fits."""
    from accelerate.utils import find_executable_batch_size
    from lightning.pytorch.utilities.memory import is_oom_error

    try:
        torch.empty(1 << 50, device="cuda")
        at_the_line = False
    except torch.cuda.OutOfMemoryError as exc:
        at_the_line = len(exc.args) == 1 and exc.args[0].startswith("CUDA out of memory.") and is_oom_error(exc)
    # a small budget, so that the batches tried stay small on any machine
    cap = torch.cuda.get_device_properties(0).total_memory // 512
    torch.cuda.set_per_process_memory_fraction(1 / 512)
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def step(batch_size):
        tried.append(batch_size)
        x = torch.empty(batch_size, cap // 16, dtype=torch.uint8, device="cuda")  # 16 and more cannot fit
        return x.shape[0]

    fitted = step()
    return [at_the_line, tried[0] == 64, tried == sorted(set(tried), reverse=True), fitted == tried[-1], fitted < 16,
            len(tried) > 1]


check("out of memory as libraries see it", out_of_memory_as_libraries_see_it)


def extension_op_with_a_cpu_kernel():
    """An op outside aten with CPU (and, elsewhere, CUDA) kernels, as torchvision's nms or
    torch_scatter's: a node runs aten only, so it runs on the host and its result is on cuda."""
    lib = torch.library.Library("gwprobe", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CPU")
    x = torch.randn(5)
    y = torch.ops.gwprobe.twice(x.cuda())
    return [y.is_cuda, torch.equal(y.cpu(), x * 2)]


check("extension op with a CPU kernel on cuda tensors", extension_op_with_a_cpu_kernel)


def numpy_of_a_cuda_tensor_refused_as_cuda():
    import numpy as np

    messages = []
    for convert in (lambda t: t.numpy(), np.asarray):
        try:
            convert(torch.ones(2, device="cuda"))
        except TypeError as exc:
            messages.append(str(exc))
    return [len(messages) == 2] + [m.startswith("can't convert cuda:0 device type tensor to numpy") for m in messages] \
        + [torch.ones(2).numpy().tolist() == [1.0, 1.0]]


check("numpy() of a cuda tensor refused as CUDA does", numpy_of_a_cuda_tensor_refused_as_cuda)


def default_tensor_type_cuda():
    # 2018-era scripts: torch.set_default_tensor_type('torch.cuda.FloatTensor'); it raised
    import warnings
    warnings.simplefilter("ignore")  # (PyTorch deprecates the function)
    torch.set_default_tensor_type("torch.cuda.FloatTensor")
    try:
        made = [torch.zeros(2), torch.Tensor([1.5, 2.5]), torch.Tensor(2, 3), torch.nn.Linear(2, 2).weight,
                torch.FloatTensor([1.0])]
        seen = [str(t.device) for t in made] + [made[1].tolist(), list(made[2].shape)]
        torch.set_default_tensor_type(torch.cuda.DoubleTensor)
        seen += [str(torch.ones(1).dtype), str(torch.Tensor([1]).device)]
    finally:
        torch.set_default_tensor_type("torch.FloatTensor")
    return seen + [str(torch.zeros(1).device), str(torch.Tensor([1]).device), str(torch.get_default_dtype())]


check("set_default_tensor_type('torch.cuda.FloatTensor')", default_tensor_type_cuda)
print("RESULTS " + json.dumps(results))
