"""Engine configuration: frozen dataclasses validated at construction.

Environment variables are read here and nowhere else, so one place says what the
process-wide knobs are.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# ---- environment knobs (the only place they are read) ----


def env_flag(name: str, default: bool = False) -> bool:
    val = os.environ.get(name)
    if val is None:
        return default
    return val.strip().lower() in ("1", "true", "yes", "on")


def check_recompilation_enabled() -> bool:
    """VLLM_TPU_LORA_CHECK_RECOMPILATION=1 turns a post-warm-up compile into an error."""
    return env_flag("VLLM_TPU_LORA_CHECK_RECOMPILATION")


def xla_cache_dir() -> str:
    return os.environ.get(
        "VLLM_TPU_LORA_XLA_CACHE_DIR",
        os.path.join(os.path.expanduser("~"), ".cache", "vllm_tpu_lora", "xla_cache"),
    )


def compile_threads() -> int | None:
    """VLLM_TPU_LORA_COMPILE_THREADS: how many XLA compiles the jax runtime's warm-up runs
    at once (default: min(8, CPU cores)). Each holds its graph's compiler state in host
    memory: fewer threads bound warm-up's peak memory at the cost of its time."""
    raw = os.environ.get("VLLM_TPU_LORA_COMPILE_THREADS")
    if raw is None or not raw.strip():
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"VLLM_TPU_LORA_COMPILE_THREADS must be a positive integer, got {raw!r}")
    return n


def runtime_lora_updating_allowed() -> bool:
    return env_flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def api_key_from_env() -> str | None:
    """VLLM_API_KEY: the server's API key when --api-key is not given (vLLM's variable)."""
    return os.environ.get("VLLM_API_KEY") or None


_DTYPES = ("auto", "float32", "bfloat16", "float16")
RUNTIMES = ("auto", "torch_xla", "jax")  # see runner/runtime.py
# The checkpoint modules LoRA can target (vLLM's default target modules for these models).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj")
# Modules a checkpoint may hold packed (Phi-3): listing one allows all of its parts.
LORA_PACKED_TARGET_MODULES = ("qkv_proj", "gate_up_proj")
# Opt-in (not in the default): LoRA on the token embedding and the logits projection.
LORA_VOCAB_TARGET_MODULES = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool = False
    runtime: str = "auto"  # "auto" | "torch_xla" | "jax" (runner/runtime.py)
    hf_config: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.model or not os.path.isdir(self.model):
            raise ValueError(f"Model directory does not exist: {self.model!r}")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"No config.json in model directory {self.model!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        with open(os.path.join(self.model, "config.json")) as f:
            raw = json.load(f)
        object.__setattr__(self, "hf_config", raw)
        derived = self.derived_max_model_len()
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", derived)
        elif self.max_model_len > derived:
            raise ValueError(
                f"User-specified max_model_len ({self.max_model_len}) is greater than the "
                f"derived max_model_len (max_position_embeddings={derived}) of the model."
            )

    def derived_max_model_len(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def architectures(self) -> list[str]:
        return list(self.hf_config.get("architectures") or [])


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 2048
    async_scheduling: bool | None = None  # None: on a TPU (engine/llm_engine.py)

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater "
                f"than or equal to max_num_seqs ({self.max_num_seqs})."
            )


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    lora_backend: str = "auto"
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    enable_lora_bias: bool = False  # serve lora_bias=True adapters (vLLM's old flag)
    enable_dora: bool = False  # serve use_dora=True adapters

    def __post_init__(self) -> None:
        if not self.target_modules:
            object.__setattr__(self, "target_modules", LORA_TARGET_MODULES)
        known = LORA_TARGET_MODULES + LORA_PACKED_TARGET_MODULES + LORA_VOCAB_TARGET_MODULES
        unknown = sorted(set(self.target_modules) - set(known))
        if unknown:
            raise ValueError(f"lora_target_modules {unknown} are not supported; choose from "
                             f"{list(known)}")
        object.__setattr__(self, "target_modules", tuple(dict.fromkeys(self.target_modules)))
        if self.max_loras < 1:
            raise ValueError(f"max_loras ({self.max_loras}) must be >= 1.")
        if self.max_lora_rank not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
            raise ValueError(
                f"max_lora_rank ({self.max_lora_rank}) must be one of "
                "(1, 8, 16, 32, 64, 128, 256, 320, 512)."
            )
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.lora_backend not in ("auto", "xla", "pallas"):
            raise ValueError(f"lora_backend must be auto|xla|pallas, got {self.lora_backend!r}")
        if self.lora_dtype not in _DTYPES:
            raise ValueError(f"lora_dtype must be one of {_DTYPES}, got {self.lora_dtype!r}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    lora_config: LoRAConfig | None = None


@dataclass
class EngineArgs:
    """The keyword arguments of `LLM(...)` and the CLI, with vLLM's names and defaults."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024 * 1024
    enable_prefix_caching: bool = True  # on by default, as in vLLM V1
    tensor_parallel_size: int = 1
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    lora_backend: str = "auto"
    lora_target_modules: list[str] | None = None
    enable_lora_bias: bool = False
    enable_dora: bool = False
    precompile: bool = True
    enforce_eager: bool = False
    runtime: str = "auto"
    # Schedule and prepare step N+1 while the device runs step N (vLLM's name). None: on
    # a TPU, off on CPU (where host and "device" share the cores and it measured no
    # gain, docs/async_scheduling.md); always off with enforce_eager.
    async_scheduling: bool | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"LLM got unexpected keyword argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            runtime=self.runtime,
        )
        max_len = model_config.max_model_len
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = max(256, self.max_num_seqs)
        lora = None
        if self.enable_lora:
            lora = LoRAConfig(
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                max_cpu_loras=self.max_cpu_loras,
                lora_dtype=self.lora_dtype,
                fully_sharded_loras=self.fully_sharded_loras,
                lora_backend=self.lora_backend,
                target_modules=tuple(self.lora_target_modules or ()),
                enable_lora_bias=self.enable_lora_bias,
                enable_dora=self.enable_dora,
            )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_len,
                async_scheduling=self.async_scheduling,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            lora_config=lora,
        )
