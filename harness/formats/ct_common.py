"""What the compressed-tensors formats written as one weights-only config group share: the
top-level `quantization_config` compressed-tensors' `ModelCompressor.update_config` writes, and
finding that group again when reading a config back."""

from __future__ import annotations

from collections.abc import Mapping

#: the compressed-tensors release whose `ModelCompressor.update_config` output we reproduce
CT_VERSION = "0.20.0"
#: the compressed-tensors kv_cache_scheme producers write for a static FP8 per-tensor KV cache
CT_KV_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


def single_group_config(format_name: str, weights: dict, ignore: list[str]) -> dict:
    """A weights-only config group for every Linear in `format_name`, in the top-level config."""
    group = {
        "format": format_name,
        "input_activations": None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": weights,
    }
    return {
        "config_groups": {"group_0": group},
        "format": format_name,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def single_group(config: Mapping, format_name: str) -> dict | None:
    """The one config group of a compressed-tensors config in `format_name`, else None."""
    if config.get("quant_method") != "compressed-tensors":
        return None
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        return None
    group = next(iter(groups.values()))
    if not isinstance(group, dict) or (group.get("format") or config.get("format")) != format_name:
        return None
    return group


def partial_last_group(result, cols: int, group: int, what: str):
    """`result` (a QuantizedWeight) marked exact-or-refuse where K leaves a partial last group of
    `what`, which compressed-tensors 0.20 cannot quantize or dequantize; `result` itself."""
    if cols % group:
        result.expectation = "exact-or-refuse"
        result.notes.append(
            f"K={cols} is not a multiple of {what} {group}: the last group is partial, which "
            "compressed-tensors 0.20 cannot quantize or dequantize (it raises)"
        )
    return result
