"""Predicted misreadings: for a known bug whose wrong reading of a checkpoint is computable, what
the buggy engine holds for one module. A known issue names one (`misreading` in
cases/known_issues.toml), and a weight finding is attributed to it only when the engine's held
values equal the prediction within the weight tolerance (cases/tolerances.toml) of the dtype the
misreading lives in; any other difference is new, even where the known bug applies.

The predictions are the fixes' own computations (harness/fixes decides with the same readings
what to repair), not copies: one registry, name -> formats and a function
(checkpoint, module, model dtype) -> Prediction. The runner compares every weight finding with the
predictions registered for its format and records the verdicts in the finding's
metrics["misreadings"], which known-issue attribution reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.core.dtypes import MODEL_DTYPES
from harness.core.errors import CheckpointError, FormatError, HarnessError, first_line
from harness.core.naming import canonical_name
from harness.core.tolerances import load_tolerances
from harness.differential.compare import compare_weight
from harness.fixes._redequantize import QuantizedCheckpoint
from harness.fixes._shared import SkipTensor
from harness.fixes.ct_fp8_scale_precision import FORMATS as CT_FP8_FORMATS
from harness.fixes.ct_fp8_scale_precision import cast_first_reading, scale_cast_reading
from harness.fixes.fp8_block_grid import inferred_grid_reading
from harness.fixes.nvfp4_weight_global_scale import FORMATS as CT_NVFP4_FORMATS
from harness.fixes.nvfp4_weight_global_scale import slot_convention, swapped_readings

#: the finding kinds a misreading judges (held values of one module)
WEIGHT_KINDS = ("weight-mismatch", "weight-nonfinite")


@dataclass(frozen=True)
class Prediction:
    #: what the buggy engine holds, float64
    values: torch.Tensor
    #: the dtype whose weight tolerance judges agreement (the one the buggy reading is computed in)
    dtype: str


@dataclass(frozen=True)
class Misreading:
    name: str
    formats: tuple[str, ...]
    description: str
    #: (checkpoint, checkpoint module name, model dtype) -> Prediction; SkipTensor with the reason
    #: where the bug would not misread this module
    predict: Callable[[QuantizedCheckpoint, str, str], Prediction]
    #: the same for a tensor stored unquantized (checkpoint tensor name), where the bug misreads
    #: those too (a whole model cast to another dtype); None: it reads them right
    predict_plain: Callable[[QuantizedCheckpoint, str, str], Prediction] | None = None


def _fp8_block_grid_from_shape(source: QuantizedCheckpoint, module: str, dtype: str) -> Prediction:
    tensors = source.tensors(module)
    return Prediction(inferred_grid_reading(tensors["weight"], tensors["weight_scale_inv"]), dtype)


def _nvfp4_global_scale_as_divisor(source: QuantizedCheckpoint, module: str, dtype: str) -> Prediction:
    tensors = source.tensors(module)
    verdict, stored, _ = slot_convention(tensors)
    if verdict != "multiplier":
        raise SkipTensor(f"weight_global_scale {stored:.6g} is not a swapped multiplier ({verdict})")
    # compressed-tensors decompresses NVFP4 in bfloat16, whatever the model dtype
    return Prediction(swapped_readings(tensors, stored)[1], "bfloat16")


def _ct_fp8_scale_cast_to_model_dtype(source: QuantizedCheckpoint, module: str, dtype: str) -> Prediction:
    return Prediction(scale_cast_reading(source, source.tensors(module), MODEL_DTYPES[dtype]), dtype)


def _nvfp4_decompressed_in_bfloat16(source: QuantizedCheckpoint, module: str, dtype: str) -> Prediction:
    if dtype == "bfloat16":
        raise SkipTensor("a bfloat16 model: decompressing to bfloat16 is what it should do")
    truth = source.reference(module)  # SkipTensor where the reference refuses the module
    # compressed-tensors computes codes * (scale / global_scale) in float32 and rounds the product
    # once to bfloat16 (unpack_fp4_from_uint8's dtype), and the parameter stays bfloat16 in any
    # model: it is never rounded to the model dtype. Rounding it to float16 as well would differ
    # from what the engine holds wherever float16 is coarser than bfloat16 (a weight below float16's
    # normal range, 6.1e-5, e.g. a block with a subnormal e4m3 scale: up to 2**-25 off), or beyond it
    # (|w| > 65504: inf).
    return Prediction(truth.to(torch.bfloat16).to(torch.float64), "bfloat16")


def _fp8_scale_held_in_bfloat16(source: QuantizedCheckpoint, module: str, dtype: str) -> Prediction:
    if dtype == "bfloat16":
        raise SkipTensor("a bfloat16 model: holding the scale in bfloat16 is the model dtype's own reading")
    return Prediction(cast_first_reading(source, source.tensors(module), torch.bfloat16), "bfloat16")


def _int_decompressed_in_scale_dtype(source: QuantizedCheckpoint, module: str, dtype: str) -> Prediction:
    scale_dtype = source.tensors(module)["weight_scale"].dtype
    coarser = {torch_dtype: name for name, torch_dtype in MODEL_DTYPES.items() if torch_dtype != torch.float32}
    if scale_dtype not in coarser or scale_dtype == MODEL_DTYPES[dtype]:
        raise SkipTensor(f"weight_scale is {scale_dtype}: decompressing in it loses nothing in a {dtype} model")
    # compressed-tensors' dequantize computes (code - zero_point) * scale in the scale's dtype when
    # given none: the exact product rounded once to it, and transformers holds that parameter as is
    return Prediction(source.reference(module).to(scale_dtype).to(torch.float64), coarser[scale_dtype])


def _require_not_float16(dtype: str) -> None:
    if dtype == "float16":
        raise SkipTensor("a float16 model: casting it to float16 changes nothing")


def _model_cast_to_float16(source: QuantizedCheckpoint, module: str, dtype: str) -> Prediction:
    _require_not_float16(dtype)
    return Prediction(source.reference(module).to(torch.float16).to(torch.float64), "float16")


def _plain_cast_to_float16(source: QuantizedCheckpoint, name: str, dtype: str) -> Prediction:
    _require_not_float16(dtype)
    return Prediction(source.checkpoint.tensor(name).to(torch.float16).to(torch.float64), "float16")


REGISTRY: dict[str, Misreading] = {
    m.name: m
    for m in (
        Misreading(
            "fp8-block-grid-from-shape",
            ("fp8-block",),
            "e4m3 codes times weight_scale_inv spread with the block weight.shape // scale.shape, not the "
            "declared weight_block_size (harness/fixes/fp8_block_grid.py)",
            _fp8_block_grid_from_shape,
        ),
        Misreading(
            "nvfp4-global-scale-read-as-divisor",
            CT_NVFP4_FORMATS,
            "a weight_global_scale that holds ModelOpt's multiplier read as compressed-tensors' divisor: the "
            "weight divided by g^2, in bfloat16 (harness/fixes/nvfp4_weight_global_scale.py)",
            _nvfp4_global_scale_as_divisor,
        ),
        Misreading(
            "ct-fp8-scale-cast-to-model-dtype",
            CT_FP8_FORMATS,
            "e4m3 codes times weight_scale rounded to the model dtype first (harness/fixes/ct_fp8_scale_precision.py)",
            _ct_fp8_scale_cast_to_model_dtype,
        ),
        Misreading(
            "nvfp4-decompressed-in-bfloat16",
            CT_NVFP4_FORMATS,
            "the reference rounded once to bfloat16 and held as bfloat16 (compressed-tensors decompresses NVFP4 "
            "to bfloat16 in any model and does not cast it to the model dtype)",
            _nvfp4_decompressed_in_bfloat16,
        ),
        Misreading(
            "int-decompressed-in-scale-dtype",
            ("ct-int4", "ct-int8"),
            "the reference rounded once to the stored weight_scale's dtype (bfloat16 or float16) and held in it, "
            "whatever the model dtype (compressed-tensors dequantizes in the scale's dtype when given none)",
            _int_decompressed_in_scale_dtype,
        ),
        Misreading(
            "fp8-scale-held-in-bfloat16",
            ("ct-fp8-channel",),
            "e4m3 codes times weight_scale rounded to bfloat16, the product rounded to bfloat16, whatever the "
            "model dtype (auto-round's FP8 static Linear holds its scales and dequantizes in bfloat16)",
            _fp8_scale_held_in_bfloat16,
        ),
        Misreading(
            "model-cast-to-float16",
            ("awq", "gptq"),
            "every weight, quantized or not, the checkpoint's value rounded to float16 (auto-round casts a "
            "model to float16 where its CPU int4 backend does not compute in the model's dtype)",
            _model_cast_to_float16,
            _plain_cast_to_float16,
        ),
    )
}


def require_misreading(name: str, where: str) -> Misreading:
    if name not in REGISTRY:
        raise HarnessError(f"{where}: unknown misreading {name!r} (known: {', '.join(REGISTRY)})")
    return REGISTRY[name]


class CheckpointMisreadings:
    """The predictions for one checkpoint: opened on the first question, once."""

    def __init__(self, directory: str | Path, format_name: str, scheme_names: Iterable[str] = ()):
        """`scheme_names`: the formats a mixed checkpoint's modules are stored in (QuantFormat.schemes)."""
        self.directory = Path(directory)
        self.format_name = format_name
        names = {format_name, *scheme_names}
        self.misreadings = [m for m in REGISTRY.values() if names & set(m.formats)]
        self._source: QuantizedCheckpoint | None = None
        self._modules: dict[str, str] = {}
        self._plain: dict[str, str] = {}

    def _open(self) -> QuantizedCheckpoint:
        if self._source is None:
            self._source = QuantizedCheckpoint.open(self.directory)
            self._modules = {canonical_name(f"{m}.weight"): m for m in self._source.modules}
            self._plain = {canonical_name(name): name for name in self._source.plain}
        return self._source

    def predict(self, name: str, module: str, dtype: str) -> Prediction:
        """`name`'s prediction for the weight `module` (a canonical weight name, as findings name
        it); SkipTensor with the reason where it does not apply."""
        source = self._open()
        misreading = REGISTRY[name]
        if module in self._modules:
            predict, stored = misreading.predict, self._modules[module]
            source = source.narrowed(stored)  # a mixed checkpoint's module: its config group's format
            if source.fmt.name not in misreading.formats:
                raise SkipTensor(f"{module} is stored as {source.fmt.name}")
        elif misreading.predict_plain is not None and module in self._plain:
            predict, stored = misreading.predict_plain, self._plain[module]
        else:
            raise SkipTensor(f"{module} is not a quantized module of the checkpoint")
        try:
            return predict(source, stored, dtype)
        except SkipTensor:
            raise
        except (CheckpointError, FormatError, KeyError, RuntimeError, ValueError) as error:
            raise SkipTensor(f"cannot compute it: {type(error).__name__}: {first_line(error)}") from None

    def verdicts(self, module: str, held: torch.Tensor, dtype: str) -> dict[str, dict]:
        """Per misreading registered for the format: whether `held` (the engine's values for
        `module`) equals its prediction, by compare_weight under the prediction dtype's weight
        tolerance: {"equal", "max_abs", "bad_elements", "dtype"}, or {"undefined": why}."""
        verdicts: dict[str, dict] = {}
        for misreading in self.misreadings:
            try:
                prediction = self.predict(misreading.name, module, dtype)
            except (SkipTensor, CheckpointError) as reason:
                verdicts[misreading.name] = {"undefined": first_line(reason)}
                continue
            if tuple(prediction.values.shape) != tuple(held.shape):
                verdicts[misreading.name] = {
                    "undefined": f"predicted {list(prediction.values.shape)}, held {list(held.shape)}"
                }
                continue
            tolerances = load_tolerances(self.format_name, prediction.dtype)
            diff = compare_weight(module, held, prediction.values, prediction.dtype, tolerances, None)
            verdicts[misreading.name] = {
                "equal": diff.ok,
                "max_abs": diff.max_abs,
                "bad_elements": diff.bad_elements,
                "dtype": prediction.dtype,
            }
        return verdicts
