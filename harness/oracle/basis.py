"""Basis inputs for one Linear: rows c * e_j, one per probed column j, whose output is
d * W[:, j] + b with d what the Linear's input quantization makes of c. An engine's output on them
gives the columns of the weight its kernel really applies, after whatever it did to the loaded
weights (harness.differential.effective_weights).

c is chosen per activation scheme so that its quantization is exact wherever the definition
allows it: unquantized inputs take 1; dynamic FP8 takes 448 * 2**-8 (the scale amax / 448 is then
2**-8, a power of two: exact in every dtype); dynamic int8 takes 127 * 2**-6; a static FP8 scale s
takes s itself as the model dtype holds it (quantized to 1 * s); NVFP4 takes 6 / G (its group
scale then rounds to exactly 1 on the E4M3 grid and the value to the E2M1 maximum); MXFP4 takes 6
(its group scale 2**(floor(log2 6) - 2) = 1, the value the E2M1 maximum). A one-hot row
is quantized in the grid's top code, so conventions that differ only in where the amax lands
(compressed-tensors' int8 scale amax / 127.5 against vLLM's amax / 127) give different d: each
candidate d is returned, and the judge accepts the one the engine's output fits."""

from __future__ import annotations

import dataclasses

import torch

from harness.core.numerics import E2M1_MAX, E4M3_MAX
from harness.oracle.activations import ActivationScheme, quantize_activations

#: how many of a Linear's input columns the basis probes: every one up to this many, else this many
#: evenly spaced (the first and the last among them), more where a 128-column scale block would be
#: skipped (a 14336-wide down_proj: 114)
MAX_COLUMNS = 64
SCALE_BLOCK = 128


def basis_columns(in_features: int, limit: int = MAX_COLUMNS) -> torch.Tensor:
    if in_features <= limit:
        return torch.arange(in_features)
    count = max(limit, -(-in_features // SCALE_BLOCK) + 2)  # spacing below one block: each block met
    return torch.linspace(0, in_features - 1, count).round().long().unique()


def basis_value(scheme: ActivationScheme | None, stored: torch.Tensor | None, dtype: torch.dtype) -> float:
    """c: the value each basis row holds at its column, in `dtype`."""
    if scheme is None:
        value = 1.0
    elif scheme.kind == "fp8" and scheme.static:
        value = float(stored.to(torch.float64).reshape(()))
    elif scheme.kind in ("fp8", "mxfp8"):  # MXFP8: 1.75 rounds up to the power 2, its scale 2**-7: 224 exact
        value = E4M3_MAX * 2.0**-8
    elif scheme.kind == "int8":
        value = 127 * 2.0**-6
    elif scheme.kind == "mxfp4":
        value = E2M1_MAX
    else:  # NVFP4: the global scale G in the divisor convention
        stored_value = float(stored.to(torch.float64).reshape(()))
        global_scale = 1.0 / stored_value if scheme.multiplier else stored_value
        value = E2M1_MAX / global_scale
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def basis_input(
    scheme: ActivationScheme | None, stored: torch.Tensor | None, in_features: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """`basis` [C, in_features] in `dtype` (row i = c * e_columns[i]), `columns` [C], and
    `candidates` [n, C] float64: each value d the row's one element may quantize to (the
    definition's first; then the exact c, where a convention lands the amax on the grid's top
    code; then, for a dynamic scale, the definition computed in `dtype`); `scale_rounding` [1]: a static scale's relative rounding to `dtype`, which every
    output of an engine that holds the scale in the model dtype carries; `static` [1]: whether the
    input has a static scale (then a uniform factor over the whole Linear is the activation
    probe's to judge: by outputs alone it is a static input scale or a per-tensor weight scale)."""
    columns = basis_columns(in_features)
    value = basis_value(scheme, stored, dtype)
    rows = torch.zeros(len(columns), in_features, dtype=dtype)
    rows[torch.arange(len(columns)), columns] = value
    candidates = [torch.full((len(columns),), value, dtype=torch.float64)]
    rounding = 0.0
    if scheme is not None:
        diagonal = torch.arange(len(columns)), columns
        candidates.insert(0, quantize_activations(rows.double(), scheme, stored)[diagonal])
        if scheme.dynamic and not scheme.static:  # the scale computed in the model dtype, as
            # compressed-tensors' calculate_qparams does (amax / 127.5 rounds in bfloat16)
            model = dataclasses.replace(scheme, arithmetic="model")
            candidates.append(quantize_activations(rows, model)[diagonal].double())
        if scheme.static and stored is not None:
            exact = stored.to(torch.float64).reshape(())
            rounding = float(((stored.to(dtype).to(torch.float64).reshape(()) - exact) / exact).abs())
    return {
        "basis": rows,
        "columns": columns,
        "candidates": torch.stack(candidates),
        "scale_rounding": torch.tensor([rounding], dtype=torch.float64),
        "static": torch.tensor([bool(scheme is not None and scheme.static and stored is not None)]),
    }
