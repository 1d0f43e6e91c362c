"""The engine: compressed-tensors' own decompression.

As the harness's compressed-tensors engine runs it: a module tree, `apply_quantization_config`,
`ModelCompressor.compress_model`, the checkpoint's tensors loaded unmodified, `decompress_model`,
then each Linear's forward. The tree is the decoder's Linears in plain torch, or, where the
checkpoint has parts only a whole model holds (KV-cache scales on its attention, a head tied to
its embeddings), transformers' model built from config.json (compressed-tensors requires
transformers and hooks its KV cache into it)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from harness.lanes.upstream.parts.checkpoint import tensor_layout
from harness.lanes.upstream.parts.common import MODEL_DTYPE, PROMPT
from harness.lanes.upstream.parts.modules import held_weights
from harness.lanes.upstream.parts.parameters import JUDGE_ACTIVATIONS, LAYOUT, SEED

# ---- reproduce.py ----

ENGINE_PACKAGE, ENGINE_DISTRIBUTIONS = "compressed_tensors", ("compressed-tensors",)
ENGINE_LOGGERS = ("compressed_tensors",)


def linear_tree(config) -> torch.nn.Module:
    """The decoder's Linears under their checkpoint names, in the model dtype."""
    root = torch.nn.Module()
    layout = tensor_layout()
    for name, (shape, role) in layout.items():
        if role != "linear":
            continue
        *path, leaf = name.removesuffix(".weight").split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        bias = name.removesuffix("weight") + "bias" in layout
        parent.add_module(leaf, torch.nn.Linear(shape[1], shape[0], bias=bias, dtype=MODEL_DTYPE))
    return root


def whole_model(directory) -> torch.nn.Module:
    """transformers' model class from config.json, unquantized, in the model dtype: the tree
    compressed-tensors attaches its KV cache and a tied head to."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    del config.quantization_config
    return AutoModelForCausalLM.from_config(config, dtype=MODEL_DTYPE)


def needs_whole_model(config) -> bool:
    """KV scales and a tied head live on the whole model; activations are judged in the shapes
    its forward gives each Linear."""
    tied_head = LAYOUT["quantize_lm_head"] and bool(config.get("tie_word_embeddings"))
    return LAYOUT["kv_scales"] != "none" or tied_head or JUDGE_ACTIVATIONS


def load_model(directory):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    config = json.loads((Path(directory) / "config.json").read_text())
    quantization_config = QuantizationConfig.model_validate(config["quantization_config"])
    model = (whole_model(directory) if needs_whole_model(config) else linear_tree(config)).eval()
    apply_quantization_config(model, quantization_config)
    compressor = ModelCompressor(quantization_config=quantization_config)
    compressor.compress_model(model)
    state = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        state |= load_file(str(file))
    prefix = LAYOUT["key_prefix"]
    state = {"model." + k.removeprefix(prefix) if k.startswith(prefix) else k: v for k, v in state.items()}
    modules = {name for name, _ in model.named_modules()}
    result = model.load_state_dict({k: v for k, v in state.items() if k.rpartition(".")[0] in modules}, strict=False)
    compressor.decompress_model(model)
    return model, result


def check_loaded(loaded, expected):
    """(held weights, problems, notes): each Linear's forward on a random input (`expected` is
    judged by main)."""
    model, result = loaded
    notes = [f"load_state_dict: missing {result.missing_keys[:4]}"] if result.missing_keys else []
    notes += [f"load_state_dict: unexpected {result.unexpected_keys[:4]}"] if result.unexpected_keys else []
    # a scale that never arrived leaves its module at the initial value; one left over was dropped
    dropped = [key for key in (*result.missing_keys, *result.unexpected_keys) if "scale" in key.rpartition(".")[2]]
    problems = [f"scale tensor never loaded into its module: {key}" for key in dropped[:8]]
    failures, nonfinite = {}, []
    if hasattr(model, "config"):  # transformers' whole model: its own forward first
        try:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([PROMPT])).logits
            if not torch.isfinite(logits).all():
                nonfinite.append("the model")
        except Exception as error:
            failures.setdefault(f"{type(error).__name__}: {str(error)[:300]}", []).append("the model")
    generator = torch.Generator().manual_seed(SEED)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        inputs = torch.randn(1, len(PROMPT), module.in_features, generator=generator).to(MODEL_DTYPE)
        try:
            with torch.no_grad():
                output = module(inputs)
            if not torch.isfinite(output).all():
                nonfinite.append(name)
        except Exception as error:
            failures.setdefault(f"{type(error).__name__}: {str(error)[:300]}", []).append(name)
    problems += [f"the forward pass of {', '.join(names)} fails: {error}" for error, names in failures.items()]
    problems += [f"the forward pass of {', '.join(nonfinite)} yields non-finite outputs"] if nonfinite else []
    return held_weights(model), problems, notes
