"""benchmarks/zero_fills.py's reading of a StableHLO text."""

from benchmarks import zero_fills


def test_allocations_and_their_bytes():
  text = ('%0 = stablehlo.custom_call @AllocateBuffer() : () -> tensor<10x4x4096xbf16>\n'
          '%1 = stablehlo.custom_call @AllocateBuffer() {x} : () -> tensor<3x48xf32>\n'
          '%2 = stablehlo.custom_call @other() : () -> tensor<7xf32>\n')
  shapes = zero_fills.allocations(text)
  assert shapes == ["10x4x4096xbf16", "3x48xf32"]
  assert [zero_fills.tensor_bytes(s) for s in shapes] == [10 * 4 * 4096 * 2, 3 * 48 * 4]
  assert zero_fills.tensor_bytes("5xi1") == 5
