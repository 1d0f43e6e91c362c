"""The checkpoint, built from scratch.

config.json and safetensors, from the format piece's quantizer; returns what each quantized weight
is by the format's definition (float64): the values a correct loader holds."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import save_file

from harness.lanes.upstream.parts.common import MODEL_DTYPE
from harness.lanes.upstream.parts.fp8 import (  # or nvfp4: the format piece the generator picks
    dequantize_definition,
    perturb_storage,
    quantize_weight,
    scale_block,
    subnormal_amax,
)
from harness.lanes.upstream.parts.mxfp4 import pack_experts  # in the mxfp4 piece: used where FORMAT is mxfp4
from harness.lanes.upstream.parts.parameters import CONFIG, DISAGREEMENT, FORMAT, KNOBS, LAYOUT, PERTURB, SEED, TENSORS

# ---- reproduce.py ----

EXTREME_FACTORS = {"none": 1.0, "tiny": 1e-4, "huge": 1e3}
#: formats whose one scale per output row [N, 1] a producer's own config (CONFIG: AutoRound's
#: FP8_STATIC, ModelOpt's FP8_PER_CHANNEL_PER_TOKEN) stores 1-D [N]
ROW_SCALES_1D_FORMATS = ("ct-fp8-channel",)
#: (producer, format, checkpoint_format) -> the tensors of a module that producer's export leaves out
#: (AutoRound's auto_round:auto_gptq packing writes no g_idx); harness.checkpoints.foreign_configs.OMITTED
OMITTED = {("auto-round", "gptq", "gptq"): ("g_idx",)}
#: formats whose [N/bn, K/bk] block grid a producer's own config (ModelOpt's FP8_PB_WO) stores 4-D
#: [N/bn, 1, K/bk, 1], 0-D for a weight of one block
BLOCK_GRID_4D_FORMATS = ("ct-fp8-block",)


#: FP8 KV-cache scales under each naming real checkpoints use (LAYOUT["kv_scales"]): compressed-tensors
#: today, older compressed-tensors, ModelOpt, half a pair, and none (the cache declared only)
KV_SCALE_NAMES = {
    "self_attn": ("self_attn.k_scale", "self_attn.v_scale"),
    "output_scale": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    "proj": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    "k-only": ("self_attn.k_scale",),
    "v-only": ("self_attn.v_scale",),
    "declared-only": (),
}


def tensor_layout() -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the float model: name -> (shape, role), as TENSORS lists them."""
    return {name: (tuple(shape), role) for name, (shape, role) in TENSORS.items()}


def float_weights() -> dict[str, torch.Tensor]:
    """Random weights in the model dtype; biases away from zero; a router's score-correction bias
    small and float32, as DeepSeek-V3 stores it."""
    generator = torch.Generator().manual_seed(SEED)
    weights = {}
    for name, (shape, role) in tensor_layout().items():
        normal = torch.randn(shape, generator=generator)
        if role == "bias":
            magnitude = 0.5 + 0.5 * torch.rand(shape, generator=generator)
            value = torch.where(normal < 0, -magnitude, magnitude)
        elif role == "router_bias":
            weights[name] = 0.01 * normal
            continue
        elif role == "norm":
            value = 1.0 + 0.1 * normal
        else:
            value = normal / math.sqrt(shape[1])
        weights[name] = value.to(MODEL_DTYPE)
    return weights


def perturb_weight(weight: torch.Tensor) -> torch.Tensor:
    """The recipe's weight perturbations, before quantization: extreme magnitudes, a last block
    whose scale is subnormal, an all-zero first block."""
    factor = EXTREME_FACTORS[PERTURB["extreme_amax"]]
    if factor != 1.0:
        weight = (weight.float() * factor).to(weight.dtype)
    weight = weight.clone()
    bn, bk = scale_block(tuple(weight.shape))
    rows, cols = weight.shape
    if PERTURB["subnormal_block"]:
        r0, c0 = (rows - 1) // bn * bn, (cols - 1) // bk * bk
        region = weight[r0:, c0:].float()
        if region.abs().max() > 0:
            target = subnormal_amax(float(weight.float().abs().max()))
            weight[r0:, c0:] = (region * (target / float(region.abs().max()))).to(weight.dtype)
    if PERTURB["zero_block"]:
        weight[:bn, :bk] = 0
    return weight


