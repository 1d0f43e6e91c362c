"""Write a complete, offline-loadable checkpoint directory from a recipe, with its ground truth.

Layout: config.json (with quantization_config), tokenizer.json, safetensors shards and
model.safetensors.index.json (or one model.safetensors), and the harness's own files:
harness_manifest.json plus harness_truth/{truth,original}.safetensors. The truth files
live in a subdirectory so that loaders which glob `*.safetensors` never pick them up.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from harness import __version__
from harness.checkpoints import disagreements, foreign_configs, fusion, ignore_patterns, kv_scales, packed_experts
from harness.checkpoints.disagreements import DISAGREEMENTS
from harness.checkpoints.reader import INDEX_FILE, SINGLE_FILE
from harness.checkpoints.recipe import VLM_PREFIX, Recipe, ResolvedRecipe
from harness.checkpoints.tokenizer import write_tokenizer
from harness.core.dtypes import MODEL_DTYPES as DTYPES
from harness.core.errors import HarnessError
from harness.formats import get_format, spelling
from harness.formats.base import EXPECTATIONS, FormatError, QuantizedWeight

MANIFEST_FILE = "harness_manifest.json"
TRUTH_DIR = "harness_truth"
TRUTH_FILE = f"{TRUTH_DIR}/truth.safetensors"
ORIGINAL_FILE = f"{TRUTH_DIR}/original.safetensors"
EXTREME_FACTORS = {"none": 1.0, "tiny": 1e-4, "huge": 1e3}


def float_weights(resolved: ResolvedRecipe) -> dict[str, torch.Tensor]:
    """The unquantized model, in the model dtype, drawn from the recipe's seed.

    Biases are drawn away from zero (|b| in [0.5, 1]) so that a clobbered bias is visible.
    """
    arch = resolved.arch
    generator = torch.Generator().manual_seed(resolved.recipe.seed)
    dtype = DTYPES[resolved.layout["dtype"]]
    weights = {}
    for name, (shape, role) in arch.tensor_layout(resolved.settings).items():
        normal = torch.randn(shape, generator=generator, dtype=torch.float32)
        if role in ("linear", "lm_head", "router", "plain"):
            value = normal / math.sqrt(shape[1])
        elif role == "router_bias":  # DeepSeek-V3 stores it float32, whatever the model dtype
            weights[name] = 0.1 * normal
            continue
        elif role == "bias":
            magnitude = 0.5 + 0.5 * torch.rand(shape, generator=generator)
            value = torch.where(normal < 0, -magnitude, magnitude)
        elif role == "norm":
            value = 1.0 + 0.1 * normal
        else:  # embedding: scaled like lm_head, so tied embeddings give moderate logits
            value = normal / math.sqrt(shape[1])
        weights[name] = value.to(dtype)
    return weights


def perturb_weight(
    weight: torch.Tensor, block: tuple[int, int], perturb: dict, fmt, knobs
) -> tuple[torch.Tensor, list[str]]:
    """Weight-level perturbations, applied before quantization so the truth includes them."""
    notes = []
    weight = weight.clone()
    factor = EXTREME_FACTORS[perturb["extreme_amax"]]
    if factor != 1.0:
        weight = (weight.to(torch.float32) * factor).to(weight.dtype)
        notes.append(f"weights scaled by {factor:g}: global scales at an extreme")
    rows, cols = weight.shape
    if perturb["subnormal_block"]:
        r0, c0 = ((rows - 1) // block[0]) * block[0], ((cols - 1) // block[1]) * block[1]
        region = weight[r0:, c0:].to(torch.float32)
        amax = float(region.abs().max())
        target = fmt.subnormal_amax(knobs, float(weight.to(torch.float32).abs().max()))
        if amax > 0:
            weight[r0:, c0:] = (region * (target / amax)).to(weight.dtype)
            notes.append(f"block at [{r0}, {c0}] scaled to amax {target:.3g}: subnormal scale")
    if perturb["zero_block"]:
        weight[: block[0], : block[1]] = 0
        notes.append(f"block [0:{block[0]}, 0:{block[1]}] is all zero")
    return weight, notes


def inject_nonfinite(quantized: QuantizedWeight, kind: str) -> str:
    """Put NaN or inf into the first element of the module's first floating-point scale."""
    for suffix, tensor in quantized.tensors.items():
        if suffix in ("weight", "weight_packed"):
            continue
        if tensor.dtype == torch.uint8 and suffix in ("weight_scale", "weight_scale_inv"):  # E8M0: 0xFF is NaN
            stored = tensor.clone()
            stored.view(-1)[0] = 0xFF
            quantized.tensors[suffix] = stored
            quantized.expectation = "refuse"
            note = f"{suffix}[0] set to nan (E8M0 code 0xFF; the format has no infinity): a loader must refuse it"
            quantized.notes.append(note)
            return note
        if not tensor.is_floating_point():
            continue
        flat = tensor.to(torch.float32).flatten()
        flat[0] = math.nan if kind == "nan" else math.inf
        stored = flat.reshape(tensor.shape).to(tensor.dtype)
        if torch.isfinite(stored.flatten()[0].float()):
            continue  # e4m3 has no infinity (inf saturates to 448): use a float32 scale instead
        quantized.tensors[suffix] = stored
        quantized.expectation = "refuse"
        note = f"{suffix}[0] set to {kind}: a loader must refuse it"
        quantized.notes.append(note)
        return note
    raise HarnessError("this format has no floating-point scale to make non-finite")


