"""Shared fixtures: tiny real HF checkpoints made locally, and engines shared per session
(each engine precompiles its graphs: ~2 s each on a 2-core CPU at XLA's default -O2, a
fraction of that at the -O0 set below)."""

import os

os.environ.setdefault("VLLM_TPU_LORA_CHECK_RECOMPILATION", "1")
# XLA keeps every compiled executable in memory (an LRU of 2048 by default), and each one
# holds ~70 memory mappings of JIT code on XLA:CPU: the suite builds enough differently
# shaped engines that its process passed the kernel's 65,530-mapping limit and XLA's next
# compile segfaulted (measured: +1,500 mappings per tiny LoRA engine, up to ~4,000 for the
# Pallas-interpret ones; flat once the LRU is small). 128 executables (~30k mappings)
# is far more than the engines one module keeps alive use; an engine whose graph was
# evicted would fail loudly ("Failed to get computation by hash"), never silently, so no
# engine outlives its module. Servers the tests start inherit it.
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", "128")


def _on_a_tpu_host() -> bool:
    """benchmarks/lent_tpu.sh says so (VLLM_TPU_LORA_TESTS_ON_TPU=1); otherwise a TPU's
    device files or PJRT_DEVICE=TPU."""
    import glob

    return (os.environ.get("VLLM_TPU_LORA_TESTS_ON_TPU") == "1"
            or os.environ.get("PJRT_DEVICE", "CPU").upper() == "TPU"
            or bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")))


# On a CPU host most of the suite's time is XLA:CPU compiling graphs, and LLVM's -O2 is
# most of that: the LoRA slot-write graphs (slices of one flat image into ~56 stacked
# buffers) took 70 of a tiny 4-slot engine's 91 s warm-up at -O2 (py-spy), and the engine
# starts in 14 s at -O0 (one 4-slot write of 56 buffers alone: 56 s -> 1.3 s). Tests
# assert outputs, never speed (benchmarks/ measure speed, at the default level), and -O0
# keeps IEEE semantics as -O2 does (no fast-math either way).
# Servers and scripts the tests start inherit it; jaxlib and torch_xla both read it. Not
# on a TPU host, whose compiler has its own levels. An explicit level in XLA_FLAGS wins.
if not _on_a_tpu_host() and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

import pytest  # noqa: E402

from vllm_tpu_lora.testing.factory import make_tiny_llama, make_tiny_qwen2  # noqa: E402

# Small ladders keep start-up cheap: tokens [16, 32], requests [8] -> 4 graphs.
SMALL_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """Llama with GQA (4 heads, 2 kv heads) and untied embeddings."""
    return make_tiny_llama(str(tmp_path_factory.mktemp("llama")), tie_word_embeddings=False)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    """Qwen2 with q/k/v biases and tied embeddings."""
    return make_tiny_qwen2(str(tmp_path_factory.mktemp("qwen2")), tie_word_embeddings=True)


@pytest.fixture(scope="module")  # not session: XLA's capped executable cache (above)
def llama_llm(llama_dir):           # would evict an engine's graphs between distant uses
    from vllm_tpu_lora import LLM

    return LLM(llama_dir, **SMALL_ENGINE)


@pytest.fixture(autouse=True, scope="module")
def _release_engines_between_modules():
    """Engines a module built (fixtures, locals kept alive by reference cycles) hold device
    buffers and host memory: collect them before the next module builds its own, so the
    suite's footprint stays that of one module at a time."""
    yield
    import gc

    gc.collect()
