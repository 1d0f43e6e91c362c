"""The fast dequantizer (harness/oracle/fast.py) against the float64 reference: every element, bit
for bit, on generated checkpoints at odd shapes; the reference's refusals, word for word; and a
fault planted in the fast path caught at run time by the sampled tiles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoints.recipe import Recipe, apply_settings
from harness.checkpoints.writer import generate
from harness.commands.cli import main
from harness.core.errors import CheckpointError, HarnessError
from harness.formats import FORMAT_NAMES, get_format
from harness.formats.base import FormatError
from harness.oracle import fast
from harness.oracle.fast import (
    WITHOUT_KERNEL,
    FastDequantizer,
    FastPathMismatch,
    first_difference,
    kernel_for,
    verification_tiles,
    verify_tiles,
)
from harness.oracle.reference import dequantize_checkpoint, format_and_knobs, group_modules

ODD = ["hidden_size=144", "intermediate_size=272"]  # multiples of 16 (NVFP4), not of 128
#: generated checkpoints the fast path must reproduce exactly: partial edge blocks, every scale
#: dtype, blocks written three ways, blocks larger than the weight, perturbed scales
EXACT = {
    "fp8-block": ("fp8-block", ODD),
    "fp8-block-64-odd": ("fp8-block", ["hidden_size=200", "intermediate_size=160", "block_size=64"]),
    "fp8-block-rect": ("fp8-block", [*ODD, "block_rows=48", "block_cols=80", "scale_dtype=bfloat16"]),
    "fp8-block-scalar": ("fp8-block", [*ODD, "block_size=32", "block_size_style=scalar", "zero_block=true"]),
    "fp8-block-one-element": ("fp8-block", [*ODD, "block_size=512", "block_size_style=one-element"]),
    "fp8-block-subnormal": ("fp8-block", [*ODD, "subnormal_block=true", "dtype=float32"]),
    "ct-fp8-tensor": ("ct-fp8-tensor", [*ODD, "input_scale=true"]),
    "ct-fp8-tensor-fp16": ("ct-fp8-tensor", [*ODD, "dtype=float16"]),
    "ct-fp8-channel": ("ct-fp8-channel", [*ODD, "dtype=float16", "subnormal_block=true"]),
    "ct-fp8-channel-f32-scales": ("ct-fp8-channel", [*ODD, "scale_dtype=float32"]),
    "ct-fp8-block": ("ct-fp8-block", [*ODD, "input_scale=true", "zero_block=true"]),
    "ct-fp8-block-fp16": (
        "ct-fp8-block",
        ["hidden_size=200", "intermediate_size=96", "block_size=64", "dtype=float16"],
    ),
    "ct-nvfp4": ("ct-nvfp4", ODD),
    "ct-nvfp4-tiny": ("ct-nvfp4", [*ODD, "extreme_amax=tiny", "zero_block=true"]),
    "ct-nvfp4-huge": ("ct-nvfp4", [*ODD, "extreme_amax=huge", "dtype=float32"]),
    "ct-nvfp4a16": ("ct-nvfp4a16", [*ODD, "subnormal_block=true", "dtype=float16"]),
    "modelopt-nvfp4": ("modelopt-nvfp4", ODD),
    "modelopt-nvfp4-tiny": ("modelopt-nvfp4", [*ODD, "extreme_amax=tiny", "subnormal_block=true"]),
    "modelopt-nvfp4-huge": ("modelopt-nvfp4", [*ODD, "extreme_amax=huge", "zero_block=true"]),
    "modelopt-fp8": ("modelopt-fp8", ODD),
    "modelopt-fp8-fp16-subnormal": ("modelopt-fp8", [*ODD, "dtype=float16", "subnormal_block=true"]),
    "modelopt-fp8-f32-zero": ("modelopt-fp8", [*ODD, "dtype=float32", "zero_block=true"]),
    "ct-int4": ("ct-int4", ODD),  # K=144 and 272: a partial last group of 128
    "ct-int4-g32-fp16": ("ct-int4", [*ODD, "group_size=32", "dtype=float16", "zero_block=true"]),
    "ct-int4-g64-subnormal": (
        "ct-int4",
        ["hidden_size=200", "intermediate_size=160", "group_size=64", "subnormal_block=true", "dtype=float32"],
    ),
    "ct-mxfp4": ("ct-mxfp4", ODD),  # K=144 and 272: a partial last group of 32
    "ct-mxfp4-fp16-zero": ("ct-mxfp4", [*ODD, "dtype=float16", "zero_block=true"]),
    "ct-mxfp4-subnormal-huge": ("ct-mxfp4", [*ODD, "subnormal_block=true", "extreme_amax=huge", "dtype=float32"]),
}
#: checkpoints the reference refuses (a module it cannot read): the fast path must say the same
REFUSED = {
    "nan-scale": ("fp8-block", [*ODD, "nonfinite_scale=nan"]),
    "inf-scale": ("ct-fp8-channel", [*ODD, "nonfinite_scale=inf"]),
    "transposed-grid": ("fp8-block", [*ODD, "block_size=32", "scale_layout=transposed"]),
    "transposed-ct-grid": ("ct-fp8-block", [*ODD, "block_size=64", "scale_layout=transposed"]),
    "ct-swapped-convention": ("ct-nvfp4", [*ODD, "global_scale_convention=swapped"]),
    "modelopt-swapped-convention": ("modelopt-nvfp4", [*ODD, "global_scale_convention=swapped"]),
    "modelopt-fp8-inf-scale": ("modelopt-fp8", [*ODD, "nonfinite_scale=inf"]),
    "ct-int4-nan-scale": ("ct-int4", [*ODD, "nonfinite_scale=nan"]),
}
OUTPUTS = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fast")
    made = {}
    for name, (fmt, settings) in (EXACT | REFUSED).items():
        made[name] = root / name
        generate(apply_settings(Recipe(format=fmt, arch="llama", seed=5), list(settings)), made[name])
    return made


def quantized_modules(directory):
    """(module name, format, knobs, tensors) for every quantized module of a checkpoint (a mixed
    checkpoint's module with its config group's format, as `dequant --fast` reads it)."""
    from harness.checkpoints.reader import Checkpoint

    checkpoint = Checkpoint(directory)
    fmt, knobs = format_and_knobs(checkpoint)
    modules, _ = group_modules(checkpoint.names(), fmt)
    for module, parts in sorted(modules.items()):
        tensors = {suffix: checkpoint.tensor(name) for suffix, name in parts.items()}
        yield module, *fmt.for_module(module, knobs, tensors), tensors


def test_every_registered_format_has_a_fast_kernel_or_says_it_has_none():
    for name in FORMAT_NAMES:
        if name in WITHOUT_KERNEL:
            with pytest.raises(HarnessError, match=f"format '{name}' has no fast dequantizer; run without --fast"):
                kernel_for(get_format(name))
        else:
            kernel_for(get_format(name))


@pytest.mark.parametrize("case", list(EXACT))
def test_fast_equals_the_reference_rounded_once_to_float32(checkpoints, case):
    """float32: bit for bit the reference's float64 value rounded to nearest-even float32;
    bfloat16: that float32 value rounded to nearest-even bfloat16 (torch's own float64 -> bfloat16).
    Small row tiles, so the odd shapes cross many tile boundaries."""
    seen = 0
    for module, fmt, knobs, tensors in quantized_modules(checkpoints[case]):
        reference = fmt.dequantize(tensors, knobs)
        for dtype in OUTPUTS:
            out = FastDequantizer(dtype, verify=False, tile_elements=3000).dequantize(fmt, knobs, tensors)
            assert out.dtype == dtype and out.shape == reference.shape, module
            assert first_difference(out, reference) is None, (
                f"{module} {dtype}: first at {first_difference(out, reference)}"
            )
            if dtype == torch.bfloat16:
                assert torch.equal(out, reference.to(torch.bfloat16)), module
            verify_tiles(fmt, knobs, tensors, out, module, everything=True)  # every tile's sub-problem too
        seen += 1
    assert seen >= 7


@pytest.mark.parametrize("case", list(REFUSED))
def test_fast_refuses_what_the_reference_refuses(checkpoints, case):
    with pytest.raises(CheckpointError) as reference:
        list(dequantize_checkpoint(checkpoints[case]))
    for dtype in OUTPUTS:
        with pytest.raises(CheckpointError) as fast_error:
            list(fast.fast_dequantize_checkpoint(checkpoints[case], dtype))
        assert str(fast_error.value) == str(reference.value)


def damaged(tensors, packed, scale):
    """Malformed variants of one module's tensors, each refused by the reference."""
    yield "no packed weight", {k: v for k, v in tensors.items() if k != packed}
    yield "no scale", {k: v for k, v in tensors.items() if k != scale}
    yield "3-D weight", tensors | {packed: tensors[packed].unsqueeze(0)}
    yield "weight as float16", tensors | {packed: tensors[packed].view(torch.uint8).to(torch.float16)}
    yield "scale as int32", tensors | {scale: tensors[scale].to(torch.float32).to(torch.int32)}
    yield "scale one row longer", tensors | {scale: torch.cat([tensors[scale], tensors[scale][:1]])}
    if tensors[scale].dim() == 2 and tensors[scale].shape[1] > 1:
        yield "scale one column short", tensors | {scale: tensors[scale][:, 1:]}
    nan = tensors[scale].clone()
    nan.view(-1)[-1] = 0xFF if nan.dtype == torch.uint8 else float("nan")  # E8M0's NaN is code 0xFF
    yield "NaN scale", tensors | {scale: nan}


def damaged_int4(tensors):
    """ct-int4's own malformed variants: its shape tensor, and an asymmetric zero point."""
    rows, cols = tensors["weight_shape"].tolist()
    yield "no weight_shape", {k: v for k, v in tensors.items() if k != "weight_shape"}
    yield "weight_shape as float", tensors | {"weight_shape": tensors["weight_shape"].float()}
    yield "weight_shape one word wider", tensors | {"weight_shape": torch.tensor([rows, cols + 8])}
    yield "weight_shape of a zero-column weight", tensors | {"weight_shape": torch.tensor([rows, 0])}
    yield "a weight_zero_point", tensors | {"weight_zero_point": torch.zeros_like(tensors["weight_scale"])}


@pytest.mark.parametrize(
    "case",
    [
        "fp8-block",
        "ct-fp8-tensor",
        "ct-fp8-channel",
        "ct-fp8-block",
        "ct-nvfp4",
        "modelopt-nvfp4",
        "modelopt-fp8",
        "ct-int4",
        "ct-mxfp4",
    ],
)
def test_malformed_modules_are_refused_in_the_references_words(checkpoints, case):
    module, fmt, knobs, tensors = next(iter(quantized_modules(checkpoints[case])))
    kernel = kernel_for(fmt)
    variants = list(damaged(tensors, kernel.packed, kernel.scale))
    if hasattr(kernel, "global_scale"):
        per_tensor = tensors[kernel.global_scale]
        variants += [
            ("per-tensor scale reciprocal", tensors | {kernel.global_scale: 1 / per_tensor}),
            ("per-tensor scale zero", tensors | {kernel.global_scale: per_tensor * 0}),
            ("K not a multiple of 16", tensors | {kernel.packed: tensors[kernel.packed][:, :-1]}),
        ]
    if fmt.name == "ct-int4":
        variants += list(damaged_int4(tensors))
    if fmt.name == "modelopt-fp8":
        variants += [
            ("no input_scale", {k: v for k, v in tensors.items() if k != "input_scale"}),
            ("input_scale zero", tensors | {"input_scale": tensors["input_scale"] * 0}),
        ]
    assert len(variants) >= 6
    for what, variant in variants:
        with pytest.raises(FormatError) as reference:
            fmt.dequantize(variant, knobs)
        with pytest.raises(FormatError) as fast_error:
            FastDequantizer().dequantize(fmt, knobs, variant)
        assert str(fast_error.value) == str(reference.value), what


def test_tiles_cover_the_weight_once_and_the_sample_includes_the_last_partial_block():
    for shape, block in [((300, 200), (128, 128)), ((77, 400), (1, 16)), ((130, 144), (256, 48)), ((9, 9), (9, 9))]:
        covered = torch.zeros(shape, dtype=torch.int64)
        for tile in verification_tiles(shape, block, "w", everything=True):
            covered[tile.rows, tile.cols] += 1
        assert bool((covered == 1).all()), (shape, block)
        sample = verification_tiles(shape, block, "w", everything=False)
        assert sample == verification_tiles(shape, block, "w", everything=False)  # deterministic
        assert any(t.rows.stop == shape[0] and t.cols.stop == shape[1] for t in sample)
        assert len(sample) <= 4 + fast.VERIFY_SEEDED


@pytest.mark.parametrize(
    "case",
    ["fp8-block-64-odd", "ct-fp8-channel", "ct-nvfp4", "modelopt-nvfp4", "modelopt-fp8", "ct-int4", "ct-mxfp4"],
)
def test_a_wrong_last_element_is_caught_and_named(checkpoints, case, monkeypatch):
    module, fmt, knobs, tensors = next(iter(quantized_modules(checkpoints[case])))
    kernel_class = type(kernel_for(fmt))
    fill = kernel_class.fill

    def faulty_fill(self, out, *args):
        fill(self, out, *args)
        out[-1, -1] = out[-1, -1] * 2 + 1

    monkeypatch.setattr(kernel_class, "fill", faulty_fill)
    rows, cols = kernel_for(fmt).shape(tensors)
    with pytest.raises(FastPathMismatch, match=rf"^{module}\.weight: .* tile \[\d+:{rows}, \d+:{cols}\] "):
        FastDequantizer().dequantize(fmt, knobs, tensors, f"{module}.weight")


def test_cli_fast_writes_what_the_reference_path_writes(checkpoints, tmp_path, capsys):
    directory = checkpoints["fp8-block-64-odd"]
    for dtype in ("float32", "bfloat16"):
        slow, quick = tmp_path / f"slow-{dtype}.safetensors", tmp_path / f"fast-{dtype}.safetensors"
        assert main(["dequant", str(directory), "--out", str(slow), "--dtype", dtype]) == 0
        assert main(["dequant", str(directory), "--out", str(quick), "--dtype", dtype, "--fast"]) == 0
        assert "fast path" in capsys.readouterr().out
        expected, written = load_file(str(slow)), load_file(str(quick))
        assert list(written) == list(expected)
        for name, tensor in expected.items():
            assert written[name].dtype == tensor.dtype, name
            assert torch.equal(written[name].view(torch.int16), tensor.view(torch.int16)), name


def test_cli_fast_refusals_are_one_line(checkpoints, tmp_path, capsys, monkeypatch):
    out = tmp_path / "w.safetensors"
    assert main(["dequant", str(checkpoints["fp8-block"]), "--out", str(out), "--fast", "--dtype", "float64"]) == 2
    assert "--fast writes float32 or bfloat16" in capsys.readouterr().err
    fill = fast.Fp8Kernel.fill
    monkeypatch.setattr(fast.Fp8Kernel, "fill", lambda self, out, *a: (fill(self, out, *a), out.neg_()))
    assert main(["dequant", str(checkpoints["fp8-block"]), "--out", str(out), "--fast"]) == 2
    error = capsys.readouterr().err
    assert (
        error.count("\n") == 1 and "disagrees with the float64 reference" in error and "rerun without --fast" in error
    )
    assert not out.exists() and not (tmp_path / "w.safetensors.partial").exists()


def test_bfloat16_is_the_float32_value_rounded_again():
    """One FP8 element whose float32 product lies exactly halfway between two bfloat16 values while
    the exact product lies above: the output is the even neighbour below, one bfloat16 ulp from the
    float64 value rounded once. That is the relation the fast path keeps (and torch's own cast)."""
    code = torch.tensor(1.5).to(torch.float8_e4m3fn)
    midpoint = 1 + 2.0**-8
    scale = torch.tensor(midpoint / 1.5, dtype=torch.float32)
    while not (float(scale) * 1.5 > midpoint and float(scale * 1.5) == midpoint):
        scale = torch.nextafter(scale, torch.tensor(2.0))
    fmt = get_format("fp8-block")
    knobs = fmt.resolve_knobs({})
    tensors = {"weight": code.reshape(1, 1), "weight_scale_inv": scale.reshape(1, 1)}
    out = FastDequantizer(torch.bfloat16).dequantize(fmt, knobs, tensors)
    exact = float(fmt.dequantize(tensors, knobs))
    assert exact > midpoint and float(out) == 1.0 == float(torch.tensor(exact, dtype=torch.float64).to(torch.bfloat16))


#: int4 shapes the generators do not write: K not a multiple of 8 (a padded last word), K smaller
#: than one group, one row; group sizes a config may hold beyond the knob's 32/64/128, some not a
#: multiple of 8 (a group boundary inside a word) or larger than a verification tile
INT4_SHAPES = [(37, 100), (5, 20), (1, 7), (130, 300), (3, 520)]
INT4_GROUPS = [32, 64, 128, 12, 100, 136, 256]


@pytest.mark.parametrize("group", INT4_GROUPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name,symmetric", [("ct-int4", True), ("ct-int4", False), ("ct-int8", False)])
def test_int_any_group_and_padded_word_equals_the_reference(group, dtype, name, symmetric):
    """Every element and every verification tile's sub-problem, bit for bit, with the last word
    padded, groups that straddle words and tiles, and zero points (packed along the rows) cut by tiles."""
    fmt = get_format(name)
    knobs = {"group_size": group, "symmetric": symmetric}  # any group a config may state, not only the knob's
    generator = torch.Generator().manual_seed(group)
    for shape in INT4_SHAPES:
        weight = torch.randn(shape, generator=generator) * torch.exp(torch.randn(shape, generator=generator) * 2)
        weight = weight.clamp(-1e4, 1e4)  # finite scales in float16
        tensors = fmt.quantize(weight, knobs, model_dtype=dtype, activation_amax=1.0).tensors
        reference = fmt.dequantize(tensors, knobs)
        for out_dtype in OUTPUTS:
            out = FastDequantizer(out_dtype, verify=False, tile_elements=64).dequantize(fmt, knobs, tensors)
            assert first_difference(out, reference) is None, (shape, out_dtype, first_difference(out, reference))
            verify_tiles(fmt, knobs, tensors, out, f"{shape}", everything=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp4_any_even_k_equals_the_reference(dtype):
    """Every element and every verification tile's sub-problem, bit for bit: K below one group, a
    partial last group, whole groups; the extreme E8M0 codes (2**-127, and float32 overflow at 254)."""
    fmt = get_format("ct-mxfp4")
    generator = torch.Generator().manual_seed(3)
    for shape in [(3, 2), (5, 16), (7, 50), (33, 96), (2, 330)]:
        weight = torch.randn(shape, generator=generator) * torch.exp(torch.randn(shape, generator=generator) * 2)
        tensors = fmt.quantize(weight, {}, model_dtype=dtype, activation_amax=1.0).tensors
        tensors["weight_scale"].view(-1)[0] = 0
        tensors["weight_scale"].view(-1)[-1] = 254
        reference = fmt.dequantize(tensors, {})
        for out_dtype in OUTPUTS:
            out = FastDequantizer(out_dtype, verify=False, tile_elements=64).dequantize(fmt, {}, tensors)
            assert first_difference(out, reference) is None, (shape, out_dtype, first_difference(out, reference))
            verify_tiles(fmt, {}, tensors, out, f"{shape}", everything=True)


@pytest.mark.parametrize("name", ["fp8-block", "ct-w8a8"])
def test_one_byte_codes_at_odd_and_even_widths_equal_the_reference(name):
    """Even widths are decoded two codes per lookup, odd ones one code per lookup (a pair would
    straddle two rows): every element bit for bit either way, in tiles of a few rows and in one tile."""
    fmt = get_format(name)
    knobs = fmt.resolve_knobs({"block_size": 64} if name == "fp8-block" else {})
    generator = torch.Generator().manual_seed(5)
    for shape in [(37, 201), (6, 130), (129, 257), (3, 2)]:
        weight = torch.randn(shape, generator=generator)
        tensors = fmt.quantize(weight, knobs, model_dtype=torch.bfloat16, activation_amax=1.0).tensors
        reference = fmt.dequantize(tensors, knobs)
        for out_dtype in OUTPUTS:
            for tile_elements in (600, fast.TILE_ELEMENTS):
                dequantizer = FastDequantizer(out_dtype, verify=False, tile_elements=tile_elements)
                out = dequantizer.dequantize(fmt, knobs, tensors)
                assert first_difference(out, reference) is None, (shape, out_dtype, tile_elements)


PRODUCERS = Path(__file__).resolve().parents[2] / "cases" / "producers"
#: what real producers wrote, in every format the fast path covers (the corpus, docs/producers.md)
PRODUCER_CASES = sorted(
    str(config.parent.relative_to(PRODUCERS))
    for config in PRODUCERS.glob("*/*/config.json")
    if (config.parent / "provenance.json").is_file()
)


@pytest.mark.parametrize("case", PRODUCER_CASES)
def test_fast_equals_the_reference_on_what_real_producers_wrote(case):
    """Their scales as they store them (1-D rows, ModelOpt's 4-D grid, 0-dim), each module and every
    verification tile's sub-problem: what `dequant --fast` reads on a checkpoint from the hub; a
    module the reference refuses is refused in its words."""
    directory = PRODUCERS / case
    try:
        fmt, knobs = format_and_knobs(directory)
    except (CheckpointError, HarnessError, FormatError) as error:
        pytest.skip(f"the reference does not read it: {error}")
    slow = [scheme.name for scheme in fmt.schemes(knobs) if scheme.name in WITHOUT_KERNEL]
    if slow:
        pytest.skip(f"{slow[0]} has no fast kernel (WITHOUT_KERNEL)")
    seen = 0
    for module, fmt, knobs, tensors in quantized_modules(directory):
        quick = FastDequantizer(torch.float32, verify=False, tile_elements=3000)
        try:
            reference = fmt.dequantize(tensors, knobs)
        except FormatError as refusal:  # transformers' FP8 save: bf16 weights beside a scale
            with pytest.raises(FormatError, match=re.escape(str(refusal))):
                quick.dequantize(fmt, knobs, tensors)
            continue
        out = quick.dequantize(fmt, knobs, tensors)
        assert first_difference(out, reference) is None, f"{module}: first at {first_difference(out, reference)}"
        verify_tiles(fmt, knobs, tensors, out, module, everything=True)
        seen += 1
    assert seen
