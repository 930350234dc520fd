"""PEFT adapter loading: packing into our fused layers, PEFT's own scaling/rank numbers,
the LoRA delta against PEFT's modules, and every rejection with its message."""

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_tpu_lora.lora.peft_loader import load_peft_adapter
from vllm_tpu_lora.lora.request import LoRARequest
from vllm_tpu_lora.models.loader import load_model
from vllm_tpu_lora.testing.factory import make_peft_adapter, make_tiny_llama

ST = "adapter_model.safetensors"
KEY_Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def bases(llama_dir, qwen2_dir):
    """kind -> (checkpoint dir, our model instance on CPU). The checkpoints are conftest's."""
    out = {}
    for kind, d in (("llama", llama_dir), ("qwen2", qwen2_dir)):
        with open(os.path.join(d, "config.json")) as f:
            out[kind] = (d, load_model(d, json.load(f), 16, torch.float32))
    return out


@pytest.fixture(scope="module")
def good(bases, tmp_path_factory):
    """A valid llama adapter (all 7 modules, r=8, alpha=16) that rejection tests copy."""
    return make_peft_adapter(bases["llama"][0], str(tmp_path_factory.mktemp("good")))


def _load(path, model, *, name="a", max_rank=64):
    return load_peft_adapter(LoRARequest(name, 1, str(path)), model, max_lora_rank=max_rank)


def _variant(src, dst, *, config=None, tensors=None):
    """Copy adapter `src` to `dst`, then update its config (a value of ... deletes the
    field) and/or rewrite its tensors."""
    shutil.copytree(src, dst)
    if config is not None:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(config)
        cfg = {k: v for k, v in cfg.items() if v is not ...}
        with open(path, "w") as f:
            json.dump(cfg, f)
    if tensors is not None:
        path = os.path.join(dst, ST)
        save_file(tensors(load_file(path)), path)
    return str(dst)


def _peft_model(base_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir, torch_device="cpu").eval()


def _our_place(model, peft_name):
    """'model.layers.0.self_attn.k_proj' -> ('model.layers.0.self_attn.qkv_proj', 1)."""
    prefix, leaf = peft_name.rsplit(".", 1)
    for packed, parts in model.packed_modules_mapping.items():
        if leaf in parts:
            return f"{prefix}.{packed}", parts.index(leaf)
    return peft_name, 0


def _packed_parts(model, our_name):
    prefix, leaf = our_name.rsplit(".", 1)
    return [f"{prefix}.{p}" for p in model.packed_modules_mapping.get(leaf, [leaf])]


# ---- packing ----------------------------------------------------------------------------

def test_packing_and_absent_slices(bases, tmp_path):
    d, model = bases["llama"]
    path = make_peft_adapter(d, str(tmp_path / "qv"), target_modules=["q_proj", "v_proj"])
    lora = _load(path, model, name="qv")
    assert (lora.name, lora.int_id, lora.path, lora.rank) == ("qv", 1, path, 8)
    n = len(model.model.layers)
    assert sorted(lora.modules) == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(n)]
    raw = load_file(os.path.join(path, ST))
    for i in range(n):
        q, k, v = lora.modules[f"model.layers.{i}.self_attn.qkv_proj"]
        assert k is None
        for s, part in ((q, "q_proj"), (v, "v_proj")):
            key = f"base_model.model.model.layers.{i}.self_attn.{part}"
            assert torch.equal(s.lora_a, raw[f"{key}.lora_A.weight"])
            assert torch.equal(s.lora_b, raw[f"{key}.lora_B.weight"])
            assert s.scale == 16 / 8


