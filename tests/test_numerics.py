"""The small float codecs in `harness.core.numerics` against torch's casts and compressed-tensors' FP4 path."""

from __future__ import annotations

import math

import pytest
import torch

from harness.core.numerics import (
    E2M1_TABLE,
    E4M3_TABLE,
    decode_e4m3,
    encode_e2m1,
    encode_e4m3,
    encode_e5m2,
    pack_e2m1,
    unpack_e2m1,
)


def test_decode_e4m3_equals_torch_cast_for_all_256_codes():
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn)
    ours, torchs = decode_e4m3(codes), codes.to(torch.float64)
    nan = torch.isnan(torchs)
    assert torch.equal(torch.isnan(ours), nan) and int(nan.sum()) == 2  # 0x7F and 0xFF
    assert torch.equal(ours[~nan], torchs[~nan])
    assert torch.equal(torch.signbit(ours[~nan]), torch.signbit(torchs[~nan]))


def test_encode_e5m2_saturates_where_torchs_cast_overflows_and_rounds_to_nearest_even():
    """An E5M2 KV cache (vLLM's `kv_cache_dtype=fp8_e5m2`) saturates at 57344: torch's own cast
    gives inf. Between 1 and 1.25 (its neighbours) the tie 1.125 goes to the even code, 1."""
    assert torch.isinf(torch.tensor([1e6]).to(torch.float8_e5m2).float()).all()
    assert encode_e5m2(torch.tensor([1e6, -1e6])).float().tolist() == [57344.0, -57344.0]
    assert encode_e5m2(torch.tensor([1.125, 1.126, 1.124])).float().tolist() == [1.0, 1.25, 1.0]


def test_e4m3_table_landmarks():
    assert E4M3_TABLE[0x7E] == 448.0 and E4M3_TABLE[0x01] == 2.0**-9 and E4M3_TABLE[0x08] == 2.0**-6


def test_encode_e4m3_saturates():
    assert torch.equal(
        encode_e4m3(torch.tensor([1e6, -1e6])).to(torch.float64), torch.tensor([448.0, -448.0], dtype=torch.float64)
    )


def test_e2m1_table_values():
    positive = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E2M1_TABLE[:8].tolist() == positive
    assert E2M1_TABLE[8:].tolist() == [-v for v in positive]
    assert math.copysign(1.0, float(E2M1_TABLE[8])) == -1.0  # code 8 is -0


def test_encode_decode_round_trip_every_code():
    codes = torch.arange(16)
    expected = codes.clone()
    expected[8] = 0  # -0.0 is not below zero: it encodes as +0
    assert torch.equal(encode_e2m1(E2M1_TABLE[codes]), expected)


@pytest.mark.parametrize("columns", [1, 2, 15, 16, 33])
def test_pack_unpack_round_trip(columns):
    codes = torch.randint(0, 16, (5, columns), generator=torch.Generator().manual_seed(columns))
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (5, (columns + 1) // 2)
    assert torch.equal(unpack_e2m1(packed, columns), E2M1_TABLE[codes])


def test_pack_puts_even_column_in_low_nibble():
    assert pack_e2m1(torch.tensor([[0x3, 0xA]])).item() == 0xA3


def test_unpack_empty_rows():
    assert unpack_e2m1(torch.zeros(0, 4, dtype=torch.uint8), 8).shape == (0, 8)


def test_encode_e2m1_ties_go_to_the_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert encode_e2m1(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert encode_e2m1(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14]


def test_encode_e2m1_signs_and_saturation():
    values = torch.tensor([-0.1, -0.0, 0.0, 7.0, -1e30, float("inf"), float("nan")])
    assert encode_e2m1(values).tolist() == [8, 0, 0, 7, 15, 7, 0]


def dense_sweep() -> torch.Tensor:
    """Every finite bfloat16 (all ties included), plus float32 neighbours of each midpoint."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    every_bf16 = bits.view(torch.bfloat16).to(torch.float32)
    every_bf16 = every_bf16[torch.isfinite(every_bf16)]
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    near = torch.cat(
        [midpoints, torch.nextafter(midpoints, torch.zeros(8)), torch.nextafter(midpoints, torch.full((8,), 10.0))]
    )
    dense = torch.linspace(-7, 7, 200_001)
    values = torch.cat([every_bf16, near, -near, dense])
    return values[: values.numel() // 2 * 2]


def test_encode_e2m1_agrees_with_compressed_tensors():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    values = dense_sweep()
    theirs = pack_fp4_to_uint8(cast_to_fp4(values.clamp(-6.0, 6.0).reshape(1, -1)))
    assert torch.equal(pack_e2m1(encode_e2m1(values).reshape(1, -1)), theirs)