def inject_nonfinite(tensors: dict[str, torch.Tensor]) -> str:
    """NaN or inf in the first element of the first floating-point scale that can hold it (an E8M0
    byte scale: its NaN, 0xFF, as the generator writes it)."""
    for suffix, tensor in tensors.items():
        if tensor.dtype == torch.uint8 and suffix in ("weight_scale", "weight_scale_inv"):  # E8M0: 0xFF is NaN
            tensors[suffix] = tensor.clone()
            tensors[suffix].view(-1)[0] = 0xFF
            return suffix
        if suffix in ("weight", "weight_packed") or not tensor.is_floating_point():
            continue
        flat = tensor.float().flatten()
        flat[0] = math.nan if PERTURB["nonfinite_scale"] == "nan" else math.inf
        stored = flat.reshape(tensor.shape).to(tensor.dtype)
        if not torch.isfinite(stored.flatten()[0].float()):  # float8_e4m3fn has no inf: the next scale
            tensors[suffix] = stored
            return suffix
    raise RuntimeError("no floating-point scale to make non-finite")


def rename(name: str) -> str:
    prefix = LAYOUT["key_prefix"]
    return prefix + name.removeprefix("model.") if name.startswith("model.") else name


def kv_scales(config) -> dict[str, torch.Tensor]:
    """Each layer's k/v scales (kv amax / 448; float32 [] as ModelOpt exports them, else [1] in the
    model dtype, as llm-compressor saves them), distinct per layer and between k and v."""
    shape = () if LAYOUT["kv_scales"] == "proj" else (1,)
    dtype = torch.float32 if LAYOUT["kv_scales"] == "proj" else MODEL_DTYPE
    scales = {}
    for layer in range(config["num_hidden_layers"]):
        for index, name in enumerate(KV_SCALE_NAMES.get(LAYOUT["kv_scales"], ())):
            value = LAYOUT["activation_amax"] * (1 + 0.25 * layer + 0.5 * index) / 448.0
            scales[f"model.layers.{layer}.{name}"] = torch.full(shape, value, dtype=dtype)
    return scales


#: how the index misstates the target's scale, by disagreement (omitted; placed in a shard file
#: that is not on disk; listed in the first shard though no shard holds it; listed truly while a
#: stale copy with other values sits unlisted in the last shard)
INDEX_EDITS = {
    "index-omits-tensor": "omit",
    "index-names-absent-shard": "absent-shard",
    "index-lists-absent-tensor": "absent-tensor",
    "index-stale-duplicate": "stale-duplicate",
}


def stale_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A stale duplicate's values: a float scale doubled, an integer's lowest bit flipped."""
    if tensor.is_floating_point():
        return (tensor.to(torch.float64) * 2).to(tensor.dtype)
    return tensor ^ 1


def disagree(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The config/tensor disagreement on DISAGREEMENT's module, in the stored tensors: its scale
    deleted, stored under the other convention's name, or copied to a module the model lacks.
    Returns {name: how the index misstates it} (INDEX_EDITS). The config's side (the ignore
    list, quantization_status) is in CONFIG as written."""
    kind, module, scale = PERTURB["disagreement"], DISAGREEMENT["module"], DISAGREEMENT["scale"]
    name = f"{module}.{scale}"
    if kind in ("missing-scale", "index-lists-absent-tensor", "missing-input-scale"):
        del tensors[name]
    elif kind == "scale-renamed":
        other = "weight_scale" if scale == "weight_scale_inv" else "weight_scale_inv"
        tensors[f"{module}.{other}"] = tensors.pop(name)
    elif kind == "orphan-scale":
        tensors[f"{module.rpartition('.')[0]}.unused_proj.{scale}"] = tensors[name].clone()
    return {name: INDEX_EDITS[kind]} if kind in INDEX_EDITS else {}


