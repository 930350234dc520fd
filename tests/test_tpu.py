"""What only a TPU can show (run by .buildkite/run-tpu-tests.sh; skipped elsewhere), on
the runtime "auto" picks there (the jax runtime on a TPU; torch_xla with
VLLM_TPU_LORA_TPU_TEST_RUNTIME=torch_xla): the Mosaic-compiled Pallas LoRA kernels
against the float32 reference, the engine on the ragged-paged-attention kernel against HF, end-to-end multi-LoRA generation
against PEFT on the real kernels (lora_backend="pallas") and on the xla backend's TPU
strategies that "auto" picks there (stacked, onehot over DMA-copied slots, single, the
grouped kernel as one graph among them), and no
compilation after warm-up on the TPU runtime.

Engines run in float32 with matmul precision "highest": TPU's default f32 matmul uses
bfloat16 passes, which would make exact greedy parity with the CPU oracle a coin toss.
Where greedy ids still differ, the oracle must call it a near tie (`_assert_greedy_close`).
"""

import numpy as np
import pytest
import torch

from vllm_tpu_lora import LLM, LoRARequest, SamplingParams, platform
from vllm_tpu_lora.runner.runtime import make_runtime, resolve_runtime

from .conftest import SMALL_ENGINE

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(not platform.is_tpu(),
                       reason="needs a TPU (Mosaic-compiled kernels; PJRT_DEVICE is "
                              f"{platform.device_type()})"),
]

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
NEAR_TIE = 0.05  # logprob gap under which a float difference may flip the argmax
RUNTIME = resolve_runtime("auto") if platform.is_tpu() else "torch_xla"


@pytest.fixture(scope="module", autouse=True)
def highest_matmul_precision():
    if RUNTIME == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision", "highest")
        yield
        jax.config.update("jax_default_matmul_precision", None)
        return
    import torch_xla.backends

    torch_xla.backends.set_mat_mul_precision("highest")
    yield
    torch_xla.backends.set_mat_mul_precision("default")


def test_tpu_runs_the_runtime_auto_picks():
    """Without torch_xla (a current TPU VM) "auto" is the jax runtime, on the TPU."""
    rt = make_runtime("auto")
    assert rt.name == RUNTIME and platform.is_tpu()
    if not platform.torch_xla_available():
        assert rt.name == "jax" and rt.jax_device.platform == "tpu"


def _assert_greedy_close(got: list[int], exp) -> None:
    """Identical ids, or a divergence where the oracle's top two were a near tie."""
    for i, (g, e) in enumerate(zip(got, exp.token_ids)):
        if g != e:
            gap = float(exp.full_logprobs[i][e] - exp.full_logprobs[i][g])
            assert gap < NEAR_TIE, f"token {i}: got {g}, oracle {e} (logprob gap {gap:.3f})"
            return
    assert len(got) == len(exp.token_ids)


@pytest.mark.parametrize("t,r,n,dtype", [(16, 16, 4, torch.float32), (133, 64, 2, torch.bfloat16),
                                         (512, 8, 8, torch.bfloat16)])