def rename_key(name: str, prefix: str) -> str:
    return prefix + name.removeprefix("model.") if name.startswith("model.") else name


def assign_shards(names: list[str], shards: int, split_pairs: dict[str, str]) -> dict[str, int]:
    """Contiguous chunks by tensor order; a scale listed in `split_pairs` goes to the shard
    after its weight's, so the pair is always split across files."""
    primary = [n for n in names if n not in split_pairs]
    placement = {name: min(i * shards // max(len(primary), 1), shards - 1) for i, name in enumerate(primary)}
    for scale, weight in split_pairs.items():
        placement[scale] = (placement[weight] + 1) % shards
    return placement


def combined_expectation(expectations) -> str:
    return max(expectations, key=EXPECTATIONS.index, default="exact")


def quantize_module(
    name: str, weight: torch.Tensor, resolved: ResolvedRecipe, fmt, first: bool, activation_amax: float | None = None
) -> QuantizedWeight:
    """Quantize one Linear after its weight-level perturbations; NaN/inf into the first one's scale."""
    block = fmt.scale_block(resolved.knobs, tuple(weight.shape))
    weight, notes = perturb_weight(weight, block, resolved.perturb, fmt, resolved.knobs)
    quantized = quantize_weight(name, weight, resolved, fmt, activation_amax)
    quantized.notes[:0] = notes
    if first and resolved.perturb["nonfinite_scale"] != "none":
        inject_nonfinite(quantized, resolved.perturb["nonfinite_scale"])
    return quantized


def quantize_weight(
    name: str, weight: torch.Tensor, resolved: ResolvedRecipe, fmt, activation_amax: float | None = None
) -> QuantizedWeight:
    try:
        quantized = fmt.quantize(
            weight,
            resolved.knobs,
            model_dtype=DTYPES[resolved.layout["dtype"]],
            activation_amax=activation_amax or resolved.layout["activation_amax"],
        )
    except FormatError as error:
        raise HarnessError(f"{fmt.name} cannot quantize {name} {list(weight.shape)}: {error}") from None
    quantized.source = weight
    return quantized


def shared_groups(resolved: ResolvedRecipe, fmt, originals: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    """`fused_scales = shared`: every fused group's parts quantized with one shared scale."""
    arch = resolved.arch
    result = {}
    for group in fusion.fusion_groups(arch, resolved.settings):
        parts, notes = {}, {}
        for module in group:
            weight = originals[f"{module}.weight"]
            block = fmt.scale_block(resolved.knobs, tuple(weight.shape))
            parts[module], notes[module] = perturb_weight(weight, block, resolved.perturb, fmt, resolved.knobs)
        try:
            quantized = fusion.quantize_shared(parts, lambda w, g=group: quantize_weight(g[0], w, resolved, fmt))
        except ValueError as error:
            raise HarnessError(f"fused_scales=shared: {error}") from None
        for module in group:
            quantized[module].notes[:0] = notes[module]
        result |= quantized
    return result


def whole_checkpoint_notes(resolved: ResolvedRecipe) -> list[str]:
    """What a correct loader must do about the checkpoint as a whole (each makes it exact-or-refuse)."""
    notes = []
    if resolved.layout["kv_scales"] in kv_scales.NOTES:
        notes.append(kv_scales.NOTES[resolved.layout["kv_scales"]][1])
    if resolved.layout["quantize_lm_head"] and resolved.settings["tie_word_embeddings"]:
        notes.append(
            "the config quantizes lm_head but it is tied to the embeddings, stored unquantized: "
            "tie it to them exactly or refuse, never run a head without its scales"
        )
    if resolved.layout["key_prefix"] == VLM_PREFIX:
        notes.append(
            "keys stored under 'model.language_model.': a text-model loader must map "
            "them onto 'model.' or refuse the checkpoint, never load random weights"
        )
    return notes


def generate(recipe: Recipe, out: str | Path) -> dict[str, Any]:
    """Write the checkpoint for `recipe` into `out` (created; must be empty) and return its manifest."""
    resolved = recipe.resolved()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HarnessError(f"{out}: output directory exists and is not empty")
    fmt = get_format(recipe.format)
    kind = resolved.perturb["disagreement"]
    disagreements.check(kind, resolved.layout["shards"], fmt.quantization_config(resolved.knobs, []) or {})
    layout = resolved.arch.tensor_layout(resolved.settings)
    target = None
    if kind != "none":
        target = disagreements.target_module([n.removesuffix(".weight") for n, s in layout.items() if s[1] == "linear"])
    originals = float_weights(resolved)
    tensors, truth, modules, split_pairs = _quantize_modules(resolved, fmt, layout, originals, target)
    tensors |= kv_scales.tensors(
        resolved.layout["kv_scales"],
        resolved.settings,
        resolved.layout["activation_amax"],
        DTYPES[resolved.layout["dtype"]],
        (fmt.quantization_config(resolved.knobs, []) or {}).get("quant_method", ""),
    )
    unused: list[str] = []
    misstated: dict[str, str] = {}  # what the index says wrong, by name
    if target is not None:
        target, unused, misstated = _make_disagreement(kind, target, fmt, layout, tensors, modules)
        split_pairs = {s: w for s, w in split_pairs.items() if s in tensors and w in tensors}
    checkpoint_notes = whole_checkpoint_notes(resolved)
    expectation = combined_expectation(
        [m["expectation"] for m in modules.values()] + (["exact-or-refuse"] if checkpoint_notes else [])
    )
    _write_tensors(out, resolved, tensors, split_pairs, misstated)
    _write_config(out, resolved, fmt, [target] if kind == "ignored-but-quantized" else [])
    prefix = resolved.layout["key_prefix"]
    (out / TRUTH_DIR).mkdir()
    save_file({rename_key(n, prefix): t.contiguous() for n, t in truth.items()}, str(out / TRUTH_FILE))
    save_file({rename_key(n, prefix): t.contiguous() for n, t in originals.items()}, str(out / ORIGINAL_FILE))
    manifest = {
        "harness_version": __version__,
        "recipe": recipe.to_json(),
        "resolved": {
            "config": resolved.settings,
            "knobs": resolved.knobs,
            "layout": resolved.layout,
            "perturb": resolved.perturb,
        },
        "format": recipe.format,
        "expectation": expectation,
        "notes": checkpoint_notes,
        "modules": {rename_key(m, prefix): info for m, info in modules.items()},
        #: tensors a correct loader leaves unused (and may report as unexpected)
        "unused_tensors": [rename_key(n, prefix) for n in unused],
        "truth_file": TRUTH_FILE,
        "original_file": ORIGINAL_FILE,
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _quantize_modules(
    resolved: ResolvedRecipe, fmt, layout: dict, originals: dict[str, torch.Tensor], target: str | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, dict], dict[str, str]]:
    """Quantize every module the recipe quantizes (its entry in `originals` becomes the weight the
    quantizer saw); the checkpoint's tensors, the truth, each quantized module's manifest entry, and
    with `split_scale` each scale's weight (scale name -> weight name)."""
    kind = resolved.perturb["disagreement"]
    quantized_roles = {"linear"} | {
        role
        for role, key in (("lm_head", "quantize_lm_head"), ("embedding", "quantize_embeddings"))
        if resolved.layout[key]
    }
    fused = resolved.layout["fused_scales"]
    shared = shared_groups(resolved, fmt, originals) if fused == "shared" else {}
    groups = fusion.fusion_groups(resolved.arch, resolved.settings) if fused == "distinct-inputs" else []
    tensors: dict[str, torch.Tensor] = {}
    truth: dict[str, torch.Tensor] = {}
    modules: dict[str, dict] = {}
    split_pairs: dict[str, str] = {}
    for name, weight in originals.items():
        module = name.removesuffix(".weight")
        if layout[name][1] not in quantized_roles or (module == target and kind == "plain-not-ignored"):
            tensors[name] = weight
            truth[name] = weight.to(torch.float64)
            continue
        if module in shared:
            quantized = shared[module]
        else:
            amax = fusion.input_amax(module, groups, resolved.layout["activation_amax"])
            quantized = quantize_module(name, weight, resolved, fmt, not modules, amax)
        quantized.tensors = foreign_configs.stored(
            resolved.layout["producer_config"], fmt.name, quantized.tensors, resolved.knobs
        )
        originals[name] = quantized.source
        for suffix, tensor in quantized.tensors.items():
            tensors[f"{module}.{suffix}"] = tensor
        if resolved.layout["split_scale"]:
            weight_name = fmt.suffixes[0]
            scale = next(s for s in quantized.tensors if s != weight_name)
            split_pairs[f"{module}.{scale}"] = f"{module}.{weight_name}"
        truth[name] = quantized.truth
        if layout[name][1] == "embedding":  # no format's config can say it (their targets are Linears)
            quantized.expectation = combined_expectation([quantized.expectation, "exact-or-refuse"])
            quantized.notes.append(
                "embeddings stored quantized while the config targets Linear layers: dequantize by the tensors or refuse"
            )
        modules[module] = {"shape": list(weight.shape), "expectation": quantized.expectation, "notes": quantized.notes}
    return tensors, truth, modules, split_pairs


def _make_disagreement(
    kind: str, target: str, fmt, layout: dict, tensors: dict[str, torch.Tensor], modules: dict[str, dict]
) -> tuple[str, list[str], dict[str, str]]:
    """Edit `tensors` so the checkpoint disagrees with itself as `kind` says, and note it on the
    module that carries it in `modules`; that module, the tensors left unused and what the index
    will say wrong (by name)."""
    misstated = disagreements.index_edits(kind, target, list(tensors), fmt.marker)
    unused = disagreements.edit_tensors(kind, target, tensors, fmt.marker)
    if unused:  # the orphan's own (weightless) module carries the disagreement
        target = unused[0].rpartition(".")[0]
    entry = modules.setdefault(target, {"shape": list(layout.get(f"{target}.weight", ((),))[0]), "notes": []})
    entry["expectation"] = combined_expectation([entry.get("expectation", "exact"), DISAGREEMENTS[kind].expectation])
    entry["notes"].append(DISAGREEMENTS[kind].note)
    return target, unused, misstated


def _write_tensors(
    out: Path, resolved: ResolvedRecipe, tensors: dict[str, torch.Tensor], split_pairs: dict, misstated: dict
) -> None:
    """Create `out` and write the checkpoint's tensors into it under their stored names (experts
    packed where the architecture packs them, keys under the recipe's prefix)."""
    prefix = resolved.layout["key_prefix"]
    if resolved.arch.packs_experts:  # gpt-oss: every projection's experts in one tensor each
        tensors = packed_experts.pack(tensors)
        split_pairs = {packed_experts.packed_name(s): packed_experts.packed_name(w) for s, w in split_pairs.items()}
        misstated = {packed_experts.packed_name(n): how for n, how in misstated.items()}
    rename = {name: rename_key(name, prefix) for name in tensors}
    names = [rename[n] for n in tensors]
    split_pairs = {rename[s]: rename[w] for s, w in split_pairs.items()}
    out.mkdir(parents=True, exist_ok=True)
    misstated = {rename_key(n, prefix): how for n, how in misstated.items()}
    _write_shards(
        out, {rename[n]: t for n, t in tensors.items()}, names, resolved.layout["shards"], split_pairs, misstated
    )


def _write_config(out: Path, resolved: ResolvedRecipe, fmt, also_ignored: list[str]) -> None:
    """config.json (with the format's quantization_config, its ignore list spelled as the recipe
    says, plus `also_ignored`), generation_config.json and the tokenizer."""
    arch = resolved.arch
    kind = resolved.perturb["disagreement"]
    config = arch.config_json(resolved.settings, resolved.layout["dtype"])
    if resolved.layout["config_style"] == "saved":
        config = {key: value for key, value in config.items() if key not in arch.release_only}
    ignored = arch.ignored_modules(resolved.settings) + also_ignored
    if resolved.layout["quantize_lm_head"]:  # tied: no lm_head tensor, and the list no longer excludes it
        ignored.remove("lm_head")
    ignore = ignore_patterns.spell(
        ignored, resolved.layout["ignore_style"], resolved.settings["num_hidden_layers"], resolved.layout["key_prefix"]
    )
    producer = resolved.layout["producer_config"]
    if not fmt.has_scales:  # an unquantized checkpoint: no quantization_config at all (the recipe refused the rest)
        _write_config_files(out, config, resolved.settings["vocab_size"])
        return
    if producer == foreign_configs.NATIVE:
        config["quantization_config"] = fmt.quantization_config(resolved.knobs, ignore)
    else:
        config["quantization_config"] = foreign_configs.quantization_config(
            producer, fmt.name, resolved.knobs, ignore, resolved.layout["key_prefix"]
        )
    if kind == "status-not-compressed":
        config["quantization_config"]["quantization_status"] = "frozen"
    kv_scales.declare(resolved.layout["kv_scales"], config["quantization_config"])
    if resolved.layout["config_spelling"] == "other-case":
        config["quantization_config"] = spelling.other_case(config["quantization_config"])[0]
    _write_config_files(out, config, resolved.settings["vocab_size"])


def _write_config_files(out: Path, config: dict, vocab_size: int) -> None:
    """config.json as given, generation_config.json and the tokenizer."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}, indent=2) + "\n"
    )
    write_tokenizer(out, vocab_size)


def _write_shards(
    out: Path,
    tensors: dict[str, torch.Tensor],
    names: list[str],
    shards: int,
    split_pairs: dict[str, str],
    misstated: dict[str, str] | None = None,
) -> None:
    """The shards, and the index over them, which misstates the names in `misstated` as
    disagreements.INDEX_EDITS says: left out, placed in an absent shard file, listed though
    absent (in the first shard), or listed truly beside a stale unlisted copy in another shard."""
    misstated = misstated or {}
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(out / SINGLE_FILE), metadata={"format": "pt"})
        return
    placement = assign_shards(names, shards, split_pairs)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    # a stale copy goes to the last shard, read after the true one (which moves to the first if it was
    # there): a loader that reads every file in order and keeps the last copy holds the stale one
    stale = {n: shards - 1 for n, how in misstated.items() if how == "stale-duplicate"}
    placement |= {n: 0 for n in stale if placement[n] == shards - 1}
    for index, file in enumerate(files):
        chunk = {n: tensors[n].contiguous() for n in names if placement[n] == index}
        chunk |= {n: disagreements.stale_copy(tensors[n]).contiguous() for n, at in stale.items() if at == index}
        save_file(chunk, str(out / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {n: files[placement[n]] for n in names if misstated.get(n) != "omit"},
    }
    for name, how in misstated.items():
        if how == "absent-shard":
            index["weight_map"][name] = disagreements.absent_shard(shards)
        elif how == "absent-tensor":
            index["weight_map"][name] = files[0]
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
