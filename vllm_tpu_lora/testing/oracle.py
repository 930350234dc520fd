"""HF transformers / PEFT greedy oracles (DESIGN.md §6): what the engine must reproduce.

float32, eager attention, CPU. `hf_greedy` runs one prompt at a time, so no padding is in
play; `peft_mixed_batch_greedy` runs PEFT's mixed-adapter batch (`adapter_names=[...]`) with
left padding. On the tiny checkpoints of `factory` both give identical token ids and logprobs
within ~2e-5 of each other.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoModelForCausalLM

# PEFT's reserved adapter name for "no adapter" in a mixed batch.
PEFT_BASE_NAME = "__base__"


@dataclass(frozen=True)
class GreedyOutput:
    """One request's oracle result. Logprobs are log_softmax of the raw (unprocessed) logits."""

    token_ids: list[int]
    logprobs: list[float]  # logprob of each generated token
    full_logprobs: np.ndarray  # [num_generated, vocab_size] float32


def load_oracle_model(model_dir: str, adapter_dirs: Mapping[str, str] | None = None,
                      dtype: torch.dtype = torch.float32):
    """HF model in `dtype` (float32 unless a reduced-precision run is the point; eager
    attention), wrapped in a PeftModel holding every adapter under its name when
    adapter_dirs is given."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager")
    if adapter_dirs:
        from peft import PeftModel

        # On the CPU, named: PEFT otherwise loads onto torch.accelerator's device, which
        # is torchax's "jax" once the jax runtime has imported it (peft 0.22 does so).
        (first, first_dir), *rest = adapter_dirs.items()
        model = PeftModel.from_pretrained(model, first_dir, adapter_name=first,
                                          torch_device="cpu")
        for name, path in rest:
            model.load_adapter(path, adapter_name=name, torch_device="cpu")
    return model.eval()


@contextlib.contextmanager
def _single_thread():
    """Run torch ops on one thread. Tiny decode steps gain nothing from intra-op parallelism,
    and when other processes load the 2-core test machine, 2 OpenMP threads made them 15-40x
    slower (measured: 4 prompts x 16 tokens, 0.13 s on 1 thread vs 2-3 s on 2)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _pad_id(model) -> int:
    # Any id works under the attention mask; the checkpoint's own keeps HF from warning.
    pad = model.generation_config.pad_token_id
    return 0 if pad is None else pad


def _generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              max_new_tokens: int, adapter_names: Sequence[str | None] | None,
              ignore_eos: bool) -> list[GreedyOutput]:
    kwargs, active = {}, contextlib.nullcontext()
    if hasattr(model, "peft_config"):
        names = adapter_names or [None] * input_ids.shape[0]
        if any(getattr(c, "use_dora", False) for c in model.peft_config.values()):
            # PEFT's mixed batch refuses DoRA: run the one adapter of the batch as the
            # active adapter (or none), which is PEFT's ordinary forward.
            if len(set(names)) != 1:
                raise ValueError("with DoRA adapters loaded, batches must use one adapter "
                                 "(hf_greedy runs one prompt at a time)")
            if names[0] is None:
                active = model.disable_adapter()
            else:
                model.set_adapter(names[0])
        else:
            kwargs["adapter_names"] = [n or PEFT_BASE_NAME for n in names]
    elif any(adapter_names or []):
        raise ValueError(f"adapter_names={adapter_names} but the model has no adapters loaded")
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    # eos_token_id must go as a kwarg: a None inside a passed GenerationConfig is refilled
    # from model.generation_config, a None kwarg is not. No eos -> exactly max_new_tokens,
    # and the argmax may be eos (vLLM's ignore_eos semantics; min_new_tokens would mask it).
    with torch.no_grad(), _single_thread(), active:
        out = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
            max_new_tokens=max_new_tokens, eos_token_id=None if ignore_eos else eos,
            pad_token_id=_pad_id(model), output_logits=True, return_dict_in_generate=True,
            **kwargs)
    gen = out.sequences[:, input_ids.shape[1]:]
    logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
    results = []
    for row in range(gen.shape[0]):
        ids = gen[row].tolist()
        stop = next((i for i, t in enumerate(ids) if t in eos_ids), None)
        if not ignore_eos and stop is not None:  # drop the padding after a finished row
            ids = ids[: stop + 1]
        lp = logprobs[row, : len(ids)]
        results.append(GreedyOutput(
            token_ids=ids, logprobs=lp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist(),
            full_logprobs=lp.numpy()))
    return results


def hf_greedy(model, prompts_token_ids: Sequence[Sequence[int]], max_new_tokens: int, *,
              adapter_dirs: Mapping[str, str] | None = None,
              adapter_names: Sequence[str | None] | None = None,
              ignore_eos: bool = True) -> list[GreedyOutput]:
    """THE oracle: float32 greedy decoding, one prompt at a time (no padding in play).

    model: a checkpoint dir, or a model from `load_oracle_model` (reuse it to save loads).
    adapter_dirs: {name: adapter dir}; adapter_names: per prompt, a name or None for the base.
    """
    if isinstance(model, (str, os.PathLike)):
        model = load_oracle_model(str(model), adapter_dirs)
    if adapter_names is not None and len(adapter_names) != len(prompts_token_ids):
        raise ValueError(f"{len(adapter_names)} adapter_names for {len(prompts_token_ids)} prompts")
    results = []
    for i, prompt in enumerate(prompts_token_ids):
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        names = None if adapter_names is None else [adapter_names[i]]
        results += _generate(model, ids, torch.ones_like(ids), max_new_tokens, names, ignore_eos)
    return results


def peft_mixed_batch_greedy(model, prompts_token_ids: Sequence[Sequence[int]],
                            max_new_tokens: int, *, adapter_dirs: Mapping[str, str] | None = None,
                            adapter_names: Sequence[str | None] | None = None,
                            ignore_eos: bool = True) -> list[GreedyOutput]:
    """One left-padded batched `generate(adapter_names=[...])`: PEFT's mixed-adapter batch.

    Same arguments and results as `hf_greedy`; kept as a second, independent oracle for
    mixed-batch tests (padding makes its float sums differ from hf_greedy's in the last bits).
    """
    if isinstance(model, (str, os.PathLike)):
        model = load_oracle_model(str(model), adapter_dirs)
    width = max(len(p) for p in prompts_token_ids)
    ids = torch.full((len(prompts_token_ids), width), _pad_id(model), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts_token_ids):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return _generate(model, ids, mask, max_new_tokens, adapter_names, ignore_eos)
