"""Tiny real HF checkpoints and PEFT adapters, built locally (DESIGN.md §6).

Everything is built locally and deterministically: the same arguments give the same files.
The checkpoints are ordinary `save_pretrained` directories (config.json, safetensors, the
tokenizer, generation_config.json), so the engine's real loading code is what gets tested.
The greedy oracles are in `oracle.py` and re-exported here.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# The oracles live in their own module; re-exported so `factory` is the one-stop import.
from vllm_tpu_lora.testing.oracle import (  # noqa: F401
    PEFT_BASE_NAME,
    GreedyOutput,
    hf_greedy,
    load_oracle_model,
    peft_mixed_batch_greedy,
)

# Special tokens are added first by the BPE trainer, so their ids are fixed.
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 0, 1, 2
_SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
# 256 byte symbols + the special tokens: the smallest vocabulary a byte-level BPE can have.
_MIN_VOCAB = 256 + len(_SPECIAL_TOKENS)
DEFAULT_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_SUBJECTS = ("The cat", "A small dog", "My neighbour", "The old engine", "Our team",
             "The café owner", "A naïve robot", "Zoë", "The teacher", "Every student")
_VERBS = ("jumps over", "writes about", "looks at", "builds", "reads", "visits",
          "forgets", "paints")
_OBJECTS = ("the lazy fox", "a red apple", "the compiler", "seven bridges", "her résumé",
            "東京 and 日本", "a Straße in Berlin", "the façade", "crème brûlée", "π and ∞")
_SYLLABLES = ("ka", "lo", "mi", "nu", "te", "ra", "si", "po", "vel", "dan", "gor", "shi",
              "xu", "bre", "qua", "zim", "or", "an", "fy", "ju")
_EXTRA_LINES = (
    "Привет, мир! Как дела?", "¿Qué tal? ¡Muy bien!", "日本語のテキストです。",
    "Emoji: 🙂 👍 🚀", 'JSON: {"key": [1, 2, 3], "ok": true}', "def f(x):\n    return x * 2",
    "Tabs\tand  double  spaces.", "E = m * c ** 2; a <= b && c != d",
)


def _corpus() -> list[str]:
    """~1,800 varied, deterministic lines: prose, arithmetic, code, non-ASCII text."""
    lines = [f"{s} {v} {o}." for s, v, o in itertools.product(_SUBJECTS, _VERBS, _OBJECTS)]
    lines += [f"Q: What is {a} + {b}? A: {a + b}." for a in range(0, 100, 7) for b in (3, 19, 250)]
    lines += [f"for i in range({n}):\n    total += i * {n % 7}  # step {n}" for n in range(40)]
    lines += [f"Item {n} costs {n * 37 % 1000}.{n % 100:02d} dollars, code {n * 7919 % 100000}."
              for n in range(400)]
    # Made-up words give the trainer enough distinct pairs for vocabularies up to 8192.
    words = ["".join(s) for s in itertools.product(_SYLLABLES, repeat=3)]
    lines += [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]
    return lines + list(_EXTRA_LINES) * 5


def build_tokenizer(out_dir: str, *, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer locally and save it (with a chat template) to out_dir.

    The post-processor prepends `<s>`, as Llama-style tokenizers do. Byte-level BPE can encode
    any text, so multi-byte characters exercise incremental detokenization. The built-in
    corpus supports vocab_size from 260 to 8192; ids 0/1/2 are <s>/</s>/<pad>.
    """
    if vocab_size < _MIN_VOCAB + 1:
        raise ValueError(f"vocab_size must be > {_MIN_VOCAB} for a byte-level BPE, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != vocab_size:
        # A model row with no token behind it would make detokenization ill-defined.
        raise ValueError(f"the built-in corpus yields only {tok.get_vocab_size()} tokens, "
                         f"fewer than vocab_size={vocab_size}")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_TOKEN_ID)],
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def _rope_parameters(rope_theta: float, rope_scaling: Mapping | None) -> dict:
    # transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
    params = {"rope_type": "default", "rope_theta": float(rope_theta)}
    params.update(rope_scaling or {})
    return params


