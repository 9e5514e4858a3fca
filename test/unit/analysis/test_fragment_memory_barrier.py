"""`fragment_memory` sees through an `stablehlo.optimization_barrier` operand by operand: each
result is a view of the operand in its position, so a barrier changes no buffer's life (the
per-layer rematerialization puts several values through one, `hlopar-rematerialize`)."""

from __future__ import annotations

from hlopar.analysis.fragment_memory import fragment_memory
from hlopar.ir.module import parse_module

BODY = """
func.func @main(%x: tensor<64x64xf32>) -> tensor<64x64xf32> {{
  %a = stablehlo.dot_general %x, %x, contracting_dims = [1] x [0] : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  %b = stablehlo.dot_general %x, %x, contracting_dims = [0] x [0] : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  {barrier}
  %c = stablehlo.dot_general {a}, %x, contracting_dims = [1] x [0] : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  %d = stablehlo.dot_general %c, {b}, contracting_dims = [1] x [0] : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  return %d : tensor<64x64xf32>
}}
"""


def test_a_barrier_changes_no_buffer_life():
    plain = fragment_memory(parse_module(BODY.format(barrier="", a="%a", b="%b")))
    barred = fragment_memory(
        parse_module(
            BODY.format(
                barrier="%r:2 = stablehlo.optimization_barrier %a, %b : tensor<64x64xf32>, tensor<64x64xf32>",
                a="%r#0",
                b="%r#1",
            )
        )
    )
    # a, b and c live at once (b is read last): 3 x 16 KiB.
    assert plain.temporaries == 3 * 64 * 64 * 4
    assert barred == plain
