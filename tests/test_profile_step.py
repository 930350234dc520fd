"""benchmarks/profile_step.py's reading of a TPU's optimized HLO, on lines as the v5e's
compiler wrote them (the onehot decode graph of the tenth session's call 2)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from profile_step import hlo_scopes, parameter_prefetches  # noqa: E402

HLO = """HloModule jit_model_forward_6, entry_computation_layout={}

ENTRY %main.65 (arg_arrays_0_.1: s64[642], arg_arrays_11_.1: bf16[128,16,2048], weight_arrays_4_.1: bf16[2048]) -> bf16[32,2048] {
  %copy-start.69 = (bf16[128,16,2048]{2,1,0:T(8,128)(2,1)S(1)}, bf16[128,16,2048]{2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%arg_arrays_11_.1)
  %copy-start.31 = (bf16[2048]{0:T(1024)(128)(2,1)S(1)}, bf16[2048]{0:T(1024)(128)(2,1)}, u32[]{:S(2)}) copy-start(%weight_arrays_4_.1)
  %copy-start.51 = (bf16[2064,16,128]{2,1,0:T(8,128)(2,1)}, bf16[2064,16,128]{2,1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%scatter_fusion)
  %slice-start.124 = ((bf16[2048,2048]{1,0:T(8,128)(2,1)}), bf16[512,2048]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%weight_arrays_3_.1), slice={[0:512], [0:2048]}
  %copy-start.70 = (bf16[32,3072]{1,0:T(8,128)(2,1)S(1)}, bf16[32,3072]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%fusion.12)
  %copy-start.71 = (s64[642]{0:T(1024)S(1)}, s64[642]{0:T(1024)}, u32[]{:S(2)}) copy-start(%arg_arrays_0_.1)
  %fusion.322 = bf16[32,2048]{1,0:T(8,128)(2,1)S(1)} fusion(%take_slots_dma.177), kind=kOutput, calls=%fused_computation.552, metadata={op_name="jit(model_forward_6)/lora/dot_general"}
}
"""


def test_parameter_prefetches_counts_whole_parameters_copied_into_vmem():
    """A parameter copied whole into VMEM counts (a 128-slot LoRA buffer, an int64 input,
    a norm weight); a copy out of VMEM, a copy of an intermediate (a fusion's result) and
    a slice of a weight do not."""
    got = parameter_prefetches(HLO)
    lora, packed = 128 * 16 * 2048 * 2, 642 * 8
    assert got == {"arg_arrays": {"count": 2, "mb": round(round(lora / 1e6, 3) + packed / 1e6, 3)},
                   "weight_arrays": {"count": 1, "mb": round(2048 * 2 / 1e6, 3)}}


def test_hlo_scopes_marks_the_lora_scope():
    module, scopes = hlo_scopes(HLO)
    assert module == "jit_model_forward_6"
    assert scopes["fusion.322"] and not scopes["copy-start.69"]
