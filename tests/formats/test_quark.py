"""AMD Quark's own configs (harness/formats/quark.py, quark_nvfp4.py), on what amd-quark 0.13 wrote
(cases/producers/quark): FP8 per tensor and per channel read as compressed-tensors' FP8 with Quark's
scale shapes, NVFP4 as ModelOpt's tensors under Quark's names, everything else unsupported in words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.core.errors import HarnessError, UnsupportedFormat
from harness.formats import detect_format, equivalents, get_format
from harness.formats.base import FormatError
from harness.formats.modelopt_nvfp4 import WEIGHT_ONLY

CORPUS = Path(__file__).resolve().parents[2] / "cases" / "producers" / "quark"


def quantization_config(case: str) -> dict:
    return json.loads((CORPUS / case / "config.json").read_text())["quantization_config"]


def module_tensors(case: str, module: str) -> dict[str, torch.Tensor]:
    stored = load_file(CORPUS / case / "model.safetensors")
    return {name.rpartition(".")[2]: t for name, t in stored.items() if name.rpartition(".")[0] == module}


@pytest.mark.parametrize(
    ("case", "format_name", "reading_knob"),
    [("fp8", "ct-fp8-tensor", equivalents.SCALAR_SCALES), ("ptpc_fp8", "ct-fp8-channel", equivalents.ROW_SCALES_1D)],
)
def test_quarks_fp8_is_compressed_tensors_fp8_with_its_scale_shapes(case, format_name, reading_knob):
    config = quantization_config(case)
    fmt = detect_format(config)
    knobs = fmt.knobs_from_config(config)
    assert (fmt.name, knobs[reading_knob]) == (format_name, True)
    assert equivalents.read_as(config)["ignore"] == config["exclude"] == ["lm_head"]
    tensors = module_tensors(case, "model.layers.0.self_attn.k_proj")
    weight = fmt.dequantize(tensors, knobs)
    assert weight.shape == tensors["weight"].shape and torch.isfinite(weight).all()


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("fp8_kv", "per-layer overrides"),
        ("int8", "weight int8 per_tensor static, input int8 per_tensor static"),
    ],
)
def test_what_quark_writes_beyond_the_definitions_is_unsupported_in_its_words(case, said):
    config = quantization_config(case)
    if case == "int8":  # its asymmetric variant (zero points that are not 0) is not defined here
        config["global_quant_config"]["weight"]["symmetric"] = False
    else:  # a per-layer override that is not the KV cache's
        config["layer_quant_config"]["*o_proj"] = config["global_quant_config"]
    with pytest.raises(UnsupportedFormat, match=said):
        detect_format(config)


def test_quarks_fp8_kv_cache_is_read_and_quantized_at_k_proj_and_v_proj_outputs():
    """Quark's FP8 KV cache: compressed-tensors' kv_cache_scheme beside the FP8 config, its scales
    `k_proj.output_scale` / `v_proj.output_scale`, quantizing those projections' outputs (before the
    rotary embedding, `kv_cache_post_rope: false`); other KV declarations unsupported in words."""
    from harness.checkpoints.reader import Checkpoint
    from harness.oracle.activations import quantize_activations
    from harness.oracle.kv_cache import STATIC_FP8, declares_fp8_kv_cache, install, quantized_at
    from harness.oracle.specified import plan

    config = quantization_config("fp8_kv")
    assert detect_format(config).name == "ct-fp8-tensor" and declares_fp8_kv_cache(config)
    assert quantized_at(config) == "projection" and equivalents.read_as(config)["kv_cache_scheme"]["type"] == "float"
    specified = plan(Checkpoint(CORPUS / "fp8_kv"))
    attention = "model.layers.1.self_attn"
    stored = module_tensors("fp8_kv", f"{attention}.v_proj")["output_scale"]
    assert specified.kv_at == "projection" and torch.equal(specified.kv[attention][1], stored)
    assert f"{attention}.k_proj" in specified.quantized_outputs() and len(specified.quantized_outputs()) == 4

    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.k_proj, model.attn.v_proj = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    plain = model.attn.k_proj(x)
    scales = (torch.tensor(0.01), torch.tensor(0.02))
    handles = install(model, {"attn": scales}, at="projection")
    assert torch.equal(model.attn.k_proj(x), quantize_activations(plain, STATIC_FP8, scales[0]))
    assert not torch.equal(model.attn.k_proj(x), plain)
    for handle in handles:
        handle.remove()
    assert torch.equal(model.attn.k_proj(x), plain)
    with pytest.raises(HarnessError, match="has no k_proj"):
        install(model, {"": scales}, at="projection")

    repeated_once = {key: value for key, value in config.items() if key != "kv_cache_quant_config"}
    assert declares_fp8_kv_cache(repeated_once)  # its overrides in layer_quant_config alone, as vLLM reads them
    assert equivalents.read_as(repeated_once) == equivalents.read_as(config)
    after_rope = dict(config, kv_cache_post_rope=True)
    with pytest.raises(UnsupportedFormat, match="after the rotary embedding"):
        declares_fp8_kv_cache(after_rope)
    int8_cache = json.loads(json.dumps(config))
    for entry in (*int8_cache["kv_cache_quant_config"].values(), *int8_cache["layer_quant_config"].values()):
        entry["output_tensors"]["dtype"] = "int8"
    with pytest.raises(UnsupportedFormat, match="other than static FP8 per tensor"):
        detect_format(int8_cache)


def test_quarks_int8_is_codes_times_its_0d_scale_as_quark_itself_reads_them():
    """Quark's int8 per tensor: code * weight_scale, equal to amd-quark's own reading of the file (its
    QParamsLinear's `_get_qweight`, producer_truth) bit for bit; its zero points must be 0."""
    from harness.formats.quark_int8 import INPUT_SCALE

    config = quantization_config("int8")
    fmt = detect_format(config)
    knobs = fmt.knobs_from_config(config)
    assert (fmt.name, knobs) == ("quark-int8", {INPUT_SCALE: True, equivalents.SCALAR_SCALES: True})
    truth = load_file(CORPUS / "int8" / "producer_truth" / "weights.safetensors")
    module = "model.layers.0.mlp.down_proj"
    tensors = module_tensors("int8", module)
    assert set(tensors) == set(fmt.suffixes)
    weight = fmt.dequantize(tensors, knobs)
    assert torch.equal(weight.to(truth[f"{module}.weight"].dtype), truth[f"{module}.weight"])
    for zero_point in ("weight_zero_point", "input_zero_point"):
        with pytest.raises(FormatError, match=f"{zero_point} is 3"):
            fmt.dequantize({**tensors, zero_point: torch.tensor(3, dtype=torch.int8)}, knobs)
    with pytest.raises(FormatError, match="input_scale has shape \\[1\\], expected \\[\\]"):
        fmt.dequantize({**tensors, "input_scale": tensors["input_scale"].reshape(1)}, knobs)
    # an engine holds its scales as parameters of its own ([1]) and may drop the zero points it folds
    held = {name: t.reshape(1) if t.dim() == 0 else t for name, t in tensors.items() if "zero_point" not in name}
    assert torch.equal(fmt.dequantize_held(held, knobs), weight)


def test_quarks_int8_inputs_are_static_per_tensor_with_its_stored_scale():
    """x -> clamp(round(x / s), -128, 127) * s with the module's `input_scale` s, the same rule as
    Quark's observer and fake quantization (round half to even)."""
    from harness.oracle.activations import quantize_activations, scheme_of
    from harness.oracle.probe_inputs import INT8_CLAMPED, probe_input

    scheme = scheme_of(quantization_config("int8"))
    assert (scheme.kind, scheme.strategy, scheme.dynamic, scheme.static) == ("int8", "tensor", False, "input_scale")
    scale = torch.tensor(0.5, dtype=torch.float32)
    x = torch.tensor([[0.25, 0.75, -0.25, 63.0, 64.0, -100.0, 0.0]], dtype=torch.float64)
    expected = torch.tensor([[0.0, 1.0, -0.0, 63.0, 63.5, -64.0, 0.0]], dtype=torch.float64)
    assert torch.equal(quantize_activations(x, scheme, scale), expected)
    rows = probe_input(scheme, scale, 96, 4, torch.bfloat16, seed=0)
    codes = rows.double().abs() / 0.5  # each k + 1/4, away from any tie, and one per row past the range
    clamped = codes == INT8_CLAMPED
    assert (clamped.sum(dim=1) == 1).all() and torch.equal((codes - 0.25)[~clamped].round(), (codes - 0.25)[~clamped])
    quantized = quantize_activations(rows, scheme, scale).double() / 0.5
    assert set(quantized[clamped].tolist()) <= {127.0, -128.0} and torch.equal(quantized, quantized.round())


def test_a_0d_per_tensor_scale_is_quarks_and_an_engines_held_scale_is_its_own():
    """Read from Quark's file, a per-tensor scale is 0-D; [1] there is refused. An engine holds it as its
    own parameter ([1] per part in vLLM), read as it is."""
    fmt = get_format("ct-fp8-tensor")
    config = quantization_config("fp8")
    knobs = fmt.knobs_from_config(config)
    tensors = module_tensors("fp8", "model.layers.0.self_attn.k_proj")
    as_stored = fmt.dequantize(tensors, knobs)
    one_d = {name: t.reshape(1) if name.endswith("_scale") else t for name, t in tensors.items()}
    with pytest.raises(FormatError, match="expected \\[\\]"):
        fmt.dequantize(one_d, knobs)
    assert torch.equal(fmt.dequantize_held(one_d, knobs), as_stored)


def test_quarks_nvfp4_is_modelopts_tensors_under_quarks_names():
    config = quantization_config("nvfp4")
    fmt = detect_format(config)
    knobs = fmt.knobs_from_config(config)
    assert fmt.name == "quark-nvfp4" and not knobs.get(WEIGHT_ONLY)
    tensors = module_tensors("nvfp4", "model.layers.0.mlp.down_proj")
    assert set(tensors) == set(fmt.suffixes)
    modelopt = get_format("modelopt-nvfp4")
    renamed = {("input_scale" if name == "input_scale_2" else name): t for name, t in tensors.items()}
    assert torch.equal(
        fmt.dequantize(tensors, knobs), modelopt.dequantize(renamed, {"global_scale_convention": "multiplier"})
    )
    without_input = {name: t for name, t in tensors.items() if name != "input_scale_2"}
    with pytest.raises(FormatError, match="input_scale_2"):
        fmt.dequantize(without_input, knobs)


def test_quarks_weight_only_nvfp4_reads_without_an_input_scale():
    config = quantization_config("nvfp4")
    config["global_quant_config"]["input_tensors"] = None  # what its weight-only NVFP4 writes
    fmt = detect_format(config)
    knobs = fmt.knobs_from_config(config)
    assert fmt.name == "quark-nvfp4" and knobs[WEIGHT_ONLY]
    tensors = module_tensors("nvfp4", "model.layers.0.mlp.down_proj")
    tensors.pop("input_scale_2")
    assert torch.isfinite(fmt.dequantize(tensors, knobs)).all()


def test_quarks_nvfp4_is_read_not_generated():
    from harness.formats import require_formats

    with pytest.raises(Exception, match="read, not written"):
        require_formats("quark-nvfp4")


@pytest.mark.parametrize(("case", "signed"), [("uint4_wo_128", False), ("int4_wo_128", True)])
def test_quarks_int4_is_awqs_packing_under_quarks_names(case, signed):
    """uint4: (q - z) * scale as AWQ reads the same words; int4: signed nibbles, zero points 0."""
    from harness.formats.quark_int4 import AWQ_NAMES, SIGNED

    config = quantization_config(case)
    fmt = detect_format(config)
    knobs = fmt.knobs_from_config(config)
    assert (fmt.name, knobs) == ("quark-int4", {"group_size": 128, SIGNED: signed})
    tensors = module_tensors(case, "model.layers.0.mlp.down_proj")
    awq = {AWQ_NAMES[name]: t for name, t in tensors.items()}
    as_awq = get_format("awq").dequantize(awq, {"group_size": 128})
    weight = fmt.dequantize(tensors, knobs)
    if signed:  # the same words read as signed nibbles: 16 scale-steps lower where the top bit is set
        steps = (as_awq - weight) / get_format("awq").affine_parts(awq, {"group_size": 128})[2]
        assert set(steps.round().unique().tolist()) <= {0.0, 16.0} and (steps.round() == 16).any()
        with pytest.raises(FormatError, match="weight_zero_point"):
            fmt.dequantize({**tensors, "weight_zero_point": torch.ones_like(tensors["weight_zero_point"])}, knobs)
    else:
        assert torch.equal(weight, as_awq)
    with pytest.raises(FormatError, match="weight_scale"):  # said under the file's names, not AWQ's
        fmt.dequantize({**tensors, "weight_scale": tensors["weight_scale"][:1]}, knobs)


@pytest.mark.parametrize(("case", "signed"), [("uint4_wo_per_channel", False), ("int4_wo_per_channel", True)])
def test_quarks_per_channel_int4_is_packed_along_the_inputs(case, signed):
    """Per output row: `weight` [N, K/8] packed along the inputs in AWQ's order, `weight_scale` [N],
    `weight_zero_point` [N/8] packed along the rows; equal to Quark's own reading (producer_truth), and
    the audit's model of a module decodes to its own truth."""
    from harness.formats.quark_int4 import SIGNED

    config = quantization_config(case)
    fmt = detect_format(config)
    knobs = fmt.knobs_from_config(config)
    assert (fmt.name, knobs) == ("quark-int4-channel", {SIGNED: signed})
    module = "model.layers.0.mlp.down_proj"
    tensors = module_tensors(case, module)
    truth = load_file(CORPUS / case / "producer_truth" / "weights.safetensors")[f"{module}.weight"]
    weight = fmt.dequantize(tensors, knobs)
    assert weight.shape == (128, 256) and torch.equal(weight.to(truth.dtype), truth)
    zeros = fmt.unpack_rows("weight_zero_point", tensors["weight_zero_point"], 128, knobs)
    assert zeros.shape == (128, 1) and bool((zeros == 0).all()) is signed
    if signed:
        with pytest.raises(FormatError, match="weight_zero_point"):
            fmt.dequantize({**tensors, "weight_zero_point": torch.ones_like(tensors["weight_zero_point"])}, knobs)
    with pytest.raises(FormatError, match="weight_scale has shape"):
        fmt.dequantize({**tensors, "weight_scale": tensors["weight_scale"][:64]}, knobs)
    modelled = fmt.quantize(truth.float() * 1.3, knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    assert {name: t.shape for name, t in modelled.tensors.items()} == {name: t.shape for name, t in tensors.items()}
    assert torch.equal(fmt.dequantize(modelled.tensors, knobs), modelled.truth)


def test_quarks_nvfp4_inputs_are_modelopts_with_quarks_scale_name_and_its_exclude_list_is_read():
    from harness.oracle.activations import declared_ignored, scheme_of

    config = quantization_config("nvfp4")
    scheme = scheme_of(config)
    assert (scheme.kind, scheme.group_size, scheme.static, scheme.multiplier) == ("nvfp4", 16, "input_scale_2", True)
    assert declared_ignored(config, "lm_head") and not declared_ignored(config, "model.layers.0.mlp.up_proj")
    config["global_quant_config"]["input_tensors"] = None
    assert scheme_of(config) is None


def test_quarks_mxfp4_is_compressed_tensors_mxfp4_under_quarks_names():
    config = quantization_config("mxfp4")
    fmt = detect_format(config)
    assert fmt.name == "quark-mxfp4"
    tensors = module_tensors("mxfp4", "model.layers.0.mlp.down_proj")
    assert set(tensors) == set(fmt.suffixes) - {"input_scale"}  # its inputs are dynamic
    renamed = {("weight_packed" if name == "weight" else name): t for name, t in tensors.items()}
    assert torch.equal(fmt.dequantize(tensors, {}), get_format("ct-mxfp4").dequantize(renamed, {}))
    with pytest.raises(FormatError, match="weight has 1 dimensions"):  # said under the file's names
        fmt.dequantize({**tensors, "weight": tensors["weight"].flatten()}, {})


def test_quarks_mxfp4_with_fp8_inputs_reads_their_0d_static_scale():
    """`mxfp4_fp8`: quark/mxfp4's weights, static FP8 inputs per tensor (a 0-D bfloat16 `input_scale`, [1]
    where an engine holds it); `mxfp4_weight_only`: the weights alone."""
    from harness.formats.quark_mxfp4 import FP8_INPUTS
    from harness.oracle.activations import scheme_of

    config = quantization_config("mxfp4_fp8")
    fmt = detect_format(config)
    knobs = fmt.knobs_from_config(config)
    assert (fmt.name, knobs) == ("quark-mxfp4", {FP8_INPUTS: True, equivalents.SCALAR_SCALES: True})
    scheme = scheme_of(config)
    assert (scheme.kind, scheme.strategy, scheme.static) == ("fp8", "tensor", "input_scale")
    tensors = module_tensors("mxfp4_fp8", "model.layers.0.mlp.down_proj")
    weight = fmt.dequantize(tensors, knobs)
    with pytest.raises(FormatError, match="input_scale has shape \\[1\\], expected \\[\\]"):
        fmt.dequantize({**tensors, "input_scale": tensors["input_scale"].reshape(1)}, knobs)
    assert torch.equal(
        fmt.dequantize_held({**tensors, "input_scale": tensors["input_scale"].reshape(1)}, knobs), weight
    )
    with pytest.raises(FormatError, match="missing tensor 'input_scale'"):
        fmt.dequantize({name: t for name, t in tensors.items() if name != "input_scale"}, knobs)
    weight_only = quantization_config("mxfp4_weight_only")
    assert detect_format(weight_only).knobs_from_config(weight_only) == {} and scheme_of(weight_only) is None


@pytest.mark.nightly
def test_the_even_mxfp4_activation_rule_is_quarks_own():
    """Quark's MXFP4 inputs (`scale_calculation_mode: even`): the activation definition against amd-quark's
    own MX fake quantization of the same tensor (`fake_quantize_mx`), element for element (skipped
    without amd-quark). Nightly: importing quark.torch takes about 25 s here; in CI the corpus case
    quark/mxfp4 checks the same through transformers' forward (its activation probe, 14/14 as specified)."""
    pytest.importorskip("quark")
    from quark.torch.kernel.hw_emulation.hw_emulation_interface import fake_quantize_mx

    from harness.oracle.activations import quantize_activations, scheme_of

    scheme = scheme_of(quantization_config("mxfp4"))
    assert (scheme.kind, scheme.exponent, scheme.group_size) == ("mxfp4", "even", 32)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=generator) * torch.logspace(-3, 2, 256)
    x[0, :32] = 0  # a group of zeros stays zero
    x[1, 32:64] *= 1.75 / x[1, 32:64].abs().max()  # an amax at the rounding boundary
    x[2, 64:96] *= 1.74 / x[2, 64:96].abs().max()  # just below it
    theirs = fake_quantize_mx(x, axis=-1, block_size=32, scale_calculation_mode="even", mx_element_dtype="fp4")
    assert torch.equal(quantize_activations(x, scheme), theirs)


@pytest.mark.nightly
def test_the_static_int8_activation_rule_is_quarks_own():
    """Quark's int8 inputs: the activation definition against amd-quark's own `fake_quantize_int` per
    tensor (round half to even, [-128, 127]) on the same tensor, element for element, in float32 and
    bfloat16, ties and values past the range included (skipped without amd-quark; nightly, as above)."""
    pytest.importorskip("quark")
    from quark.torch.kernel.hw_emulation.hw_emulation_interface import fake_quantize_int
    from quark.torch.quantization.config.type import RoundType

    from harness.oracle.activations import quantize_activations, scheme_of

    scheme = scheme_of(quantization_config("int8"))
    generator = torch.Generator().manual_seed(0)
    scale = torch.tensor(0.0123, dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(4, 256, generator=generator) * 3).to(dtype)
        x[0, :4] = (torch.tensor([0.5, 1.5, 2.5, -0.5]) * scale).to(dtype)  # ties, as near as the dtype holds
        x[1, :2] = (torch.tensor([500.0, -500.0]) * scale).to(dtype)  # past the range: clamped
        theirs = fake_quantize_int(
            x,
            scale,
            torch.tensor(0, dtype=torch.int32),
            quant_min=-128,
            quant_max=127,
            round_mode=RoundType.half_even.value,
            qscheme="per_tensor",
        )
        assert torch.equal(quantize_activations(x, scheme, scale), theirs)


@pytest.mark.parametrize("case", ["qwen3_moe_fp8", "mixtral_mxfp4"])
def test_experts_saved_fused_under_transformers_in_memory_names_are_said_unsupported(case):
    """Quark 0.13 on transformers 5 saves a mixture's experts as transformers holds them (one 3-D tensor
    per projection): the reference and audit say so and stop, rather than report their own weights missing."""
    from harness.core.errors import Unsupported
    from harness.oracle.audit import audit_checkpoint
    from harness.oracle.reference import format_and_knobs

    for read in (format_and_knobs, audit_checkpoint):
        with pytest.raises(Unsupported, match="stored fused under transformers 5's in-memory names"):
            read(CORPUS / case)


def test_gpt_oss_packed_experts_are_its_own_layout_not_fused_in_memory_names(tmp_path):
    """gpt-oss's release packs each projection's experts in one tensor (`mlp.experts.gate_up_proj_blocks`,
    and unquantized `mlp.experts.gate_up_proj`): its own layout, read; not a fused in-memory export."""
    from safetensors import safe_open

    from harness.checkpoints.model_layout import fused_experts
    from harness.checkpoints.reader import Checkpoint
    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import generate

    generate(Recipe(format="mxfp4", arch="gpt_oss", seed=0), tmp_path / "gpt-oss")
    config = Checkpoint(tmp_path / "gpt-oss").config
    stored = [name for path in (tmp_path / "gpt-oss").glob("*.safetensors") for name in safe_open(path, "pt").keys()]
    unquantized = [name.removesuffix("_blocks") for name in stored if name.endswith("_blocks")]
    assert unquantized and all(".mlp.experts." in name for name in unquantized)
    assert fused_experts(config, stored) is None and fused_experts(config, unquantized) is None
