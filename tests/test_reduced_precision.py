"""float16 and bfloat16 (the engine's TPU default) end to end with LoRA, both backends,
against HF + PEFT: in float32 (the truth) and, for bfloat16, also HF + PEFT run in
bfloat16 themselves (what a user compares against). LoRA buffers are in lora_dtype
(auto: the model dtype).

Reduced precision keeps 2-3 decimal digits, so greedy ids can legitimately flip where two
logits are near-tied; the test states its metrics: first-token agreement over base and
adapter requests, and the logprob error of every token generated while the engine's
sequence still equals the oracle's. Measured here, identical on both backends:
- float16 (Llama) vs float32: 12/12, max error 0.016.
- bfloat16 vs float32: Llama 12/12, 0.099; Qwen2 (tied, q/k/v bias) 12/12, 0.133. For
  scale, HF itself in bfloat16 is 0.155 / 0.162 from float32.
- bfloat16 vs HF + PEFT in bfloat16: 12/12, 0.165 / 0.100.
The bounds leave ~2-3x room for other CPUs.
"""

import numpy as np
import pytest
import torch

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams
from vllm_tpu_lora.testing.factory import make_peft_adapter
from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

from .conftest import SMALL_ENGINE

MAX_NEW = 6
MIN_FIRST_TOKEN_AGREEMENT = 0.9
MAX_LOGPROB_ERROR = {"float16": 0.05, "bfloat16": 0.3}
MAX_LOGPROB_ERROR_VS_BF16_ORACLE = 0.35
CASES = [("float16", "llama", "xla"), ("float16", "llama", "pallas"),
         ("bfloat16", "llama", "xla"), ("bfloat16", "llama", "pallas"),
         ("bfloat16", "qwen2", "xla"), ("bfloat16", "qwen2", "pallas")]


def _adapters(model_dir: str, root) -> dict[str, str]:
    return {f"h{i}": make_peft_adapter(model_dir, str(root / f"h{i}"), r=8, seed=70 + i,
                                       init_std=0.05) for i in range(2)}


@pytest.fixture(scope="module")
def setups(llama_dir, qwen2_dir, tmp_path_factory):
    """Per model: adapters, prompts, which adapter each prompt uses, and the oracles."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 500, size=int(rng.integers(2, 40))).tolist() for _ in range(12)]
    picks = [(None, "h0", "h1")[i % 3] for i in range(12)]
    out = {}
    for name, model_dir in (("llama", llama_dir), ("qwen2", qwen2_dir)):
        adapters = _adapters(model_dir, tmp_path_factory.mktemp(f"lowp_{name}"))
        oracles = {dtype: hf_greedy(load_oracle_model(model_dir, adapters, dtype=dtype),
                                    prompts, MAX_NEW, adapter_names=picks)
                   for dtype in (torch.float32, torch.bfloat16)}
        out[name] = (model_dir, adapters, prompts, picks, oracles)
    return out


def _agreement(outs, oracle) -> tuple[float, float]:
    """(first-token agreement, max logprob error while the sequences agree)."""
    first_agree, errors = 0, []
    for out, exp in zip(outs, oracle):
        got = out.outputs[0]
        first_agree += got.token_ids[0] == exp.token_ids[0]
        for pos, tok in enumerate(got.token_ids):
            errors.append(abs(got.logprobs[pos][tok].logprob - exp.full_logprobs[pos, tok]))
            if tok != exp.token_ids[pos]:
                break  # the sequences diverged: later positions have other contexts
    return first_agree / len(oracle), max(errors)


@pytest.mark.parametrize("dtype, model, backend", CASES)
def test_reduced_precision_with_lora_tracks_the_oracles(dtype, model, backend, setups):
    model_dir, adapters, prompts, picks, oracles = setups[model]
    llm = LLM(model_dir, dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=8,
              lora_backend=backend, **SMALL_ENGINE)
    assert llm.llm_engine.lora_manager.dtype == getattr(torch, dtype)  # lora_dtype auto
    reqs = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())}
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0,
                                       ignore_eos=True),
                        lora_request=[reqs[n] if n else None for n in picks], use_tqdm=False)
    agree, error = _agreement(outs, oracles[torch.float32])
    assert agree >= MIN_FIRST_TOKEN_AGREEMENT and error <= MAX_LOGPROB_ERROR[dtype], (agree, error)
    if dtype == "bfloat16":
        agree, error = _agreement(outs, oracles[torch.bfloat16])
        assert agree >= MIN_FIRST_TOKEN_AGREEMENT, agree
        assert error <= MAX_LOGPROB_ERROR_VS_BF16_ORACLE, error
    assert llm.llm_engine.stats()["compilations_after_warmup"] == 0
    if dtype == "float16" and backend == "xla":
        _overflowing_adapter_is_rejected(llm, adapters["h0"])


def _overflowing_adapter_is_rejected(llm, src: str) -> None:
    """Finite in the file (float32) but not in the serving dtype once scaled: the loader
    checks the slot image it serves, so add_lora names the adapter and the dtype, and the
    engine keeps serving the adapters it has."""
    import os
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(src, os.path.join(tempfile.mkdtemp(), "big"))
    weights = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(weights)
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = 1e5  # > float16's max (65504)
    save_file(tensors, weights)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="Loading lora big failed: .*overflow torch.float16"):
        engine.add_lora(LoRARequest("big", 99, path))
    assert "big" not in engine.stats()["loras"]