def _randomize_defaults_(model: torch.nn.Module, std: float) -> None:
    """Make biases and norm weights random: HF inits them to 0 and 1, which would hide a
    loader that forgets them (Qwen2's q/k/v bias, any RMSNorm weight)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, std)
            elif type(module).__name__.endswith("RMSNorm"):
                module.weight.add_(torch.randn_like(module.weight) * 0.1)


def _to_legacy_config(out_dir: str) -> None:
    """Rewrite config.json as transformers 4.x (and so every hub checkpoint) writes it:
    top-level `rope_theta`, `rope_scaling` (null for default rope) and `torch_dtype`."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def _make_model(model_cls, config_cls, out_dir: str, *, seed: int, dtype: torch.dtype,
                shard_size: int | str | None, legacy_config: bool, rope_theta: float,
                rope_scaling: Mapping | None, initializer_range: float | None,
                tokenizer_vocab_size: int | None = None, **config_kw) -> str:
    if initializer_range is None:
        initializer_range = 2.0 / config_kw["hidden_size"] ** 0.5
    config = config_cls(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID,
        rope_parameters=_rope_parameters(rope_theta, rope_scaling),
        initializer_range=initializer_range, dtype=dtype, **config_kw,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    _randomize_defaults_(model, initializer_range)
    model.to(dtype)
    # transformers 5 always writes safetensors; a small max_shard_size gives the
    # model-0000x-of-0000y.safetensors + model.safetensors.index.json layout.
    model.save_pretrained(out_dir, max_shard_size=shard_size or "50GB")
    if legacy_config:
        _to_legacy_config(out_dir)
    build_tokenizer(out_dir, vocab_size=tokenizer_vocab_size or config.vocab_size)
    return out_dir


def make_tiny_llama(out_dir: str, *, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    vocab_size: int = 512, tie_word_embeddings: bool = False,
                    max_position_embeddings: int = 512, rope_theta: float = 10000.0,
                    rope_scaling: Mapping | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.float32, shard_size: int | str | None = None,
                    initializer_range: float | None = None, legacy_config: bool = False,
                    tokenizer_vocab_size: int | None = None) -> str:
    """A random-weight `LlamaForCausalLM` checkpoint (GQA by default) plus tokenizer.

    tokenizer_vocab_size: a tokenizer smaller than the model's vocabulary (the built-in
    corpus gives at most 8192 tokens), for benchmarks at real vocabulary sizes that feed
    token ids; ids past it decode to nothing.
    initializer_range defaults to 2/sqrt(hidden_size) (0.25 at 64; HF's 0.02 is far too small
    for a tiny model: greedy repeats one token). It keeps activations O(1) at any width, the
    greedy output varied and the top-1/top-2 logprob gaps mostly > 0.03, so float32 rounding
    differences between the oracle and the engine rarely flip an argmax.
    legacy_config=True writes config.json in the transformers-4.x form real checkpoints have.
    """
    return _make_model(
        LlamaForCausalLM, LlamaConfig, out_dir, seed=seed, dtype=dtype, shard_size=shard_size,
        legacy_config=legacy_config, rope_theta=rope_theta, rope_scaling=rope_scaling,
        initializer_range=initializer_range, tokenizer_vocab_size=tokenizer_vocab_size,
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
    )


def make_tiny_qwen2(out_dir: str, *, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    vocab_size: int = 512, tie_word_embeddings: bool = True,
                    max_position_embeddings: int = 512, rope_theta: float = 10000.0,
                    rope_scaling: Mapping | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.float32, shard_size: int | str | None = None,
                    initializer_range: float | None = None, legacy_config: bool = False) -> str:
    """A random-weight `Qwen2ForCausalLM` checkpoint (tied embeddings, non-zero q/k/v bias)."""
    return _make_model(
        Qwen2ForCausalLM, Qwen2Config, out_dir, seed=seed, dtype=dtype, shard_size=shard_size,
        legacy_config=legacy_config, rope_theta=rope_theta, rope_scaling=rope_scaling,
        initializer_range=initializer_range, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
    )


# make_tiny_model: architecture -> (transformers model class name, config class name,
# config fields that make the tiny model exercise what is special about the architecture).
_TINY_ARCHS = {
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=8)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig",
              dict(head_dim=16, hidden_activation="gelu_pytorch_tanh")),
    # Small caps and a query scale unlike head_dim**-0.5, so each visibly matters.
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(head_dim=16, hidden_activation="gelu_pytorch_tanh", sliding_window=8,
                    query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                    final_logit_softcapping=10.0)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(sliding_window=12)),
}


