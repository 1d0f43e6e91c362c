"""Online quantization: what an engine that quantizes an unquantized checkpoint while loading must
hold and compute, as the reference models it. The schemes are vLLM's (`LLM(quantization=...)`,
vllm/model_executor/layers/quantization/online/fp8.py and vLLM's online quantization guide,
vLLM 0.32), written here from that definition, float32 arithmetic where the definition computes
in float32:

- `fp8_per_channel` (llm-compressor's FP8_DYNAMIC layout): per output row, the scale
  s = max(amax(row) / 448, 1 / (448 * 512)) in float32, codes e4m3(clamp(w / s)) with the
  division in float32; activations FP8, dynamic per token.
- `fp8_per_block`: 128 x 128 blocks over the weight as the engine fuses it (q/k/v and gate/up
  stacked by rows, so a block may span two parts), s = max(amax(block), 1e-4) / 448 in float32,
  codes e4m3(w * (1 / s)) with the reciprocal and the product in float32; activations FP8,
  dynamic in groups of 128 columns.

Every Linear of the decoder layers is quantized; the embeddings, the LM head and norms stay as
stored. Mixture-of-experts layers are not modelled (the engine's MoE online methods differ).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from harness.core.errors import HarnessError
from harness.core.numerics import E4M3_MAX, ceil_div, encode_e4m3
from harness.oracle.activations import ActivationScheme

SCHEMES = ("fp8_per_channel", "fp8_per_block")
BLOCK = 128
#: fp8_per_channel's smallest scale: 1 / (448 * 512)
CHANNEL_SCALE_FLOOR = 1.0 / (E4M3_MAX * 512)
#: fp8_per_block's smallest block amax
BLOCK_AMAX_FLOOR = 1e-4
#: the Linears an engine fuses, by the leaf names of their parts (quantized together per block)
FUSED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def require_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise HarnessError(f"online quantization {scheme!r} is not modelled (modelled: {', '.join(SCHEMES)})")
    return scheme


def activation_scheme(scheme: str) -> ActivationScheme:
    """The activation quantization the scheme's kernel applies."""
    if require_scheme(scheme) == "fp8_per_channel":
        return ActivationScheme("fp8", "token", True)
    return ActivationScheme("fp8", "group", True, BLOCK)


def quantize(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One [N, K] weight in the model dtype, as the scheme quantizes it: (E4M3 codes [N, K], float32
    scales: [N, 1] per channel, [ceil(N/128), ceil(K/128)] per block)."""
    values = weight.to(torch.float32)
    if require_scheme(scheme) == "fp8_per_channel":
        amax = values.abs().amax(dim=-1, keepdim=True)
        scale = (amax / torch.tensor(E4M3_MAX)).clamp_min(torch.tensor(CHANNEL_SCALE_FLOOR, dtype=torch.float32))
        return encode_e4m3(values / scale), scale
    rows, cols = values.shape
    padded = torch.zeros(ceil_div(rows, BLOCK) * BLOCK, ceil_div(cols, BLOCK) * BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = values
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(BLOCK_AMAX_FLOOR) / E4M3_MAX
    codes = encode_e4m3(blocks * (1.0 / scale)).view_as(padded)[:rows, :cols]
    return codes, scale.view(blocks.shape[0], blocks.shape[2])


def decode(codes: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """float64 [N, K]: E4M3 `codes` [N, K] times their scales (quantize's layout)."""
    values = codes.to(torch.float64)
    if require_scheme(scheme) == "fp8_per_channel":
        if scale.numel() != values.shape[0]:
            raise HarnessError(f"{scheme}: {scale.numel()} scales for {values.shape[0]} rows")
        return values * scale.to(torch.float64).reshape(-1, 1)
    rows, cols = values.shape
    expected = (ceil_div(rows, BLOCK), ceil_div(cols, BLOCK))
    if tuple(scale.shape) != expected:
        raise HarnessError(
            f"{scheme}: scales {list(scale.shape)} for a [{rows}, {cols}] weight, expected {list(expected)}"
        )
    grid = scale.to(torch.float64).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return values * grid[:rows, :cols]


def fused_groups(linears: Iterable[str]) -> list[tuple[str, ...]]:
    """The Linears quantized together (an engine's fused q/k/v and gate/up), each alone otherwise."""
    names, groups, grouped = set(linears), [], set()
    for name in sorted(names):
        parent, _, leaf = name.rpartition(".")
        for parts in FUSED_PARTS:
            members = tuple(f"{parent}.{part}" for part in parts)
            if leaf == parts[0] and all(member in names for member in members):
                groups.append(members)
                grouped |= set(members)
    return groups + [(name,) for name in sorted(names - grouped)]


def quantized_linears(linears: Iterable[str]) -> list[str]:
    """The Linears the schemes quantize: those of the decoder layers (not the LM head)."""
    return sorted(name for name in linears if ".layers." in name)


def fake_quantized(weights: Mapping[str, torch.Tensor], scheme: str) -> dict[str, torch.Tensor]:
    """Each named [N, K] weight (model dtype) as the engine applies it after quantizing online:
    float64, fused parts quantized together where the scheme's scales span rows."""
    result = {}
    for group in fused_groups(weights):
        if scheme == "fp8_per_channel" or len(group) == 1:  # per row: fusion changes nothing
            for name in group:
                result[name] = decode(*quantize(weights[name], scheme), scheme)
            continue
        rows = [weights[name].shape[0] for name in group]
        whole = decode(*quantize(torch.cat([weights[name] for name in group]), scheme), scheme)
        result |= dict(zip(group, torch.split(whole, rows), strict=True))
    return result


def refusal(config: Mapping, scheme: str) -> str | None:
    """Why online quantization with `scheme` is not modelled for a checkpoint with `config.json`
    `config` (the engine's and the reference's one reason), or None: it starts from an unquantized
    checkpoint of a dense model."""
    declared = config.get("quantization_config")
    if declared:
        method = declared.get("quant_method", "?") if isinstance(declared, Mapping) else "?"
        return f"quantization={scheme} quantizes an unquantized checkpoint while loading; this one is already quantized ({method})"
    if is_moe(config):
        return f"quantization={scheme} on a mixture-of-experts model: not modelled by the reference"
    return None


def is_moe(config: Mapping) -> bool:
    """Whether the model has routed experts (the schemes' MoE methods are not modelled here)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    return any(text.get(key) for key in ("num_local_experts", "num_experts", "n_routed_experts"))