def test_bin_format_and_adapter_name_in_keys(bases, good, tmp_path):
    model = bases["llama"][1]
    ref = _load(good, model)
    assert [len(ref.modules[f"model.layers.0.{m}"]) for m in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")] == [3, 1, 2, 1]
    d = _variant(good, tmp_path / "bin")
    # Some exports keep PEFT's adapter name in the keys: '.lora_A.default.weight'.
    tensors = {k.replace(".weight", ".default.weight"): v
               for k, v in load_file(os.path.join(d, ST)).items()}
    os.remove(os.path.join(d, ST))
    torch.save(tensors, os.path.join(d, "adapter_model.bin"))
    lora = _load(d, model)
    assert lora.modules.keys() == ref.modules.keys()
    for name, slices in ref.modules.items():
        for s, t in zip(slices, lora.modules[name]):
            assert torch.equal(s.lora_a, t.lora_a) and torch.equal(s.lora_b, t.lora_b)


def test_model_with_wrapped_layers(bases, good):
    # The LoRA manager loads adapters into a model whose linears are already wrapped; shapes
    # are then read through the wrapper's `base_layer`.
    import copy

    class Wrapper(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

    model = copy.deepcopy(bases["llama"][1])
    for layer in model.model.layers:
        layer.self_attn.qkv_proj = Wrapper(layer.self_attn.qkv_proj)
        layer.mlp.down_proj = Wrapper(layer.mlp.down_proj)
    ref, lora = _load(good, bases["llama"][1]), _load(good, model)
    assert lora.modules.keys() == ref.modules.keys()
    for name, slices in ref.modules.items():
        assert all(torch.equal(s.lora_b, t.lora_b) for s, t in zip(slices, lora.modules[name]))


def test_raw_all_linear_string_in_config(bases, good, tmp_path):
    # PEFT expands "all-linear" before saving; hand-written configs may keep the string.
    d = _variant(good, tmp_path / "al", config={"target_modules": "all-linear"})
    assert len(_load(d, bases["llama"][1]).modules) == 4 * len(bases["llama"][1].model.layers)


# ---- against PEFT's own numbers ---------------------------------------------------------

PEFT_CASES = {
    "alpha_over_r": ("llama", {}),
    "rslora": ("llama", dict(r=4, lora_alpha=8, use_rslora=True)),
    "patterns": ("llama", dict(
        target_modules=["q_proj", "v_proj", "down_proj", "up_proj"],
        # first matching key wins: layer 0's q_proj gets 4, layer 1's gets 2
        rank_pattern={"layers.0.self_attn.q_proj": 4, "q_proj": 2, "v_proj": 3},
        alpha_pattern={"down_proj": 7, r"model\.layers\.1\.self_attn\.q_proj": 5})),
    "rslora_patterns": ("llama", dict(use_rslora=True, rank_pattern={"k_proj": 2},
                                      alpha_pattern={"gate_proj": 3})),
    "regex": ("llama", dict(target_modules=r".*\.layers\.1\.(self_attn\.(q|k)_proj|mlp\.up_proj)")),
    "all_linear": ("llama", dict(target_modules="all-linear", r=4, lora_alpha=4)),
    "qwen2": ("qwen2", dict(r=4, lora_alpha=32, target_modules=["k_proj", "o_proj", "gate_proj"])),
    "qwen2_all": ("qwen2", {}),
}


@pytest.mark.parametrize("case", sorted(PEFT_CASES))
def test_matches_peft(bases, tmp_path, case):
    kind, kwargs = PEFT_CASES[case]
    base_dir, model = bases[kind]
    path = make_peft_adapter(base_dir, str(tmp_path / case), init_std=0.1, **kwargs)
    lora = _load(path, model, name=case)
    peft = _peft_model(base_dir, path)
    hf = peft.base_model.model
    peft_mods = {n: m for n, m in hf.named_modules() if "default" in getattr(m, "lora_A", {})}
    ours = {(n, i) for n, sl in lora.modules.items() for i, s in enumerate(sl) if s is not None}
    assert ours == {_our_place(model, n) for n in peft_mods}
    for name, mod in peft_mods.items():
        ours_name, i = _our_place(model, name)
        s = lora.modules[ours_name][i]
        assert s.scale == mod.scaling["default"], name
        assert torch.equal(s.lora_a, mod.lora_A["default"].weight), name
        assert torch.equal(s.lora_b, mod.lora_B["default"].weight), name
    assert lora.rank == max(m.r["default"] for m in peft_mods.values())
    _check_delta(model, lora, hf)


def _check_delta(model, lora, hf):
    """Our packed delta, concat over slices of scale * x @ A.T @ B.T, against PEFT's module
    outputs minus their base outputs (a module PEFT did not wrap has delta 0)."""
    gen = torch.Generator().manual_seed(0)
    for name, slices in lora.modules.items():
        parts = [hf.get_submodule(p) for p in _packed_parts(model, name)]
        x = torch.randn(5, parts[0].in_features, generator=gen)
        with torch.no_grad():
            ours = torch.cat([
                s.scale * (x @ s.lora_a.T) @ s.lora_b.T if s is not None
                else torch.zeros(5, p.out_features) for s, p in zip(slices, parts)], dim=-1)
            theirs = torch.cat([p(x) - p.base_layer(x) if hasattr(p, "base_layer")
                                else torch.zeros(5, p.out_features) for p in parts], dim=-1)
        assert ours.abs().max() > 1e-3, name  # the check is not vacuous
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0, msg=name)


# ---- rejections -------------------------------------------------------------------------

def _rejects(path, model, pattern, *, max_rank=64):
    with pytest.raises(ValueError, match=pattern) as info:
        _load(path, model, name="bad", max_rank=max_rank)
    assert str(info.value).startswith("Loading lora bad failed: ")
    return str(info.value)


def test_rank_above_max_lora_rank(bases, good, tmp_path):
    model = bases["llama"][1]
    _rejects(good, model, r"^Loading lora bad failed: LoRA rank 8 is greater than "
                          r"max_lora_rank 4\.$", max_rank=4)
    # the largest per-module rank counts, not the config's r
    d = make_peft_adapter(bases["llama"][0], str(tmp_path / "rp"), r=4,
                          target_modules=["q_proj", "o_proj"], rank_pattern={"o_proj": 16})
    _rejects(d, model, r"LoRA rank 16 is greater than max_lora_rank 8\.", max_rank=8)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(use_dora=True), r"DoRA adapters \(use_dora=True\) are served only by an engine "
                          r"started with enable_dora=True"),
    (dict(lora_bias=True), r"lora_bias=True\) are served only by an engine started with "
                           r"enable_lora_bias=True"),
    (dict(modules_to_save=["lm_head"]),
     r"vLLM only supports modules_to_save being None \(got modules_to_save=\['lm_head'\]\)"),
    (dict(bias="all"), r"bias='all' is not supported; only bias='none' adapters"),
    (dict(bias="lora_only"), r"bias='lora_only' is not supported"),
    # Served only when the engine's lora_target_modules name them (tests/test_lora_vocab.py).
    (dict(target_modules=["q_proj", "lm_head"]), r"LoRA on lm_head is served only by an engine "
                                                 r"whose lora_target_modules include"),
    (dict(target_modules=["q_proj", "embed_tokens"]), r"LoRA on model\.embed_tokens is served "
                                                      r"only by an engine whose"),
    (dict(target_modules=r".*(q_proj|lm_head)"), r"LoRA on lm_head is served only"),
], ids=["dora", "lora_bias", "modules_to_save", "bias_all", "bias_lora_only", "lm_head", "embed_tokens",
        "lm_head_regex"])
