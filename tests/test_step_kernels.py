"""bench/step_kernels.py: the kernels a decode window's loop launches, read from optimized HLO."""

from __future__ import annotations

import json

import pytest

from bench import step_kernels as sk

# The shapes of an optimized GPU module's lines: a Pallas kernel (a Triton custom call named by
# its op name), a cuBLAS call, an XLA fusion, and a loop whose condition only reads its carry.
HLO = """HloModule jit_window

%fused_add (param_0: s32[]) -> s32[] {
  %param_0 = s32[] parameter(0)
  ROOT %add.1 = s32[] add(%param_0, %param_0)
}

%body (arg: (s32[], f16[16,768], pred[])) -> (s32[], f16[16,768], pred[]) {
  %arg = (s32[], f16[16,768], pred[]) parameter(0)
  %x = f16[16,768]{1,0} get-tuple-element(%arg), index=1
  %pallas_call.3 = f16[16,768]{1,0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(_decode_fn)/while/body/GPT2/h_0/ln_1/jit(layer_norm)/layer_norm_r1_w8/pallas_call"}
  %cublas.1 = (f16[16,768]{1,0}, s8[0]{0}) custom-call(%pallas_call.3), custom_call_target="__cublas$gemm"
  %loop_add_fusion.2 = s32[] fusion(%k), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f16[16,768], pred[]) tuple(%loop_add_fusion.2, %x, %go)
}

%cond (arg.1: (s32[], f16[16,768], pred[])) -> pred[] {
  %arg.1 = (s32[], f16[16,768], pred[]) parameter(0)
  ROOT %go.1 = pred[] get-tuple-element(%arg.1), index=2
}

ENTRY %main (p: f16[16,768]) -> f16[16,768] {
  %p = f16[16,768]{1,0} parameter(0)
  %w = (s32[], f16[16,768], pred[]) while(%init), condition=%cond, body=%body
  ROOT %r = f16[16,768]{1,0} get-tuple-element(%w), index=1
}
"""


def test_window_loops_label_each_kernel():
    (loop,) = sk.window_loops(HLO)
    assert [k["label"] for k in loop["body"]] == [
        "pallas layer_norm_r1_w8",
        "custom-call __cublas$gemm",
        "fusion loop_add_fusion (kLoop)",
    ]
    assert loop["condition"] == []
    counts = sk.summary(loop)
    assert counts["kernels_per_trip"] == 3 and counts["pallas"] == 1 and counts["other"] == 2
    assert counts["in_condition"] == 0


def test_decode_window_lists_its_loop_kernels(tmp_path):
    """The engine's decode window, compiled for this CPU: its loop's body runs the forward's
    kernels and its condition's are counted apart; the JSON says the same."""
    path = tmp_path / "k.json"
    args = ["--model", "random:tiny", "--batch", "2", "--dtype", "float32", "--target", "cpu"]
    result = sk.main([*args, "--kernel-tile", "linear.num_warps=2", "--json", str(path)])
    (loop,) = result["loops"]
    # The condition computes whether rows are alive and steps are left (a kernel of its own).
    assert loop["in_condition"] == len(loop["condition"]) >= 1
    assert loop["pallas"] == 0 and loop["other"] == len(loop["body"]) > 10  # the forward's
    written = json.loads(path.read_text())
    assert written["loops"][0]["kernels_per_trip"] == len(loop["body"]) + len(loop["condition"])
    assert written["kernel_tiles"] == ["linear.num_warps=2"]
    with pytest.raises(SystemExit):  # a bad kernel setting: a usage error before any compile
        sk.main([*args, "--kernel", "linear_max_rows=x"])
