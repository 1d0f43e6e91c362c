"""Quantize a bf16 Hugging Face checkpoint with compressed-tensors itself, as llm-compressor would.

The second producer beside the harness's own quantizers: transformers loads the model, ct applies
the quantization config the harness format declares, the weight scales come from ct's helpers
(`generate_gparam`, `calculate_qparams`) fed with the min/max a min-max observer sees (the
observers live in llm-compressor, not ct 0.20), static activation scales come from the caller's
observed max |input| per Linear, and ct's `ModelCompressor` compresses and writes the config.

Not reproduced: llm-compressor gives the shards of a fused layer (q/k/v, gate/up) one shared
NVFP4 global scale; here every Linear gets its own, as the harness's quantizers do.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.formats import get_format

SUPPORTED_FORMATS = ("ct-fp8-tensor", "ct-fp8-channel", "ct-fp8-block", "ct-nvfp4", "ct-nvfp4a16")
IGNORED_MODULES = ["lm_head"]
#: perturbation knobs (a broken checkpoint on purpose) and the one value ct itself writes
PERTURBATIONS = {"scale_layout": "normal", "global_scale_convention": "divisor"}
#: files copied unchanged from the source checkpoint, where present
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def produce_with_compressed_tensors(
    model_dir: Path, fmt_name: str, out: Path, activation_amax: dict[str, float], knobs: dict | None = None
) -> None:
    """Write `model_dir` quantized in harness format `fmt_name` by compressed-tensors into `out`.

    `activation_amax` maps a Linear's module name to the max |input| observed on calibration
    data; it is needed for every quantized Linear when the format has static input scales.
    """
    if fmt_name not in SUPPORTED_FORMATS:
        raise HarnessError(
            f"compressed-tensors cannot produce format '{fmt_name}' (supported: {', '.join(SUPPORTED_FORMATS)})"
        )
    model_dir, out = Path(model_dir), Path(out)
    fmt = get_format(fmt_name)
    try:
        resolved = fmt.resolve_knobs(knobs or {})
    except (KeyError, ValueError) as error:
        raise HarnessError(f"{fmt_name}: bad knob {error}") from None
    for name, produced in PERTURBATIONS.items():
        if name in resolved and resolved[name] != produced:
            raise HarnessError(
                f"{fmt_name}: {name}={resolved[name]!r} is a harness perturbation; "
                f"compressed-tensors only writes {produced!r}"
            )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HarnessError(f"{out}: output directory exists and is not empty")
    if not (model_dir / "config.json").is_file():
        raise HarnessError(f"{model_dir}: no config.json (expected an unquantized Hugging Face checkpoint)")

    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    scale_dtype = torch.float32 if resolved.get("scale_dtype") == "float32" else None
    config = QuantizationConfig.model_validate(fmt.quantization_config(resolved, ignore=IGNORED_MODULES))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True)
    apply_quantization_config(model, config)
    quantized = [
        (name, module)
        for name, module in model.named_modules()
        if getattr(module, "quantization_scheme", None) is not None
    ]
    if not quantized:
        raise HarnessError(f"{model_dir}: the {fmt_name} config quantizes no module of this model")
    for name, module in quantized:
        amax = None
        if has_static_input(module.quantization_scheme):
            if name not in activation_amax:
                raise HarnessError(f"{fmt_name} has static input scales: activation_amax has no entry for {name}")
            amax = float(activation_amax[name])
        calibrate_module(module, amax, scale_dtype)

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for file in COPIED_FILES:
        if (model_dir / file).is_file():
            shutil.copyfile(model_dir / file, out / file)


def has_static_input(scheme: Any) -> bool:
    """True when the scheme stores a calibrated input scale: FP8 `input_scale` (dynamic False)
    or NVFP4 `input_global_scale` (dynamic "local": the group scales are computed at run time)."""
    inputs = scheme.input_activations
    return inputs is not None and inputs.dynamic is not True


def calibrate_module(module: Any, activation_amax: float | None = None, scale_dtype: Any = None) -> None:
    """Set the qparams of a Linear prepared by `apply_quantization_config` from its own weight,
    exactly as ct's helpers compute them; `activation_amax` sets the static input scale.

    FP8 (`float`, 8 bits): min/max per tensor, row or block of the weight cast to `scale_dtype`
    (default: the dtype ct gave `weight_scale`, the model's), `calculate_qparams`, stored in that
    dtype. NVFP4 (`tensor_group`): `generate_gparam` over the weight, then `calculate_qparams` per
    16-column group with that global scale; stored into ct's own parameters.
    """
    import torch
    from compressed_tensors.quantization.utils import (
        calculate_qparams,
        generate_gparam,
        maybe_pad_tensor_for_block_quant,
    )

    scheme = module.quantization_scheme
    args, weight = scheme.weights, module.weight.detach()
    with torch.no_grad():
        if args.strategy == "tensor_group":
            global_scale = generate_gparam(weight.amin(), weight.amax())
            module.weight_global_scale.data.copy_(global_scale)
            grouped = weight.reshape(weight.shape[0], -1, args.group_size)
            scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args, global_scale=global_scale)
            module.weight_scale.data.copy_(scale)
            if activation_amax is not None:
                amax = torch.tensor(activation_amax, dtype=weight.dtype)
                module.input_global_scale.data.copy_(generate_gparam(-amax, amax))
            return
        if args.type != "float" or args.num_bits != 8 or args.strategy not in ("tensor", "channel", "block"):
            raise HarnessError(
                f"no calibration for {args.num_bits}-bit {args.type.value} weights, strategy {args.strategy.value}"
            )
        dtype = scale_dtype or module.weight_scale.dtype
        observed = weight.to(dtype)  # the min/max an observer would see, in the qparam dtype
        if args.strategy == "tensor":
            low, high = torch.aminmax(observed)
        elif args.strategy == "channel":
            low, high = observed.amin(1, keepdim=True), observed.amax(1, keepdim=True)
        else:
            rows, cols = args.block_structure
            padded = maybe_pad_tensor_for_block_quant(observed, (rows, cols))
            blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
            low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        scale, _ = calculate_qparams(low, high, args)
        module.weight_scale.data = scale.reshape(module.weight_scale.shape)  # keeps `dtype`
        if activation_amax is not None:
            amax = torch.tensor(activation_amax, dtype=weight.dtype).to(dtype)
            module.input_scale.data = calculate_qparams(-amax, amax, scheme.input_activations)[0]
