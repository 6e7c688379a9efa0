"""Loading weights straight onto the gpuwire device natively (no ``gpuwire run``): safetensors'
``load_file`` / ``safe_open`` with ``device="gpuwire"`` (its Rust parser refused the name) and
Hugging Face's ``from_pretrained(device_map=...)``, compared with the file's values on CPU."""

import os
import subprocess
import sys

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture
def weights_file(tmp_path):
    weights = {"w": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
               "steps": torch.arange(4, dtype=torch.int64),
               "half": torch.linspace(-1, 1, 7).to(torch.bfloat16)}
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file(weights, str(path))
    return path, weights


@pytest.mark.parametrize("named", ["gpuwire", "gpuwire:0", torch.device("gpuwire"), torch.device("gpuwire", 0)],
                         ids=["str", "str-index", "device", "device-index"])
def test_load_file_onto_the_device(device, weights_file, named):
    path, weights = weights_file
    loaded = safetensors_torch.load_file(str(path), device=named)
    assert loaded.keys() == weights.keys()
    for name, tensor in loaded.items():
        assert tensor.device.type == "gpuwire"
        assert tensor.dtype == weights[name].dtype
        assert torch.equal(tensor.cpu(), weights[name])


def test_safe_open_onto_the_device_and_the_host(device, weights_file):
    from safetensors import safe_open
    path, weights = weights_file
    with safe_open(str(path), framework="pt", device="gpuwire") as f:
        remote = f.get_tensor("w")
        assert remote.device.type == "gpuwire"
        assert torch.equal(remote.cpu(), weights["w"])
    with safe_open(str(path), framework="pt") as f:  # the host, as before
        assert f.get_tensor("w").device.type == "cpu"
    with pytest.raises(Exception, match="invalid"):  # other names are still safetensors' to judge
        safe_open(str(path), framework="pt", device="nonsense")


def test_safetensors_imported_before_torch(node, weights_file):
    """A program that imports safetensors first (so before gpuwire loads with torch)."""
    path, weights = weights_file
    program = ("import safetensors.torch as st\nimport torch\n"
               f"t = st.load_file({str(path)!r}, device='gpuwire')['w']\n"
               "print(t.device, t.cpu().sum().item())\n")
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GPUWIRE_NODE": node.address})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["gpuwire:0", str(weights["w"].sum().item())]


@pytest.mark.parametrize("device_map", ["gpuwire", {"": "gpuwire"}, {"": 0}], ids=["str", "dict", "index"])
def test_from_pretrained_with_a_device_map(device, tmp_path, device_map):
    transformers = pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    local = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)).eval()
    local.save_pretrained(tmp_path)
    remote = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map)
    assert {p.device.type for p in remote.parameters()} == {"gpuwire"}
    assert remote.lm_head.weight is remote.transformer.wte.weight  # (tied, as loaded on CPU)
    prompt = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(remote(prompt.to("gpuwire")).logits.cpu(), local(prompt).logits)
