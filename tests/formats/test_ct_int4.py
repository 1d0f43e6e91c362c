"""ct-int4 and ct-int8 (symmetric and with zero points) against compressed-tensors' own
calculate_qparams, pack helpers and ModelCompressor; our reference against the quantizer's own
truth; refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.formats import detect_format, get_format
from harness.formats.base import FormatError
from harness.formats.ct_int4 import FORMAT, INT8, pack_codes, pack_int4, unpack_codes, unpack_int4

# K a multiple of every group size, of 32 only, and smaller than one group
SHAPES = [(37, 256), (9, 96), (1, 32)]
GROUPS = [32, 64, 128]


def make_weight(shape, seed=0, dtype=torch.bfloat16):
    """Weights with a wide spread of magnitudes, one all-zero row and one all-zero group."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)
    weight[0] = 0
    weight[-1, :32] = 0
    return weight.to(dtype)


def ct_reference(weight, knobs, fmt=FORMAT):
    """Calibrate with ct's calculate_qparams per group (llm-compressor's min-max observer), then
    compress and decompress with ModelCompressor (PackedQuantizationCompressor)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    config = QuantizationConfig.model_validate(fmt.quantization_config(knobs, []))
    model = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    apply_quantization_config(model, config)
    module = model[0]
    grouped = weight.reshape(weight.shape[0], -1, knobs["group_size"])
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), module.quantization_scheme.weights)
    with torch.no_grad():
        module.weight_scale.copy_(scale)
        if hasattr(module, "weight_zero_point"):  # a symmetric scheme may not allocate one
            module.weight_zero_point.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressed = {k: v.clone() for k, v in module.state_dict().items()}
    compressor.decompress_model(model)
    return compressed, module.weight.detach().clone()


CASES = [
    pytest.param(shape, group, id=f"{shape[0]}x{shape[1]}-g{group}")
    for shape in SHAPES
    for group in GROUPS
    if shape[1] % group == 0
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,group", CASES)
@pytest.mark.parametrize(
    "fmt,symmetric",
    [(FORMAT, True), (FORMAT, False), (INT8, True), (INT8, False)],
    ids=["int4", "int4-asym", "int8", "int8-asym"],
)
def test_matches_compressed_tensors(shape, group, dtype, fmt, symmetric):
    knobs = fmt.resolve_knobs({"group_size": group, "symmetric": symmetric})
    weight = make_weight(shape, seed=sum(shape), dtype=dtype)
    ours = fmt.quantize(weight, knobs, model_dtype=dtype, activation_amax=1.0)
    compressed, decompressed = ct_reference(weight, knobs, fmt)
    expected = {"weight_packed", "weight_scale", "weight_shape"} | (set() if symmetric else {"weight_zero_point"})
    assert set(compressed) == set(ours.tensors) == expected
    for name, tensor in ours.tensors.items():
        assert tensor.dtype == compressed[name].dtype, name
        assert torch.equal(tensor, compressed[name]), name
    reference = fmt.dequantize(ours.tensors, fmt.knobs_from_config(fmt.quantization_config(knobs, [])))
    # ct multiplies code * scale in the scale (model) dtype: one rounding of the exact product
    assert decompressed.dtype == dtype
    assert torch.equal(reference.to(dtype), decompressed)
    assert torch.equal(reference, ours.truth)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 31, 129, 200])
def test_packing_is_compressed_tensors(cols, dim, bits):
    """Any extent, partial last word included, along columns (weights) or rows (zero points): our
    packer and unpacker agree with ct's helpers bit for bit."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1)
    codes = torch.randint(low, high, (5, cols), generator=torch.Generator().manual_seed(cols), dtype=torch.int8)
    codes[0, :8] = torch.tensor([low, high - 1, 0, -1, 1, low, high - 1, 3])[: min(cols, 8)].to(torch.int8)
    codes = codes.T.contiguous() if dim == 0 else codes
    packed = pack_codes(codes, bits, dim)
    assert torch.equal(packed, pack_to_int32(codes, bits, packed_dim=dim))
    assert torch.equal(unpack_codes(packed, bits, cols, dim), codes.to(torch.int64))
    assert torch.equal(unpack_from_int32(packed, bits, codes.shape, packed_dim=dim), codes)
    if bits == 4 and dim == 1:
        assert torch.equal(pack_int4(codes), packed) and torch.equal(unpack_int4(packed, cols), codes.to(torch.int64))


def test_nibble_order_and_offset_binary():
    """Column 8w + i in bits 4i of word w, stored as code + 8: codes 0..7 are nibbles 8..15."""
    codes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, -8]], dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.tolist() == [[int.from_bytes(bytes([0x98, 0xBA, 0xDC, 0xFE]), "little") - 2**32, 0]]


