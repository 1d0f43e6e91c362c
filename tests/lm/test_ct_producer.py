"""compressed-tensors as a producer of whole checkpoints: a tiny bf16 Qwen2 quantized by ct itself
is read by the reference, bit for bit what the harness's own quantizers write, and loads in
transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from harness.checkpoints.architectures import ARCHITECTURES
from harness.core.errors import HarnessError
from harness.formats import get_format
from harness.lm.ct_producer import SUPPORTED_FORMATS, produce_with_compressed_tensors

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

#: multiples of 16 (NVFP4 groups) and of 128 (ct's FP8_BLOCK forward needs whole input blocks);
#: k/v have 64 rows, so the default 128x128 block grid has a partial edge block
SETTINGS = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "head_dim": 32}
CASES = [
    ("ct-fp8-tensor", {"input_scale": True}),  # ct's FP8 preset: static per-tensor input scale
    ("ct-fp8-tensor", {"input_scale": True, "scale_dtype": "float32"}),
    ("ct-fp8-channel", {}),  # FP8_DYNAMIC
    ("ct-fp8-block", {}),  # FP8_BLOCK, 128x128
    ("ct-nvfp4", {}),  # W4A4: input_global_scale from the observed activations
    ("ct-nvfp4a16", {}),
]
PROMPT = list(range(20, 40))  # >= 16 tokens: torch's CPU SDPA hides NaN keys in shorter sequences


def as_bits(tensor):
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random bf16 Qwen2 with non-zero q/k/v biases, and the max |input| of each Linear on a prompt."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.checkpoints.tokenizer import write_tokenizer

    arch = ARCHITECTURES["qwen2"]
    raw = arch.config_json(arch.settings(SETTINGS), "bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), dtype=torch.bfloat16)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("_proj.bias"):
                parameter.normal_(0.0, 0.5)
    directory = tmp_path_factory.mktemp("ct-producer") / "bf16"
    model.save_pretrained(directory)
    write_tokenizer(directory, raw["vocab_size"])

    amax, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def record(module, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().amax()))

            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        model(input_ids=torch.tensor([PROMPT]))
    for hook in hooks:
        hook.remove()
    return directory, load_file(directory / "model.safetensors"), amax


@pytest.mark.parametrize(
    "fmt_name,knobs",
    CASES,
    ids=lambda c: c if isinstance(c, str) else "-".join(f"{k}={v}" for k, v in c.items()) or "default",
)
def test_ct_checkpoint_is_what_the_harness_writes_and_loads(source, fmt_name, knobs, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from harness.oracle.reference import dequantize_checkpoint

    model_dir, originals, activation_amax = source
    out = tmp_path / fmt_name
    produce_with_compressed_tensors(model_dir, fmt_name, out, activation_amax, knobs)
    fmt = get_format(fmt_name)
    resolved = fmt.resolve_knobs(knobs)

    written = json.loads((out / "config.json").read_text())["quantization_config"]
    fragment = fmt.quantization_config(resolved, ["lm_head"])
    assert {key: written.get(key) for key in fragment} == fragment
    # the harness's NVFP4 fragment leaves out two keys ct writes: its version and a null
    assert set(written) - set(fragment) <= {"version", "moe_sparsity_config"}
    assert written.get("moe_sparsity_config") is None
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}

    # (a) the reference reads it; (b) every tensor is bit for bit what the harness's quantizer
    # writes for the same bf16 weight and activation amax (the format tests established bit
    # equality for these dtypes), and the reference's weights are the quantizer's exact truth
    dequantized = dict(dequantize_checkpoint(out))
    stored = load_file(out / "model.safetensors")
    assert set(dequantized) == set(originals)
    modules = 0
    for name, original in originals.items():
        module = name.removesuffix(".weight")
        if not (name.endswith("_proj.weight") and f"{module}.{fmt.marker}" in stored):
            assert torch.equal(dequantized[name], original.to(torch.float64)), name
            continue
        modules += 1
        ours = fmt.quantize(original, resolved, model_dtype=torch.bfloat16, activation_amax=activation_amax[module])
        theirs = {
            suffix: tensor
            for key, tensor in stored.items()
            for prefix, _, suffix in [key.rpartition(".")]
            if prefix == module and suffix != "bias"
        }
        assert sorted(theirs) == sorted(ours.tensors), module
        for suffix, tensor in ours.tensors.items():
            assert (tensor.dtype, tensor.shape) == (theirs[suffix].dtype, theirs[suffix].shape), f"{module}.{suffix}"
            assert torch.equal(as_bits(tensor), as_bits(theirs[suffix])), f"{module}.{suffix}"
        assert torch.equal(dequantized[name], ours.truth), name
    assert modules == 7 * SETTINGS["num_hidden_layers"]

    # (c) transformers loads it without missing or unexpected keys and computes finite logits
    model, info = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits
    assert logits.shape == (1, len(PROMPT), 260) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "fmt_name,knobs,message",
    [
        ("modelopt-nvfp4", {}, "cannot produce"),
        ("fp8-block", {}, "cannot produce"),
        ("ct-fp8-block", {"scale_layout": "transposed"}, "perturbation"),
        ("ct-nvfp4", {"global_scale_convention": "swapped"}, "perturbation"),
        ("ct-fp8-tensor", {"no_such_knob": 1}, "bad knob"),
        ("ct-fp8-tensor", {}, "no config.json"),
    ],
)
def test_refuses_what_ct_does_not_produce(fmt_name, knobs, message, tmp_path):
    with pytest.raises(HarnessError, match=message):
        produce_with_compressed_tensors(tmp_path / "missing", fmt_name, tmp_path / "out", {}, knobs)
    assert not (tmp_path / "out").exists()


def test_static_input_scales_need_every_amax(source, tmp_path):
    model_dir, _, activation_amax = source
    partial = {name: value for name, value in activation_amax.items() if "layers.1.mlp" not in name}
    with pytest.raises(HarnessError, match="no entry for model.layers.1.mlp"):
        produce_with_compressed_tensors(model_dir, "ct-nvfp4", tmp_path / "out", partial)


def test_supported_formats_are_registered_and_importing_loads_no_engine():
    assert all(get_format(name).name == name for name in SUPPORTED_FORMATS)
    code = (
        "import sys, harness.lm.ct_producer;"
        "print(sorted(m for m in ('compressed_tensors', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