def make_tiny_model(arch: str, out_dir: str, *, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    vocab_size: int = 512, tie_word_embeddings: bool | None = None,
                    max_position_embeddings: int = 512, seed: int = 0,
                    dtype: torch.dtype = torch.float32, shard_size: int | str | None = None,
                    **config_overrides) -> str:
    """A random-weight checkpoint of one of `_TINY_ARCHS` (Mistral with a sliding window,
    Qwen3, Gemma, Gemma2, Phi-3) plus tokenizer, like make_tiny_llama.
    tie_word_embeddings None keeps the architecture's default (Gemma ties)."""
    import transformers

    model_name, config_name, special = _TINY_ARCHS[arch]
    kw = dict(special, **config_overrides)
    if tie_word_embeddings is not None:
        kw["tie_word_embeddings"] = tie_word_embeddings
    return _make_model(
        getattr(transformers, model_name), getattr(transformers, config_name), out_dir,
        seed=seed, dtype=dtype, shard_size=shard_size, legacy_config=False,
        rope_theta=10000.0, rope_scaling=None, initializer_range=None,
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, **kw)


def make_peft_adapter(base_dir: str, out_dir: str, *, r: int = 8, lora_alpha: int = 16,
                      target_modules: Sequence[str] | str = DEFAULT_TARGET_MODULES,
                      use_rslora: bool = False, rank_pattern: Mapping | None = None,
                      alpha_pattern: Mapping | None = None, seed: int = 0,
                      init_std: float | None = None, **lora_kwargs) -> str:
    """A real PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for base_dir.

    init_lora_weights=False keeps nn.Linear's kaiming-uniform init for both A and B (PEFT's
    default zeroes B, which would make the adapter a no-op); init_std re-draws both from
    N(0, init_std). target_modules: a sequence of module-name suffixes, or one string that
    PEFT full-matches as a regex against whole module names, or "all-linear". Extra kwargs
    go to LoraConfig (use_dora=True, modules_to_save=[...], bias="all", ... for rejection tests).
    """
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, init_lora_weights=False, use_rslora=use_rslora,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
        task_type="CAUSAL_LM", **{"bias": "none", **lora_kwargs},
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    if init_std is not None:
        with torch.no_grad():
            for name, param in sorted(peft_model.named_parameters()):
                if ".lora_A." in name or ".lora_B." in name:
                    param.normal_(0.0, init_std)
                elif "lora_magnitude_vector" in name:
                    # DoRA starts with m = ||W + s*BA|| (a no-op rescale): move it off that,
                    # as training would, so the rescale is visible.
                    param.mul_(1.0 + 0.2 * torch.randn_like(param))
    peft_model.save_pretrained(out_dir)
    _sort_target_modules(out_dir)
    return out_dir


def _sort_target_modules(out_dir: str) -> None:
    # PEFT keeps target_modules as a set and writes it in hash order, which changes from one
    # process to the next; sorting makes adapter_config.json reproducible (PEFT reads a set).
    path = os.path.join(out_dir, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    if isinstance(cfg.get("target_modules"), list):
        cfg["target_modules"] = sorted(cfg["target_modules"])
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)


def sample_prompt_token_ids(n: int, *, vocab_size: int = 512, min_len: int = 4,
                            max_len: int = 16, seed: int = 0, bos: bool = True) -> list[list[int]]:
    """n random prompts of non-special token ids (lengths in [min_len, max_len]), each
    starting with <s> as the tokenizer's output would."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        body = rng.integers(len(_SPECIAL_TOKENS), vocab_size, size=length).tolist()
        prompts.append(([BOS_TOKEN_ID] if bos else []) + body)
    return prompts
