"""Generator fidelity: for each format and scheme both write, the harness's generator writes what the
real producer writes (cases/producers/): per quantized module the same tensors with the same dtypes
and shapes, and a quantization_config with the same defining fields. Where they differ on purpose,
the difference is named here with its reason; anything else fails, and the generator follows the
producer."""

from __future__ import annotations

import pytest

from harness.checkpoints.reader import Checkpoint
from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.lanes.producers import CORPUS

#: (harness format, its knobs and layout, the corpus case of the producer's same scheme)
PAIRS = [
    ("ct-fp8-channel", {}, {}, "llmcompressor/llama-fp8-dynamic"),
    ("ct-fp8-tensor", {"input_scale": True}, {}, "llmcompressor/llama-fp8"),
    ("ct-fp8-tensor", {"input_scale": True}, {"kv_scales": "self_attn"}, "llmcompressor/llama-fp8-kv"),
    ("ct-fp8-block", {}, {}, "llmcompressor/llama-fp8-block"),
    ("ct-int4", {}, {}, "llmcompressor/llama-w4a16"),
    ("ct-nvfp4a16", {}, {}, "llmcompressor/llama-nvfp4a16"),
    ("ct-nvfp4", {}, {}, "llmcompressor/llama-nvfp4"),
    ("ct-mxfp4", {}, {}, "llmcompressor/llama-mxfp4a16"),
    ("ct-fp8-channel", {}, {"expert_naming": "projections"}, "llmcompressor/mixtral-fp8-dynamic"),
    ("modelopt-fp8", {}, {}, "modelopt/fp8"),
    ("modelopt-nvfp4", {}, {}, "modelopt/nvfp4"),
    ("fp8-block", {"block_rows": 64, "block_cols": 64}, {}, "transformers_fp8/fp8_block64"),
]
#: the quantization args that define a scheme (observers and their kwargs are calibration history)
DEFINING = ("type", "num_bits", "strategy", "symmetric", "dynamic", "group_size", "block_structure", "actorder")
#: deliberate differences, by format: (what, why)
DELIBERATE = {
    "modelopt-fp8": {
        "weight_scale shape": "ModelOpt 0.39's export writes the per-tensor weight_scale [1] (the default "
        "`producer_version`); 0.47 writes it []; the reference reads both",
        "ignore": "ModelOpt 0.47 also lists model.embed_tokens, which no format here quantizes",
    },
    "modelopt-nvfp4": {
        "ignore": "ModelOpt 0.47 also lists model.embed_tokens, which no format here quantizes",
    },
    "fp8-block": {
        "config fields": "the generator writes FineGrainedFP8 as DeepSeek-V3's release does (fmt, "
        "modules_to_not_convert); transformers' own save adds scale_fmt, expert_dtype, dequantize",
    },
}
#: config fields that name versions or producers, not the scheme
VERSIONS = ("version", "producer", "quantization_status_version")


def layer_tensors(checkpoint: Checkpoint) -> dict[str, tuple[str, tuple]]:
    """Layer 0's tensors: name -> (safetensors dtype, shape)."""
    result = {}
    for name in checkpoint.names():
        if name.startswith("model.layers.0."):
            entry = checkpoint.headers[checkpoint.shard_of(name)][name]
            result[name] = (entry["dtype"], tuple(entry["shape"]))
    return result


def generated_like(producer: Checkpoint, fmt: str, knobs: dict, layout: dict, directory) -> Checkpoint:
    config = producer.config
    sizes = {key: config[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads")}
    sizes |= {"num_key_value_heads": config["num_key_value_heads"], "num_hidden_layers": 1, "vocab_size": 260}
    sizes["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    arch = {"llama": "llama", "mixtral": "mixtral"}[config["model_type"]]
    if arch == "mixtral":
        sizes |= {"num_local_experts": config["num_local_experts"], "num_experts_per_tok": 2}
    recipe = Recipe(format=fmt, arch=arch, config=sizes, knobs=knobs, layout={"shards": 1, **layout})
    generate(recipe, directory)
    return Checkpoint(directory)


def differences(generated: Checkpoint, producer: Checkpoint) -> set[str]:
    """What differs, each named by what it is about."""
    found = set()
    mine, theirs = layer_tensors(generated), layer_tensors(producer)
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            mine_shape, their_shape = (x[1] if x else None for x in (mine.get(name), theirs.get(name)))
            same_but_scalar = mine_shape in ((1,), ()) and their_shape in ((1,), ())
            what = name.rpartition(".")[2]
            found.add(
                f"{what} shape"
                if same_but_scalar and mine[name][0] == theirs[name][0]
                else f"{name}: {mine.get(name)} vs {theirs.get(name)}"
            )
    ours, real = generated.quantization_config, producer.quantization_config
    fields = {k for k in set(ours) | set(real) if k not in VERSIONS and k not in ("config_groups", "kv_cache_scheme")}
    for key in sorted(fields):
        if key == "ignore" and sorted(ours.get(key) or []) == sorted(real.get(key) or []):
            continue  # the order of an ignore list means nothing
        if ours.get(key) != real.get(key):
            found.add(key if key == "ignore" else "config fields")
    for role in ("weights", "input_activations"):
        for key in DEFINING:
            if _args(ours, role).get(key) != _args(real, role).get(key):
                found.add(f"{role}.{key}: {_args(ours, role).get(key)!r} vs {_args(real, role).get(key)!r}")
    kv_ours, kv_real = ours.get("kv_cache_scheme") or {}, real.get("kv_cache_scheme") or {}
    if any(kv_ours.get(key) != kv_real.get(key) for key in DEFINING):
        found.add("kv_cache_scheme")
    return found


def _args(config: dict, role: str) -> dict:
    groups = list((config.get("config_groups") or {}).values())
    return (groups[0].get(role) or {}) if groups else {}


@pytest.mark.parametrize("fmt, knobs, layout, case", PAIRS, ids=[f"{p[0]}-{p[3]}" for p in PAIRS])
def test_the_generator_writes_what_the_producer_writes(tmp_path, fmt, knobs, layout, case):
    producer = Checkpoint(CORPUS / case)
    generated = generated_like(producer, fmt, knobs, layout, tmp_path / "generated")
    assert differences(generated, producer) == set(DELIBERATE.get(fmt, {}))
