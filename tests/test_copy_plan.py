"""Copy plans (lora/copy_plan.py): the second adapter of a recipe is laid out straight from
its file bytes. Oracle: the whole way (peft_loader's parse, validate, group and repack, then
the manager's slot image) on the same files; the plan's image must equal it bit for bit.
The engine-level parity tests (PEFT oracle) load many adapters of one recipe, so they run
the plan path too."""

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_tpu_lora import LoRARequest
from vllm_tpu_lora.lora import manager as manager_module
from vllm_tpu_lora.lora.layers import wrap_lora_layers
from vllm_tpu_lora.lora.manager import LoRAManager
from vllm_tpu_lora.lora.peft_loader import adapter_fingerprint, read_adapter_bytes
from vllm_tpu_lora.lora.punica import PunicaWrapper
from vllm_tpu_lora.models.loader import load_model
from vllm_tpu_lora.testing.factory import make_peft_adapter


def _manager(model_dir: str, dtype=torch.float32, transposed=True, **flags) -> LoRAManager:
    """A LoRA manager over our model on the host (loading touches no device buffer), its
    slots transposed as the fused xla path holds them, or as PEFT's (tensor parallel and
    Pallas)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        model = load_model(model_dir, json.load(f), 16, torch.float32)
    punica = PunicaWrapper("xla", fuse_slices=transposed)
    assert punica.weights_transposed == transposed
    layers = wrap_lora_layers(model, punica, 2, 16, dtype,
                              bias=flags.get("allow_bias", False),
                              dora=flags.get("allow_dora", False))
    return LoRAManager(model, layers, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
                       dtype=dtype, **flags)


@pytest.fixture
def whole_way_calls(monkeypatch):
    """How often the manager parsed an adapter the whole way."""
    calls = []
    real = manager_module.load_peft_adapter

    def counted(request, *args, **kwargs):
        if not kwargs.get("header_only"):
            calls.append(request.lora_name)
        return real(request, *args, **kwargs)

    monkeypatch.setattr(manager_module, "load_peft_adapter", counted)
    return calls


def _to_bf16_file(path: str) -> str:
    """Re-save an adapter's weights in bfloat16 (as adapters trained in bf16 ship)."""
    file = os.path.join(path, "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(file).items()}, file,
              metadata={"format": "pt"})
    return path


RECIPES = {
    "plain": (dict(r=8), torch.float32, False),
    # per-module ranks and alphas, rsLoRA, a subset of modules (absent slices stay zero)
    "patterns": (dict(r=8, use_rslora=True, rank_pattern={"q_proj": 4, "down_proj": 16},
                      alpha_pattern={"up_proj": 40}, target_modules=["q_proj", "v_proj",
                                                                     "up_proj", "down_proj"]),
                 torch.float32, False),
    "bf16_files": (dict(r=8), torch.float32, True),
    "bf16_serving": (dict(r=8), torch.bfloat16, False),
}


@pytest.mark.parametrize("case,transposed", [(c, True) for c in sorted(RECIPES)]
                         + [("patterns", False), ("bf16_files", False)])
def test_plan_image_equals_the_whole_way(llama_dir, tmp_path, whole_way_calls, case,
                                         transposed):
    kwargs, dtype, bf16_files = RECIPES[case]
    m = _manager(llama_dir, dtype, transposed)
    reqs = []
    for i in range(3):
        path = make_peft_adapter(llama_dir, str(tmp_path / f"a{i}"), seed=i, init_std=0.05,
                                 **kwargs)
        reqs.append(LoRARequest(f"a{i}", i + 1, _to_bf16_file(path) if bf16_files else path))
    first = m._load_host(reqs[0])
    assert whole_way_calls == ["a0"]
    later = [m._load_host(r) for r in reqs[1:]]
    assert whole_way_calls == ["a0"], "the recipe's later adapters went the whole way"
    for req, host in zip(reqs[1:], later):
        reference = m._load_whole_way(req)
        assert host.name == req.lora_name and host.flat.dtype == dtype
        assert torch.equal(host.flat, reference.flat)
        assert not torch.equal(host.flat, first.flat)  # other values, same recipe


def test_other_recipes_go_the_whole_way(llama_dir, tmp_path, whole_way_calls):
    """Another rank is another recipe; DoRA adapters (per-slot vectors) have no plan."""
    m = _manager(llama_dir, allow_dora=True)
    paths = [make_peft_adapter(llama_dir, str(tmp_path / "r8"), r=8, init_std=0.05),
             make_peft_adapter(llama_dir, str(tmp_path / "r4"), r=4, init_std=0.05),
             make_peft_adapter(llama_dir, str(tmp_path / "dora1"), r=8, init_std=0.05,
                               use_dora=True),
             make_peft_adapter(llama_dir, str(tmp_path / "dora2"), r=8, init_std=0.05,
                               use_dora=True, seed=1)]
    for i, path in enumerate(paths):
        m._load_host(LoRARequest(os.path.basename(path), i + 1, path))
    assert whole_way_calls == ["r8", "r4", "dora1", "dora2"]
    digest = read_adapter_bytes(paths[3]).digest
    assert m._plans[digest] is None and not m._plan_wanted(digest)  # its data: read once


def test_non_finite_values_are_named_on_the_plan_path(llama_dir, tmp_path, whole_way_calls):
    """Same header, a NaN in one tensor's data: the plan's image is not finite, so the whole
    way runs and its error names the tensor."""
    m = _manager(llama_dir)
    good = make_peft_adapter(llama_dir, str(tmp_path / "good"), r=8, init_std=0.05)
    m._load_host(LoRARequest("good", 1, good))
    bad = shutil.copytree(good, str(tmp_path / "bad"))
    file = os.path.join(bad, "adapter_model.safetensors")
    with open(file, "rb") as f:
        raw = bytearray(f.read())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k in sorted(header) if "layers.1.mlp.down_proj.lora_B" in k)
    start = 8 + n + header[key]["data_offsets"][0]
    raw[start:start + 4] = struct.pack("<f", float("nan"))
    with open(file, "wb") as f:
        f.write(raw)
    assert read_adapter_bytes(bad).digest == read_adapter_bytes(good).digest
    with pytest.raises(ValueError, match=r"Loading lora bad failed: lora_B of "
                                         r"model\.layers\.1\.mlp\.down_proj contains NaN"):
        m._load_host(LoRARequest("bad", 2, bad))
    assert whole_way_calls == ["good", "bad"]


def test_read_adapter_bytes_fingerprints_the_files_it_read(llama_dir, tmp_path):
    """The bytes come with the fingerprint a later stat-based check computes (else every
    cached adapter would look changed on disk at its next check), and the data asked for
    is the file's own tail; a rewritten file gets a new fingerprint."""
    path = make_peft_adapter(llama_dir, str(tmp_path / "a"), r=8, init_std=0.05)
    files = read_adapter_bytes(path, lambda digest: True)
    assert files.fingerprint == adapter_fingerprint(path)
    with open(os.path.join(path, "adapter_model.safetensors"), "rb") as f:
        raw = f.read()
    assert bytes(files.data) == raw[8 + len(files.header):]
    assert read_adapter_bytes(path).data is None
    weights = os.path.join(path, "adapter_model.safetensors")
    with open(weights, "wb") as f:  # the same bytes written again, a second later
        f.write(raw)
    mtime = os.stat(weights).st_mtime_ns + 10**9
    os.utime(weights, ns=(mtime, mtime))
    again = read_adapter_bytes(path)
    assert again.digest == files.digest and again.fingerprint != files.fingerprint
    assert again.fingerprint == adapter_fingerprint(path)