def write_tensors(directory, tensors: dict[str, torch.Tensor], scales: dict[str, str], misstated=None) -> None:
    """One model.safetensors, or LAYOUT['shards'] files with an index (with split_scale, each
    scale in the shard after its weight's) that lists every tensor where it is, but as
    `misstated` says (disagree)."""
    misstated = misstated or {}
    shards = LAYOUT["shards"]
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    primary = [name for name in tensors if name not in scales]
    place = {name: min(i * shards // len(primary), shards - 1) for i, name in enumerate(primary)}
    place |= {scale: (place[weight] + 1) % shards for scale, weight in scales.items()}
    # a stale copy in the last shard, read after the true one (moved to the first if it was last)
    stale = [name for name, how in misstated.items() if how == "stale-duplicate"]
    place |= {name: 0 for name in stale if place[name] == shards - 1}
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for index, file in enumerate(files):
        chunk = {name: tensor for name, tensor in tensors.items() if place[name] == index}
        if index == shards - 1:
            chunk |= {name: stale_copy(tensors[name]) for name in stale}
        save_file(chunk, str(directory / file), metadata={"format": "pt"})
    weight_map = {name: files[place[name]] for name in tensors if misstated.get(name) != "omit"}
    for name, how in misstated.items():
        if how == "absent-shard":
            weight_map[name] = f"model-{shards + 1:05d}-of-{shards + 1:05d}.safetensors"
        elif how == "absent-tensor":
            weight_map[name] = files[0]
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_checkpoint(directory) -> dict[str, torch.Tensor]:
    """Write config.json and the tensors into `directory`; return module -> its weight by the
    format's definition (float64), the values a correct loader holds."""
    stored, expected, scales = {}, {}, {}
    first = True
    quantized = {"linear"} | {
        role for role, key in (("lm_head", "quantize_lm_head"), ("embedding", "quantize_embeddings")) if LAYOUT[key]
    }
    target = DISAGREEMENT and DISAGREEMENT["module"]
    layout = tensor_layout()
    for name, weight in float_weights().items():
        module = name.removesuffix(".weight")
        if module == target and PERTURB["disagreement"] == "plain-not-ignored":
            stored[name], expected[module] = weight, weight.to(torch.float64)  # as stored: the config quantizes it
            continue
        if layout[name][1] not in quantized:
            stored[name] = weight
            continue
        tensors = quantize_weight(perturb_weight(weight))
        expected[module] = dequantize_definition(tensors)
        tensors, literal = perturb_storage(tensors)
        if literal:  # a storage perturbation that cannot be told apart: the files mean what they say
            expected[module] = dequantize_definition(tensors)
        if first and PERTURB["nonfinite_scale"] != "none":
            inject_nonfinite(tensors)
        first = False
        if LAYOUT["producer_config"] != "native" and FORMAT in ROW_SCALES_1D_FORMATS:
            tensors["weight_scale"] = tensors["weight_scale"].reshape(-1)  # AutoRound's, ModelOpt's [N]
        if LAYOUT["producer_config"] != "native" and FORMAT in BLOCK_GRID_4D_FORMATS:
            grid = tensors["weight_scale"]  # ModelOpt's [N/bn, 1, K/bk, 1], 0-D for one block
            tensors["weight_scale"] = grid.reshape(()) if grid.numel() == 1 else grid[:, None, :, None]
        for suffix in OMITTED.get((LAYOUT["producer_config"], FORMAT, KNOBS.get("checkpoint_format")), ()):
            del tensors[suffix]
        stored |= {f"{module}.{suffix}": tensor.contiguous() for suffix, tensor in tensors.items()}
        if LAYOUT["split_scale"]:
            names = list(tensors)
            scales[rename(f"{module}.{names[1]}")] = rename(f"{module}.{names[0]}")
    stored |= kv_scales(CONFIG)
    misstated = disagree(stored) if target else {}
    if FORMAT == "mxfp4":  # gpt-oss: experts packed on disk, one tensor per projection
        stored, scales = pack_experts(stored), {}
    stored = {rename(name): tensor for name, tensor in stored.items()}
    scales = {scale: weight for scale, weight in scales.items() if scale in stored}
    write_tensors(directory, stored, scales, {rename(name): how for name, how in misstated.items()})
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return expected