def test_rejects_unsupported_config(bases, tmp_path, kwargs, pattern):
    d = make_peft_adapter(bases["qwen2"][0], str(tmp_path / "bad"), **kwargs)
    _rejects(d, bases["qwen2"][1], pattern)


def _rename(old, new):
    return lambda sd: {k.replace(old, new): v for k, v in sd.items()}


def _poison(value):
    def edit(sd):
        sd[KEY_Q0] = sd[KEY_Q0].clone()
        sd[KEY_Q0][0, 0] = value
        return sd
    return edit


# (config update, tensor edit, message pattern), each applied to a copy of the good adapter.
BAD_VARIANTS = {
    "peft_type": ({"peft_type": "LOHA"}, None, r"peft_type 'LOHA' is not supported"),
    "unknown_module": (None, _rename("self_attn.q_proj", "self_attn.query_key_value"),
                       r"While loading .*, expected target modules in \['down_proj', "
                       r"'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\] but "
                       r"received \['model\.layers\.0\.self_attn\.query_key_value', .*\]\. "
                       r"Please verify that the loaded LoRA module is correct$"),
    "layer_99": (None, _rename("layers.1.", "layers.99."),
                 r"expected target modules in .* but received \['model\.layers\.99\.mlp\.down_proj'"),
    "embed_keys": (None, lambda sd: {**sd, "base_model.model.model.embed_tokens.lora_embedding_A":
                                     torch.zeros(8, 512)}, r"LoRA on model\.embed_tokens is served only"),
    "not_in_target_modules": ({"target_modules": ["q_proj"]}, None,
                              r"weights for model\.layers\.\d\.\w+\.\w+_proj are present but "
                              r"target_modules=\['q_proj'\] does not cover it\."),
    "rank_vs_config": ({"r": 4}, None, r"rank 8 in its weights but adapter_config\.json gives "
                                       r"rank 4 \(r / rank_pattern\)"),
    "rank_vs_pattern": ({"rank_pattern": {"v_proj": 2}}, None,
                        r"v_proj has rank 8 in its weights but .* gives rank 2"),
    "nan": (None, _poison(float("nan")), r"lora_A of model\.layers\.0\.self_attn\.q_proj "
                                         r"contains NaN or Inf values"),
    "inf": (None, _poison(float("inf")), r"contains NaN or Inf values"),
    "missing_lora_b": (None, lambda sd: {k: v for k, v in sd.items() if "layers.0.mlp.up_proj.lora_B"
                                         not in k}, r"up_proj has \['lora_A'\] but needs both"),
    "magnitude_vector": (None, lambda sd: {**sd, KEY_Q0.replace("lora_A.weight",
                                                                "lora_magnitude_vector"):
                                           torch.ones(64)}, r"unexpected tensor .*lora_magnitude"),
    "no_weights": (None, lambda sd: {}, r"holds no LoRA weights"),
    "bad_r": ({"r": 0}, None, r"r must be a positive integer, got 0"),
    "missing_fields": ({"lora_alpha": ..., "r": ...}, None,
                       r"Missing required configuration fields: \['lora_alpha', 'r'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_VARIANTS))
def test_rejects_bad_variant(bases, good, tmp_path, case):
    config, tensors, pattern = BAD_VARIANTS[case]
    d = _variant(good, tmp_path / case, config=config, tensors=tensors)
    _rejects(d, bases["llama"][1], pattern)


def test_rejects_shapes_of_another_model(bases, tmp_path):
    other = make_tiny_llama(str(tmp_path / "wide"), hidden_size=32, intermediate_size=64)
    d = make_peft_adapter(other, str(tmp_path / "a"), target_modules=["o_proj"])
    _rejects(d, bases["llama"][1], r"weight shapes of model\.layers\.0\.self_attn\.o_proj do "
                                   r"not match the base model: lora_A \(8, 32\) and lora_B "
                                   r"\(32, 8\), expected \(r, 64\) and \(64, r\)\.")


def test_rejects_missing_and_corrupt_files(bases, good, tmp_path):
    model = bases["llama"][1]
    missing = tmp_path / "nope"
    _rejects(missing, model, rf"^Loading lora bad failed: No adapter found for {missing} ")
    d = _variant(good, tmp_path / "nocfg")
    os.remove(os.path.join(d, "adapter_config.json"))
    _rejects(d, model, r"No adapter found for .* \(adapter_config\.json is missing\)")
    d = _variant(good, tmp_path / "nowts")
    os.remove(os.path.join(d, ST))
    _rejects(d, model, r"No adapter found for .* \(neither adapter_model\.safetensors nor")
    d = _variant(good, tmp_path / "badcfg")
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write("{not json")
    _rejects(d, model, r"cannot read .*adapter_config\.json")
    d = _variant(good, tmp_path / "badst")
    with open(os.path.join(d, ST), "r+b") as f:
        f.truncate(100)
    _rejects(d, model, r"cannot read .*adapter_model\.safetensors")
    d = _variant(good, tmp_path / "badbin")
    os.remove(os.path.join(d, ST))
    with open(os.path.join(d, "adapter_model.bin"), "wb") as f:
        f.write(b"garbage" * 10)
    _rejects(d, model, r"cannot read .*adapter_model\.bin")


def test_safetensors_reader_matches_the_safetensors_library(good, tmp_path):
    """Our one-read safetensors reader against the safetensors library itself (the oracle),
    on a PEFT-saved adapter and on a file of mixed dtypes; damaged files are rejected."""
    from safetensors.torch import load_file, save_file

    from vllm_tpu_lora.lora.peft_loader import _read_safetensors

    mixed = str(tmp_path / "mixed.safetensors")
    save_file({"f16": torch.randn(3, 5).half(), "bf16": torch.randn(7).bfloat16(),
               "i64": torch.arange(4), "empty": torch.zeros(0, 3),
               "scalar": torch.tensor(2.5)}, mixed, metadata={"format": "pt"})
    for file in (os.path.join(good, ST), mixed):
        want, got = load_file(file), _read_safetensors(file, header_only=False)
        meta = _read_safetensors(file, header_only=True)
        assert sorted(got) == sorted(want) == sorted(meta)
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
            assert meta[k].is_meta and meta[k].shape == t.shape and meta[k].dtype == t.dtype
    data = open(mixed, "rb").read()
    n = int.from_bytes(data[:8], "little")
    damaged = {"short": data[:5], "huge_header": (10**9).to_bytes(8, "little") + data[8:],
               "not_json": data[:8] + b"{" * n + data[8 + n:],
               "truncated": data[:-8]}
    for case, blob in damaged.items():
        bad = tmp_path / f"{case}.safetensors"
        bad.write_bytes(blob)
        with pytest.raises(ValueError):
            _read_safetensors(str(bad), header_only=case != "truncated")
    with pytest.raises(ValueError, match="data_offsets"):  # the header check sees it too
        _read_safetensors(str(tmp_path / "truncated.safetensors"), header_only=True)


def test_rslora_scale_formula(bases, tmp_path):
    # Spelled out once without PEFT: alpha / sqrt(r).
    d = make_peft_adapter(bases["llama"][0], str(tmp_path / "rs"), r=16, lora_alpha=8,
                          use_rslora=True, target_modules=["down_proj"])
    (s,) = _load(d, bases["llama"][1]).modules["model.layers.0.mlp.down_proj"]
    assert s.scale == 8 / math.sqrt(16) == 2.0


def test_huge_finite_weights_are_not_mistaken_for_inf(bases, good, tmp_path):
    """The finite check sums all weights first; values whose sum overflows float32 are
    still finite and must load (the exact per-tensor check decides)."""
    def edit(sd):
        sd[KEY_Q0] = sd[KEY_Q0].clone()
        sd[KEY_Q0][0, :2] = 3e38  # finite; their sum is inf in float32
        return sd
    lora = _load(_variant(good, tmp_path / "huge", tensors=edit), bases["llama"][1])
    a = lora.modules["model.layers.0.self_attn.qkv_proj"][0].lora_a
    assert a[0, 0].item() == pytest.approx(3e38) and torch.isfinite(a).all()