def test_mosaic_kernels_match_reference(t, r, n, dtype):
    from vllm_tpu_lora.ops import bgmv_pallas, bgmv_xla
    from vllm_tpu_lora.ops.bgmv_pallas import default_interpret
    from vllm_tpu_lora.ops.bgmv_ref import bgmv_expand_slice_ref, bgmv_shrink_ref
    from vllm_tpu_lora.ops.block_sizes import token_block
    from vllm_tpu_lora.ops.testing import TOLERANCE, make_case

    assert not default_interpret()  # Mosaic, not the interpreter
    case = make_case(t, 1024, 1536, r, n, dtype, "skewed", seed=t + r)
    rt = make_runtime(RUNTIME)

    def kernels(x, a, b, idx, s, base, y):
        lay = bgmv_xla.make_segment_layout(idx, n, token_block(dtype, "pallas", t, n))
        ys = bgmv_xla.to_token_order(bgmv_pallas.segment_shrink(x, a, lay, s), lay)
        out = bgmv_pallas.segment_expand(bgmv_xla.to_segment_order(y, lay), b, lay, base)
        return ys.float(), out.float()  # numpy (the way back) has no bfloat16

    ys, out = (torch.from_numpy(rt.to_host(v))
               for v in rt.eager(kernels)(*(rt.to_device(v) for v in case)))
    # The kernels follow the module's "highest" matmul precision: float32 products in
    # float32 (at "default" a TPU makes one bfloat16 pass, ~1e-2 relative error; both
    # measured on v5e at the JAX level with benchmarks/tpu_kernels.py).
    atol, rtol = TOLERANCE[dtype]
    ref_y = bgmv_shrink_ref(case.x, case.lora_a, case.idx, case.scale)
    ref_out = bgmv_expand_slice_ref(case.y, case.lora_b, case.idx, case.base, 0, 1536)
    torch.testing.assert_close(ys.float(), ref_y.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("t,s,r,d,o,dtype", [
    (16, 8, 16, 256, 384, "float32"), (300, 32, 16, 512, 1024, "bfloat16"),
    (1024, 128, 16, 4096, 4096, "bfloat16"), (256, 32, 64, 4096, 14336, "bfloat16")])
def test_grouped_kernel_on_mosaic_matches_float64(t, s, r, d, o, dtype):
    """The fused grouped kernel (ops/grouped_lora.py) compiled by Mosaic, up to
    Llama-3-8B widths and 128 slots, against float64 numpy: the interpreter's CPU test
    (tests/test_ops_grouped.py) cannot show what Mosaic accepts."""
    import jax.numpy as jnp

    from vllm_tpu_lora.ops.grouped_lora import grouped_lora

    rng = np.random.default_rng(t + s)
    slots = np.where(rng.random(t) < 0.1, -1, rng.integers(0, s, size=t))
    x = rng.standard_normal((t, d))
    a, b = rng.standard_normal((s, r, d)) / np.sqrt(d), rng.standard_normal((s, r, o)) / np.sqrt(r)
    jx, ja, jb = (jnp.asarray(v, dtype) for v in (x, a, b))
    precision = "highest" if dtype == "float32" else "default"
    got = np.asarray(grouped_lora(jx, [(ja, jb)], jnp.asarray(slots, jnp.int32),
                                  precision=precision).astype(jnp.float32), np.float64)
    x64, a64, b64 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (jx, ja, jb))
    ref = np.zeros((t, o))
    for slot in set(slots.tolist()) - {-1}:
        rows = slots == slot
        ref[rows] = x64[rows] @ a64[slot].T @ b64[slot]
    assert np.all(got[slots < 0] == 0)
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert np.max(np.abs(got - ref)) / np.sqrt(np.mean(ref ** 2)) < tol


@pytest.mark.parametrize("t,n,p,r,d,outs,dtype,used", [
    (16, 8, 4, 16, 256, (384,), "float32", None),
    (32, 128, 32, 16, 4096, (4096, 1024, 1024), "bfloat16", None),
    (200, 64, 16, 64, 14336, (4096,), "bfloat16", None),
    (32, 128, 32, 16, 4096, (14336, 14336), "bfloat16", 27),
    (1024, 128, 32, 16, 4096, (4096, 1024, 1024), "bfloat16", "runs")])
