"""ct-mxfp4 against compressed-tensors' own calculate_qparams (its MX scale generation) and its
MXFP4 compressor and decompressor; our reference against the quantizer's own truth; refusals."""

from __future__ import annotations

import json

import pytest
import torch

from harness.formats import detect_format, get_format
from harness.formats.base import FormatError
from harness.formats.ct_mxfp4 import FORMAT, ct_mx_scale, round_to_power_of_two

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: odd row counts, one group, several, and K smaller than nothing but a group
SHAPES = [(37, 96), (1, 32), (130, 160), (5, 256)]
KNOBS = FORMAT.resolve_knobs({})


def make_weight(shape, seed=0, dtype=torch.bfloat16):
    """Magnitudes spread over ~2**+-6, one all-zero row, one all-zero group, mantissas at the
    round-up threshold (1.75 * 2**E) and just below it, and a tiny negative that rounds to -0."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)
    if shape[0] > 2:
        weight[0] = 0
        weight[1, 0] = 1.75
        weight[2, 0] = -1.75 * (1 - 2**-7)
    weight[-1, :32] = 0
    if shape[1] > 33:
        weight[-1, 32] = -1.0
        weight[-1, 33] = -1e-4
    return weight.to(dtype)


def ct_reference(weight):
    """Calibrate with ct's calculate_qparams per group of 32 (llm-compressor's min-max observer),
    then compress and decompress with ModelCompressor (MXFP4PackedCompressor)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    config = QuantizationConfig.model_validate(FORMAT.quantization_config(KNOBS, []))
    model = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    apply_quantization_config(model, config)
    module = model[0]
    grouped = weight.reshape(weight.shape[0], -1, 32)
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), module.quantization_scheme.weights)
    with torch.no_grad():
        module.weight_scale.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    compressed = {k: v.clone() for k, v in module.state_dict().items()}
    compressor.decompress_model(model)
    return compressed, module.weight.detach().clone()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_compressed_tensors(shape, dtype):
    for seed in range(2):
        weight = make_weight(shape, seed=seed + sum(shape), dtype=dtype)
        ours = FORMAT.quantize(weight, KNOBS, model_dtype=dtype, activation_amax=1.0)
        compressed, decompressed = ct_reference(weight)
        assert set(compressed) == set(ours.tensors) == {"weight_packed", "weight_scale"}
        for name, tensor in ours.tensors.items():
            assert (tensor.dtype, tensor.shape) == (compressed[name].dtype, compressed[name].shape), name
            assert torch.equal(tensor, compressed[name]), name
        reference = FORMAT.dequantize(ours.tensors, FORMAT.knobs_from_config(FORMAT.quantization_config(KNOBS, [])))
        assert torch.equal(reference, ours.truth)
        # ct decompresses to bfloat16 whatever the model dtype (e2m1 x 2**k is exact there)
        assert decompressed.dtype == torch.bfloat16
        assert torch.equal(reference.to(torch.bfloat16), decompressed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_rounding_is_compressed_tensors(dtype):
    """Every amax class: zero, subnormal above and below 0.75 tiny, mantissas below and at 1.75,
    powers of two, the dtype's extremes: our power-of-two rounding and scale are ct's bit for bit."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.quant_scheme import MXFP4A16
    from compressed_tensors.quantization.utils import calculate_qparams
    from compressed_tensors.quantization.utils.mxfp_utils import round_to_power_2

    info = torch.finfo(dtype)
    values = [0.0, info.tiny * 0.5, info.tiny * 0.75, info.tiny * 0.9, info.tiny, 1.0, 1.5, 1.7, 1.75, 1.9, 6.0, 7.0]
    values += [2.0**-125, 1.5 * 2.0**-125, 1e-30, 1e-8, 3e-5, 123.4, 1000.0, info.max / 2]
    amax = torch.tensor(values, dtype=torch.float64).to(dtype)
    amax = torch.cat([amax, torch.rand(200, generator=torch.Generator().manual_seed(1)).to(dtype) * 20])
    assert torch.equal(round_to_power_of_two(amax), round_to_power_2(amax))
    args = QuantizationArgs.model_validate(MXFP4A16["weights"])
    theirs, _ = calculate_qparams(torch.zeros_like(amax), amax, args)
    assert theirs.dtype == dtype and torch.equal(ct_mx_scale(amax), theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 50), (1, 16), (130, 162), (3, 256)], ids=str)
def test_dequantize_equals_truth(shape, dtype):
    ours = FORMAT.quantize(make_weight(shape, seed=1, dtype=torch.float32), KNOBS, model_dtype=dtype, activation_amax=1)
    assert ours.tensors["weight_scale"].dtype == torch.uint8
    assert ours.tensors["weight_scale"].shape == (shape[0], -(-shape[1] // 32))
    reference = FORMAT.dequantize(ours.tensors, KNOBS)
    assert reference.dtype == torch.float64 and reference.shape == shape
    assert torch.equal(reference, ours.truth)
    assert ours.expectation == ("exact" if shape[1] % 32 == 0 else "exact-or-refuse")


def test_partial_last_group_is_expressible_but_compressed_tensors_refuses():
    """K even but not a multiple of 32: ceil(K/32) scales, read by our reference; ct 0.20's quantize
    and dequantize raise, so the module is exact-or-refuse. An odd K cannot be stored at all."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize

    weight = make_weight((5, 50), seed=3)
    ours = FORMAT.quantize(weight, KNOBS, model_dtype=torch.bfloat16, activation_amax=1.0)
    assert ours.tensors["weight_scale"].shape == (5, 2) and ours.tensors["weight_packed"].shape == (5, 25)
    assert ours.expectation == "exact-or-refuse" and "partial" in ours.notes[0]
    assert torch.equal(FORMAT.dequantize(ours.tensors, KNOBS), ours.truth)
    args = QuantizationArgs.model_validate(FORMAT.quantization_config(KNOBS, [])["config_groups"]["group_0"]["weights"])
    scale = torch.ones(5, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="divisble|divisible"):
        quantize(weight, scale, None, args)
    with pytest.raises(ValueError, match="divisble|divisible"):
        dequantize(weight, scale, None, args)
    with pytest.raises(FormatError, match="odd"):
        FORMAT.quantize(make_weight((5, 33)), KNOBS, model_dtype=torch.bfloat16, activation_amax=1.0)


def test_zero_tiny_and_huge_groups():
    """A zero group: code 0 in bfloat16/float32 (scale 2**-127), 127 in float16 (2**-127 is 0 there and
    ct's uint8 eps, 1, replaces it); the subnormal_amax group gets code 0; an amax that rounds past
    the dtype's largest finite is refused (ct's scale would be infinite)."""
    for dtype, code in [(torch.bfloat16, 0), (torch.float32, 0), (torch.float16, 127)]:
        zero = FORMAT.quantize(torch.zeros(3, 64), KNOBS, model_dtype=dtype, activation_amax=1.0)
        assert torch.all(zero.tensors["weight_scale"] == code), dtype
        assert torch.equal(FORMAT.dequantize(zero.tensors, KNOBS), torch.zeros(3, 64, dtype=torch.float64))
    weight = torch.zeros(2, 64)
    weight[0, :32] = torch.linspace(-1, 1, 32) * FORMAT.subnormal_amax(KNOBS, 1.0)
    result = FORMAT.quantize(weight, KNOBS, model_dtype=torch.float32, activation_amax=1.0)
    assert int(result.tensors["weight_scale"][0, 0]) == 0
    assert torch.equal(FORMAT.dequantize(result.tensors, KNOBS), result.truth) and result.truth.abs().max() > 0
    with pytest.raises(FormatError, match="infinite"):
        FORMAT.quantize(torch.full((1, 32), 60000.0), KNOBS, model_dtype=torch.float16, activation_amax=1.0)


def test_e2m1_codes_and_e8m0_exponents_from_their_definitions():
    """Byte 0x97: low nibble 7 (+6) first, then 9 (-0.5); scale code 130 is 2**3; 2 is +1.0."""
    packed = torch.tensor([[0x97, 0x00]], dtype=torch.uint8)
    scale = torch.tensor([[130]], dtype=torch.uint8)
    values = FORMAT.dequantize({"weight_packed": packed, "weight_scale": scale}, KNOBS)
    assert values.tolist() == [[6.0 * 8, -0.5 * 8, 0.0, 0.0]]
    for code, power in [(0, 2.0**-127), (127, 1.0), (254, 2.0**127)]:
        one = FORMAT.dequantize(
            {
                "weight_packed": torch.tensor([[2]], dtype=torch.uint8),
                "weight_scale": torch.tensor([[code]], dtype=torch.uint8),
            },
            KNOBS,
        )
        assert one.tolist() == [[power, 0.0]]


def test_config_is_what_ct_writes(tmp_path):
    """The fragment equals ModelCompressor.update_config's output for ct's MXFP4A16 preset; the MXFP4
    preset (dynamic MXFP4 activations, the same tensors) is read as well."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    written = {}
    for preset in ("MXFP4A16", "MXFP4"):
        model = torch.nn.ModuleDict(
            {
                "proj": torch.nn.Linear(64, 64, dtype=torch.bfloat16),
                "lm_head": torch.nn.Linear(64, 8, dtype=torch.bfloat16),
            }
        )
        apply_quantization_config(model, QuantizationConfig(config_groups={preset: ["Linear"]}, ignore=["lm_head"]))
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        (tmp_path / preset).mkdir()
        compressor.update_config(str(tmp_path / preset))
        written[preset] = json.loads((tmp_path / preset / "config.json").read_text())["quantization_config"]
    config = FORMAT.quantization_config(KNOBS, ["lm_head"])
    assert config == written["MXFP4A16"]
    for preset in written.values():
        assert detect_format(preset) is FORMAT and FORMAT.knobs_from_config(preset) == {}


def test_other_formats_not_matched_and_unsupported_configs_refused():
    config = FORMAT.quantization_config(KNOBS, [])
    others = [
        name for name in ("ct-nvfp4", "ct-nvfp4a16", "ct-int4", "ct-fp8-channel") if get_format(name).matches(config)
    ]
    assert others == []
    for change, message in [
        ({"symmetric": False}, "symmetric"),
        ({"group_size": 16}, "group_size"),
        ({"strategy": "tensor_group"}, "strategy"),
        ({"scale_dtype": "torch.float8_e4m3fn"}, "scale_dtype"),
    ]:
        bad = json.loads(json.dumps(config))
        bad["config_groups"]["group_0"]["weights"].update(change)
        with pytest.raises(FormatError, match=message):
            FORMAT.knobs_from_config(bad)


def test_malformed_tensors_raise_in_one_line():
    tensors = FORMAT.quantize(make_weight((6, 80)), KNOBS, model_dtype=torch.bfloat16, activation_amax=1.0).tensors
    nan_scale = tensors["weight_scale"].clone()
    nan_scale[0, 1] = 0xFF
    malformed = [
        ({"weight_packed": tensors["weight_packed"].to(torch.int8)}, "weight_packed has dtype"),
        ({"weight_packed": tensors["weight_packed"].reshape(-1)}, "dimensions"),
        ({"weight_packed": tensors["weight_packed"][:, :-16]}, "weight_scale has shape"),
        ({"weight_scale": tensors["weight_scale"][:, :2]}, "weight_scale has shape"),
        ({"weight_scale": tensors["weight_scale"].to(torch.bfloat16)}, "weight_scale has dtype"),
        ({"weight_scale": tensors["weight_scale"].view(torch.float8_e4m3fn)}, "weight_scale has dtype"),
        ({"weight_scale": tensors["weight_scale"].view(torch.int8)}, "weight_scale has dtype"),
        ({"weight_scale": tensors["weight_scale"].view(torch.float8_e5m2)}, "weight_scale has dtype"),
        ({"weight_scale": tensors["weight_scale"].view(torch.float8_e8m0fnu)[:, :2]}, "weight_scale has shape"),
        ({"weight_scale": nan_scale}, "NaN"),
        ({"weight_scale": nan_scale.view(torch.float8_e8m0fnu)}, "NaN"),
    ]
    for change, message in malformed:
        with pytest.raises(FormatError, match=message) as caught:
            FORMAT.dequantize({**tensors, **change}, KNOBS)
        assert "\n" not in str(caught.value)
    for missing in ("weight_packed", "weight_scale"):
        with pytest.raises(FormatError, match=f"missing tensor '{missing}'"):
            FORMAT.dequantize({k: v for k, v in tensors.items() if k != missing}, KNOBS)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
@pytest.mark.parametrize("sizes", [(256, 384), (224, 416), (192, 200)], ids=str)
def test_generated_checkpoint_dequantizes_to_truth(tmp_path, arch, sizes):
    """`gen` then `dequant`: every tensor equals the truth; a partial group makes the checkpoint exact-or-refuse."""
    from safetensors.torch import load_file

    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import TRUTH_FILE, generate
    from harness.oracle.reference import dequantize_checkpoint

    hidden, intermediate = sizes
    config = {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": 1, "head_dim": 32}
    manifest = generate(Recipe("ct-mxfp4", arch, seed=2, config=config), tmp_path / "c")
    truth = load_file(str(tmp_path / "c" / TRUTH_FILE))
    got = dict(dequantize_checkpoint(tmp_path / "c"))
    assert set(got) == set(truth) and all(torch.equal(got[n], truth[n]) for n in truth)
    partial = any(module["shape"][1] % 32 for module in manifest["modules"].values())
    assert partial == bool(hidden % 32 or intermediate % 32)
    assert manifest["expectation"] == ("exact-or-refuse" if partial else "exact")


STORAGES = ("uint8", "float8_e8m0fnu")


STORAGE_CASES = [
    (name, shape)
    for name in ("ct-mxfp4", "mxfp4")
    for shape in [(37, 96), (1, 32), (130, 160), (5, 256), (3, 50)]
    if name == "ct-mxfp4" or shape[1] % 32 == 0  # mxfp4's blocks hold whole groups only
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,shape", STORAGE_CASES, ids=str)
def test_scale_storages_hold_the_same_bytes_and_the_same_truth(name, shape, dtype):
    """`scale_storage`: the E8M0 bytes typed uint8 or float8_e8m0fnu are the same bytes, the packed
    codes and the truth the same, and the reference reads both by their bits to that truth, bit for
    bit (never by value: float8_e8m0fnu's byte 130 is 8.0, which `.to(int)` would make 8)."""
    fmt = get_format(name)
    weight = make_weight(shape, seed=sum(shape), dtype=torch.float32)
    written = {}
    for storage in STORAGES:
        knobs = fmt.resolve_knobs({"scale_storage": storage})
        written[storage] = fmt.quantize(weight, knobs, model_dtype=dtype, activation_amax=1.0)
        assert written[storage].tensors["weight_scale"].dtype == getattr(torch, storage)
        # what the reference gets from a checkpoint: knobs read back from the config, which says nothing of the storage
        read_back = fmt.knobs_from_config(fmt.quantization_config(knobs, []))
        assert "scale_storage" not in read_back
        reference = fmt.dequantize(written[storage].tensors, read_back)
        assert reference.dtype == torch.float64 and torch.equal(reference, written[storage].truth)
    plain, typed = written["uint8"], written["float8_e8m0fnu"]
    assert torch.equal(typed.tensors["weight_scale"].view(torch.uint8), plain.tensors["weight_scale"])
    assert torch.equal(typed.tensors["weight_packed"], plain.tensors["weight_packed"])
    assert torch.equal(typed.truth, plain.truth)
    assert (typed.expectation, typed.notes[:-1]) == (plain.expectation, plain.notes)
    assert "by value" in typed.notes[-1]


def test_scale_storage_leaves_the_config_alone():
    for name in ("ct-mxfp4", "mxfp4"):
        fmt = get_format(name)
        configs = [fmt.quantization_config(fmt.resolve_knobs({"scale_storage": s}), ["lm_head"]) for s in STORAGES]
        assert configs[0] == configs[1]
        assert fmt.knobs_from_config(configs[1]) == {}
    with pytest.raises(ValueError, match="scale_storage"):
        FORMAT.resolve_knobs({"scale_storage": "float8_e4m3fn"})


def test_e8m0fnu_scales_read_by_their_bits():
    """Byte 130 typed float8_e8m0fnu is 2**3 (its value 8.0 too): read by the bits, as the uint8 byte."""
    packed = torch.tensor([[0x97, 0x00]], dtype=torch.uint8)
    for code in (0, 120, 127, 130, 254):
        scale = torch.tensor([[code]], dtype=torch.uint8)
        plain = FORMAT.dequantize({"weight_packed": packed, "weight_scale": scale}, {})
        typed = FORMAT.dequantize({"weight_packed": packed, "weight_scale": scale.view(torch.float8_e8m0fnu)}, {})
        assert torch.equal(plain, typed) and typed[0, 0] == 6.0 * 2.0 ** (code - 127)
    # the misreading the storage is there to expose: by value, byte 130 becomes 8 and 120 becomes 0
    by_value = torch.tensor([130, 120], dtype=torch.uint8).view(torch.float8_e8m0fnu).to(torch.int32)
    assert by_value.tolist() == [8, 0]


@pytest.mark.parametrize("name, arch", [("ct-mxfp4", "llama"), ("mxfp4", "gpt_oss")])
def test_generated_checkpoint_with_typed_scales_dequantizes_to_truth(tmp_path, name, arch):
    """`gen --set scale_storage=float8_e8m0fnu`: the scales are F8_E8M0 on disk, the config is the
    uint8 checkpoint's, and the reference (knobs from the config alone) reads the truth."""
    from safetensors.torch import load_file

    from harness.checkpoints.reader import Checkpoint
    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import TRUTH_FILE, generate
    from harness.oracle.reference import dequantize_checkpoint

    config = {"num_hidden_layers": 1}
    written = {}
    for storage in STORAGES:
        out = tmp_path / storage
        manifest = generate(Recipe(name, arch, seed=1, config=config, knobs={"scale_storage": storage}), out)
        assert manifest["expectation"] == "exact"
        truth = load_file(str(out / TRUTH_FILE))
        got = dict(dequantize_checkpoint(out))
        assert set(got) == set(truth) and all(torch.equal(got[n], truth[n]) for n in truth)
        checkpoint = Checkpoint(out)
        scales = {n: d for n, d in checkpoint.storage_dtypes().items() if n.endswith(("weight_scale", "_scales"))}
        assert scales and set(scales.values()) == {"U8" if storage == "uint8" else "F8_E8M0"}
        written[storage] = (json.loads((out / "config.json").read_text()), truth)
    assert written["uint8"][0] == written["float8_e8m0fnu"][0]
    assert all(torch.equal(written["uint8"][1][n], t) for n, t in written["float8_e8m0fnu"][1].items())