@pytest.mark.parametrize("group", GROUPS)
def test_partial_last_group_is_expressible_but_compressed_tensors_refuses(group):
    """K not a multiple of the group: the layout holds ceil(K/g) scales and our reference reads it;
    ct 0.20's quantize (and decompress) raise, so the module is exact-or-refuse."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

    knobs = FORMAT.resolve_knobs({"group_size": group})
    shape = (5, group + 17)
    weight = make_weight(shape, seed=group)
    ours = FORMAT.quantize(weight, knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    assert ours.tensors["weight_scale"].shape == (5, 2) and ours.tensors["weight_packed"].shape == (
        5,
        (group + 24) // 8,
    )
    assert ours.expectation == "exact-or-refuse" and "partial" in ours.notes[0]
    assert torch.equal(FORMAT.dequantize(ours.tensors, knobs), ours.truth)
    args = QuantizationArgs.model_validate(FORMAT.quantization_config(knobs, [])["config_groups"]["group_0"]["weights"])
    scale = ours.tensors["weight_scale"]
    with pytest.raises(ValueError, match="divisble|divisible"):
        quantize(weight, scale, torch.zeros_like(scale, dtype=torch.int8), args, dtype=torch.int8)
    with pytest.raises(ValueError, match="divisble|divisible"):
        dequantize(unpack_int4(ours.tensors["weight_packed"], shape[1]).to(torch.int8), scale, None, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 50), (1, 17), (130, 129), (3, 256)])
def test_dequantize_equals_truth(shape, dtype):
    for group in GROUPS:
        knobs = FORMAT.resolve_knobs({"group_size": group})
        ours = FORMAT.quantize(
            make_weight(shape, seed=1, dtype=torch.float32), knobs, model_dtype=dtype, activation_amax=1
        )
        assert ours.tensors["weight_scale"].dtype == dtype
        reference = FORMAT.dequantize(ours.tensors, knobs)
        assert reference.dtype == torch.float64 and reference.shape == shape
        assert torch.equal(reference, ours.truth)
        assert ours.expectation == ("exact" if shape[1] % group == 0 else "exact-or-refuse")


def test_all_zero_weight_and_subnormal_scale():
    """A zero group's scale is finfo(dtype).eps (ct's guard); a subnormal amax gives a subnormal scale."""
    knobs = FORMAT.resolve_knobs({})
    zero = FORMAT.quantize(torch.zeros(3, 128), knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    assert torch.all(zero.tensors["weight_scale"] == torch.finfo(torch.bfloat16).eps)
    assert torch.equal(FORMAT.dequantize(zero.tensors, knobs), torch.zeros(3, 128, dtype=torch.float64))
    weight = torch.zeros(2, 128)
    weight[0, 0] = FORMAT.subnormal_amax(knobs, 1.0)
    result = FORMAT.quantize(weight, knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    scale = result.tensors["weight_scale"][0, 0]
    assert 0 < scale.item() < torch.finfo(torch.bfloat16).tiny
    assert torch.equal(FORMAT.dequantize(result.tensors, knobs), result.truth)


@pytest.mark.parametrize(
    "preset,fmt,symmetric", [("W4A16", FORMAT, True), ("W4A16_ASYM", FORMAT, False), ("W8A16", INT8, True)]
)
def test_config_is_what_ct_writes(tmp_path, preset, fmt, symmetric):
    """The fragment equals ModelCompressor.update_config's output for ct's W4A16, W4A16_ASYM and W8A16 presets."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    model = torch.nn.ModuleDict(
        {
            "proj": torch.nn.Linear(256, 256, dtype=torch.bfloat16),
            "lm_head": torch.nn.Linear(256, 8, dtype=torch.bfloat16),
        }
    )
    apply_quantization_config(model, QuantizationConfig(config_groups={preset: ["Linear"]}, ignore=["lm_head"]))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressor.update_config(str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    config = fmt.quantization_config(fmt.resolve_knobs({"symmetric": symmetric}), ["lm_head"])
    assert config == written
    assert detect_format(config) is fmt
    assert fmt.knobs_from_config(config) == {"group_size": 128, "symmetric": symmetric}


def test_other_formats_not_matched_and_unsupported_configs_refused():
    config = FORMAT.quantization_config(FORMAT.resolve_knobs({"group_size": 32}), [])
    assert [name for name in ("ct-nvfp4a16", "ct-fp8-channel") if get_format(name).matches(config)] == []
    for change, message in [
        ({"symmetric": "no"}, "symmetric"),
        ({"strategy": "channel"}, "strategy"),
        ({"actorder": "group"}, "actorder"),
        ({"group_size": 0}, "group_size"),
    ]:
        bad = json.loads(json.dumps(config))
        bad["config_groups"]["group_0"]["weights"].update(change)
        with pytest.raises(FormatError, match=message):
            FORMAT.knobs_from_config(bad)
    int8 = json.loads(json.dumps(config))
    int8["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    assert not FORMAT.matches(int8) and detect_format(int8) is INT8


def test_malformed_tensors_raise():
    knobs = FORMAT.resolve_knobs({"group_size": 32})
    tensors = FORMAT.quantize(make_weight((6, 80)), knobs, model_dtype=torch.bfloat16, activation_amax=1.0).tensors
    nan_scale = tensors["weight_scale"].clone()
    nan_scale[0, 0] = math.nan
    malformed = [
        ({"weight_packed": tensors["weight_packed"].to(torch.int64)}, "weight_packed has dtype"),
        ({"weight_packed": tensors["weight_packed"][:, :-1]}, "weight_packed has shape"),
        ({"weight_scale": tensors["weight_scale"][:, :2]}, "weight_scale has shape"),
        ({"weight_scale": tensors["weight_scale"].to(torch.float8_e4m3fn)}, "weight_scale has dtype"),
        ({"weight_scale": nan_scale}, "non-finite"),
        ({"weight_shape": torch.tensor([6, 80, 1])}, "weight_shape"),
        ({"weight_shape": torch.tensor([6.0, 80.0])}, "weight_shape"),
        ({"weight_shape": torch.tensor([6, 81])}, "weight_packed has shape|weight_scale has shape"),
        ({"weight_shape": torch.tensor([6, -80])}, "positive"),
        ({"weight_zero_point": torch.zeros(1, 3, dtype=torch.int32)}, "symmetric"),
    ]
    asym = FORMAT.resolve_knobs({"group_size": 32, "symmetric": False})
    zeros = FORMAT.quantize(make_weight((6, 80)), asym, model_dtype=torch.bfloat16, activation_amax=1.0).tensors
    for change, message in [
        ({"weight_zero_point": zeros["weight_zero_point"].to(torch.int8)}, "weight_zero_point has dtype"),
        ({"weight_zero_point": zeros["weight_zero_point"].T.contiguous()}, "weight_zero_point has shape"),
        ({"weight_zero_point": zeros["weight_zero_point"][:, :2]}, "weight_zero_point has shape"),
    ]:
        with pytest.raises(FormatError, match=message):
            FORMAT.dequantize({**zeros, **change}, asym)
    with pytest.raises(FormatError, match="missing tensor 'weight_zero_point'"):
        FORMAT.dequantize({k: v for k, v in zeros.items() if k != "weight_zero_point"}, asym)
    for change, message in malformed:
        with pytest.raises(FormatError, match=message):
            FORMAT.dequantize({**tensors, **change}, knobs)
        error = None
        try:
            FORMAT.dequantize({**tensors, **change}, knobs)
        except FormatError as caught:
            error = str(caught)
        assert "\n" not in error
    for missing in ("weight_packed", "weight_scale", "weight_shape"):
        with pytest.raises(FormatError, match=f"missing tensor '{missing}'"):
            FORMAT.dequantize({k: v for k, v in tensors.items() if k != missing}, knobs)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("sizes,group", [((256, 384), 128), ((200, 333), 128), ((224, 416), 32)], ids=str)
def test_generated_checkpoint_dequantizes_to_truth(tmp_path, arch, sizes, group):
    """`gen` then `dequant`: every tensor equals the truth; a partial group makes the checkpoint exact-or-refuse."""
    from safetensors.torch import load_file

    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import TRUTH_FILE, generate
    from harness.oracle.reference import dequantize_checkpoint

    hidden, intermediate = sizes
    config = {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": 1, "head_dim": 32}
    manifest = generate(Recipe("ct-int4", arch, seed=2, config=config, knobs={"group_size": group}), tmp_path / "c")
    truth = load_file(str(tmp_path / "c" / TRUTH_FILE))
    got = dict(dequantize_checkpoint(tmp_path / "c"))
    assert set(got) == set(truth) and all(torch.equal(got[n], truth[n]) for n in truth)
    partial = any(module["shape"][1] % group for module in manifest["modules"].values())
    assert partial == bool(hidden % group or intermediate % group)
    assert manifest["expectation"] == ("exact-or-refuse" if partial else "exact")


@pytest.mark.parametrize("fmt", [FORMAT, INT8], ids=["int4", "int8"])
def test_asymmetric_zero_points_are_the_one_tensor_packed_across_rows(fmt):
    """The tensor-parallel lane slices every tensor by rows except those the format packs across rows
    (compressed-tensors' asymmetric zero points, 32/b a word along the rows); `unpack_rows` gives
    their values back one row per output row, so a slice that starts inside a word can be judged."""
    symmetric = fmt.resolve_knobs({"group_size": 32})
    asym = fmt.resolve_knobs({"group_size": 32, "symmetric": False})
    assert fmt.packed_across_rows(symmetric) == () and fmt.splits_by_rows(symmetric)
    assert fmt.packed_across_rows(asym) == ("weight_zero_point",) and not fmt.splits_by_rows(asym)
    zeros = fmt.quantize(make_weight((36, 64)), asym, model_dtype=torch.bfloat16, activation_amax=1.0).tensors
    rows = fmt.unpack_rows("weight_zero_point", zeros["weight_zero_point"], 36, asym)
    assert rows.shape == (36, 2) and torch.equal(pack_codes(rows, fmt.bits, dim=0), zeros["weight_zero_point"])
    with pytest.raises(FormatError, match="weight_zero_point has shape"):
        fmt.unpack_rows("weight_zero_point", zeros["weight_zero_point"][:-1], 36, asym)
    with pytest.raises(FormatError, match="not packed across rows"):
        fmt.unpack_rows("weight_scale", zeros["weight_scale"], 36, asym)