def test_indexed_kernel_on_mosaic_matches_float64(t, n, p, r, d, outs, dtype, used):
    """The indexed kernel (ops/indexed_lora.py) compiled by Mosaic, at Llama-3-8B widths
    over 128 slots, against float64 numpy; slots no token uses hold NaN (never read).
    used: the engine's call, the host's count of the step's adapters listed first (27 of
    a 32 bucket: a last group partly used; gate_up's widths, the largest VMEM plan);
    "runs": a prefill, sequence by sequence, adapters numbered as met (each token tile
    visits only its run of groups)."""
    import jax.numpy as jnp

    from vllm_tpu_lora.ops.indexed_lora import indexed_lora

    rng = np.random.default_rng(t + n)
    active = rng.choice(n, size=p, replace=False).astype(np.int32)
    pos = np.where(rng.random(t) < 0.1, -1, rng.integers(0, p, size=t)).astype(np.int32)
    count = None
    if used == "runs":  # 32 sequences of 32 tokens, every fourth on an adapter met before
        seq = np.arange(32)
        seq[3::4] = seq[3::4] // 2
        met = {a: i for i, a in enumerate(dict.fromkeys(seq.tolist()))}  # numbered as met
        pos = np.repeat([met[a] for a in seq.tolist()], t // 32).astype(np.int32)
        count = jnp.asarray([int(pos.max()) + 1], jnp.int32)
    elif used is not None:
        pos = np.where(pos < 0, -1, pos % used).astype(np.int32)
        pos[:used] = np.arange(used)  # the contract: every position below the count used
        count = jnp.asarray([used], jnp.int32)
    x = rng.standard_normal((t, d))
    ws = [(rng.standard_normal((n, r, d)) / np.sqrt(d), rng.standard_normal((n, r, o)) / np.sqrt(r))
          for o in outs]
    unused = sorted(set(range(n)) - set(active[pos[pos >= 0]].tolist()))
    for a, b in ws:
        a[unused], b[unused] = np.nan, np.nan
    jx = jnp.asarray(x, dtype)
    jws = [(jnp.asarray(a, dtype), jnp.asarray(b, dtype)) for a, b in ws]
    precision = "highest" if dtype == "float32" else "default"
    got = np.asarray(indexed_lora(jx, jws, jnp.asarray(pos), jnp.asarray(active), count,
                                  precision=precision).astype(jnp.float32), np.float64)
    x64 = np.asarray(jx.astype(jnp.float32), np.float64)
    w64 = [tuple(np.asarray(v.astype(jnp.float32), np.float64) for v in w) for w in jws]
    ref = np.zeros_like(got)
    for i in np.flatnonzero(pos >= 0):
        s = active[pos[i]]
        ref[i] = np.concatenate([x64[i] @ a[s].T @ b[s] for a, b in w64])
    assert np.isfinite(got).all() and np.all(got[pos < 0] == 0)
    tol = 1e-4 if dtype == "float32" else 3e-2
    assert np.max(np.abs(got - ref)) / np.sqrt(np.mean(ref ** 2)) < tol


def test_dma_slot_copy_on_mosaic_is_exact():
    """The onehot strategy's slot copy (ops/slot_copy.py) compiled by Mosaic: 32 of 128
    slots, repeats and the last slot among them, a packed qkv A's three slices side by
    side and a wide B, and 64 of 256 slots (more than may be in flight at once), bf16:
    bit-exact to numpy's take."""
    import jax.numpy as jnp

    from vllm_tpu_lora.ops.slot_copy import take_slots_dma

    rng = np.random.default_rng(5)
    some = np.concatenate([[127, 0, 127], rng.integers(0, 128, 29)]).astype(np.int32)
    wide = np.concatenate([some, rng.integers(0, 256, 32)]).astype(np.int32)
    for shapes, slots in (([(128, 16, 2048)] * 3, some), ([(128, 16, 8192)], some),
                          ([(256, 16, 2048)] * 2, wide)):  # past the in-flight window
        bufs = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes]
        got = np.asarray(take_slots_dma(bufs, jnp.asarray(slots)).astype(jnp.float32))
        want = np.concatenate([np.asarray(b.astype(jnp.float32))[slots] for b in bufs], axis=1)
        assert np.array_equal(got, want)


