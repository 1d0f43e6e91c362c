"""Basis inputs (harness.oracle.basis) and the effective-weight judgement on them
(harness.differential.effective_weights), without engines: a simulated kernel that holds its
weight in the model dtype passes, one that changes the weight after loading is named."""

from __future__ import annotations

import pytest
import torch

from harness.differential.effective_weights import judge_module, row_ranges
from harness.oracle.activations import ActivationScheme, quantize_activations
from harness.oracle.basis import MAX_COLUMNS, basis_columns, basis_input

FP8_TOKEN = ActivationScheme("fp8", "token", dynamic=True)
FP8_GROUP = ActivationScheme("fp8", "group", dynamic=True, group_size=128)
FP8_STATIC = ActivationScheme("fp8", "tensor", dynamic=False, static="input_scale")
INT8_TOKEN = ActivationScheme("int8", "token", dynamic=True)
NVFP4 = ActivationScheme("nvfp4", "tensor_group", dynamic=True, group_size=16, static="input_global_scale")
MXFP4 = ActivationScheme("mxfp4", "group", dynamic=True, group_size=32)


def test_columns_cover_small_inputs_and_spread_over_large_ones():
    assert basis_columns(40).tolist() == list(range(40))
    wide = basis_columns(4096)
    assert len(wide) == MAX_COLUMNS and wide[0] == 0 and wide[-1] == 4095
    assert int(wide.diff().max()) < 128  # every 128-column scale block is met
    widest = basis_columns(14336)
    assert int(widest.diff().max()) < 128 and widest[-1] == 14335


@pytest.mark.parametrize(
    "scheme, stored",
    [
        (None, None),
        (FP8_TOKEN, None),
        (FP8_GROUP, None),
        (FP8_STATIC, torch.tensor(0.0123)),
        (NVFP4, torch.tensor(37.5)),
        (MXFP4, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_basis_values_quantize_to_themselves_under_the_definition(scheme, stored, dtype):
    """Each row's one element is quantized exactly (dynamic schemes), or to the static scale itself:
    the definition's candidate d is the row's value up to the scale's rounding to the model dtype."""
    basis = basis_input(scheme, stored, 300, dtype)
    rows, columns = basis["basis"], basis["columns"]
    value = rows[0, columns[0]].double()
    assert torch.count_nonzero(rows) == len(columns) and (rows[torch.arange(len(columns)), columns] == rows[0, 0]).all()
    relative = (basis["candidates"][0] - value).abs() / value
    assert float(relative.max()) <= float(basis["scale_rounding"]) + 2.0**-9


def test_int8_candidates_hold_both_amax_conventions():
    """compressed-tensors' symmetric int8 scale amax / 127.5 puts a lone element at 127 / 127.5 of
    itself; a kernel with amax / 127 keeps it; the first computed in bfloat16 (as compressed-tensors
    does) lands within bfloat16's rounding of the float64 one: all three are candidates."""
    basis = basis_input(INT8_TOKEN, None, 64, torch.bfloat16)
    value = float(basis["basis"][0, 0])
    definition, exact, in_model_dtype = basis["candidates"][:, 0].tolist()
    assert (definition, exact) == pytest.approx((value * 127 / 127.5, value))
    assert in_model_dtype == pytest.approx(definition, rel=2.0**-7)
    quantized = quantize_activations(basis["basis"].double(), INT8_TOKEN)
    assert float(quantized[0, 0]) == pytest.approx(value * 127 / 127.5)


def kernel_output(weight, bias, basis, dtype, applied=None):
    """A kernel holding `applied` (default: `weight` rounded to the model dtype) on the basis rows."""
    held = (weight if applied is None else applied).to(dtype).double()
    rows = basis["basis"].double() * basis["candidates"][0, 0] / basis["basis"][0, basis["columns"][0]].double()
    out = rows @ held.T + (bias.double() if bias is not None else 0)
    return out.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_kernel_applying_the_placed_weight_passes_and_a_changed_part_is_named(dtype):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=generator, dtype=torch.float64) * 0.05
    bias = torch.randn(96, generator=generator, dtype=torch.float64).to(dtype)
    basis = {f"m.{k}": v for k, v in basis_input(FP8_TOKEN, None, 80, dtype).items()}
    good = kernel_output(weight, bias, basis_input(FP8_TOKEN, None, 80, dtype), dtype)
    assert judge_module("m", good, weight.float(), bias, basis, dtype) is None
    changed = weight.clone()
    changed[64:] *= 0.5  # the last part's scale halved after loading
    bad = kernel_output(weight, bias, basis_input(FP8_TOKEN, None, 80, dtype), dtype, changed)
    verdict = judge_module("m", bad, weight.float(), bias, basis, dtype)
    assert verdict["rows"] == "64-95" and verdict["ratio"] == pytest.approx(0.5, rel=1e-2)
    one = weight.clone()
    one[3, 0] += 4 * float(weight[3, 0].abs().clamp(min=1e-3))  # one element, as a saturating product moves it
    verdict = judge_module(
        "m",
        kernel_output(weight, bias, basis_input(FP8_TOKEN, None, 80, dtype), dtype, one),
        weight.float(),
        bias,
        basis,
        dtype,
    )
    assert verdict["elements"] == 1 and verdict["rows"] == "3"


def test_row_ranges_name_runs_of_rows():
    mask = torch.zeros(20, dtype=torch.bool)
    mask[[0, 1, 2, 5, 9, 10]] = True
    assert row_ranges(mask) == "0-2, 5, 9-10"