def test_ragged_paged_attention_kernel_matches_hf(llama_dir):
    from vllm_tpu_lora.layers.attention import attention_backend, paged_attention_tpu
    from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

    assert attention_backend() is paged_attention_tpu
    rng = np.random.default_rng(0)
    # 70 tokens > the 32-token bucket: chunked prefill mixes with decodes in the kernel.
    prompts = [rng.integers(3, 500, size=k).tolist() for k in (3, 17, 70, 9)]
    llm = LLM(llama_dir, dtype="float32", **SMALL_ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for out, exp in zip(outs, hf_greedy(load_oracle_model(llama_dir), prompts, MAX_NEW)):
        _assert_greedy_close(out.outputs[0].token_ids, exp)
    stats = llm.llm_engine.stats()
    assert stats["compilations_after_warmup"] == 0
    assert stats["runtime"] == RUNTIME and stats["device"] == "TPU"


# "auto" on a TPU with 4 slots x rank 16: the xla backend's TPU strategies (step_layout):
# steps with 3 adapters fill the 4-slot bucket, every slot, and run "stacked"; smaller
# buckets run "onehot" over DMA-copied slots, or "single". "kernel": "auto" with its grouped
# kernel threshold lowered so that the 32-token buckets of 2+ adapters (and the 16-token
# one of 4) run the kernel under Mosaic inside the engine, beside the other graphs.
# "indexed": the indexed kernel (groups of adapters fetched by its own DMAs) forced on
# every LoRA graph.
@pytest.mark.parametrize("backend", ["pallas", "auto", "kernel", "indexed"])
def test_multi_lora_generation_on_tpu_matches_peft(llama_dir, tmp_path_factory, backend):
    from vllm_tpu_lora.testing.factory import make_peft_adapter
    from vllm_tpu_lora.testing.oracle import hf_greedy, load_oracle_model

    root = tmp_path_factory.mktemp("tpu_adapters")
    specs = {"r8": dict(r=8, seed=1), "qv4": dict(r=4, target_modules=["q_proj", "v_proj"], seed=2),
             "rs16": dict(r=16, use_rslora=True, seed=3)}
    paths = {n: make_peft_adapter(llama_dir, str(root / n), **kw) for n, kw in specs.items()}
    reqs = {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(paths.items())}
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=int(rng.integers(2, 50))).tolist() for _ in range(8)]
    picks = [[*specs, None][i % 4] for i in range(8)]
    llm = LLM(llama_dir, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
              lora_backend=backend if backend in ("pallas", "auto") else "auto", precompile=False,
              **SMALL_ENGINE)
    runner = llm.llm_engine.runner
    assert runner.punica.backend == ("pallas" if backend == "pallas" else "xla")
    if backend == "kernel":
        runner.punica.grouped_kernel_from = (32 * 2 * 16, 2 * 16)
    if backend == "indexed":
        runner.punica.force_strategy = "indexed"
    runner.precompile()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[reqs[n] if n else None for n in picks])
    expected = hf_greedy(load_oracle_model(llama_dir, paths), prompts, MAX_NEW, adapter_names=picks)
    for out, exp in zip(outs, expected):
        _assert_greedy_close(out.outputs[0].token_ids, exp)
    stats = llm.llm_engine.stats()
    assert stats["compilations_after_warmup"] == 0
    kinds = {key.rsplit("/", 1)[1] for key in stats["forward_graph_steps"]}
    if backend == "pallas":
        assert kinds - {"base"} == {"pallas"}, kinds
    elif backend == "auto":
        assert "stacked" in kinds and kinds <= {"base", "onehot", "stacked", "single"}, kinds
    elif backend == "indexed":
        assert kinds - {"base"} == {"indexed"}, kinds
    else:
        assert "grouped_kernel" in kinds, kinds


def test_no_recompilation_on_tpu_while_adapters_swap(llama_dir, tmp_path_factory):
    from vllm_tpu_lora.testing.factory import make_peft_adapter

    root = tmp_path_factory.mktemp("tpu_swap")
    reqs = [LoRARequest(f"s{i}", i + 1, make_peft_adapter(llama_dir, str(root / f"s{i}"), r=8,
                                                          seed=20 + i)) for i in range(5)]
    llm = LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=8, **SMALL_ENGINE)
    rng = np.random.default_rng(2)
    for round_ in range(4):
        n = int(rng.integers(1, 8))
        prompts = [{"prompt_token_ids": rng.integers(3, 500, size=int(rng.integers(1, 90))).tolist()}
                   for _ in range(n)]
        loras = [reqs[int(rng.integers(0, 5))] if rng.integers(3) else None for _ in range(n)]
        params = SamplingParams(temperature=float(round_ % 2), max_tokens=int(rng.integers(1, 12)))
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["compilations_after_warmup"] == 0
    assert stats["lora_slot_loads"] > 2
