"""The reference's activation candidate and the judgement against it: an engine that quantizes
activations as the checkpoint specifies passes; one that ignores them, or reads a static scale in
the other convention, is an `activations` finding that says which (labelled test doubles)."""

from __future__ import annotations

import pytest
import torch

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.core.numerics import E2M1_TABLE, E4M3_TABLE
from harness.differential.runner import EngineSession, evaluate
from harness.oracle.activations import ActivationScheme, quantize_activations, scheme_of

DOUBLES = "tests.doubles.buggy_engines"
SPECIFIED = f"{DOUBLES}:ActivationsAsSpecifiedEngine"
IGNORED = f"{DOUBLES}:ActivationsIgnoredEngine"
INVERTED = f"{DOUBLES}:InvertedInputScaleEngine"


def test_fp8_activations_land_on_scaled_e4m3_values_and_saturate():
    x = torch.tensor([[0.3, -1.7, 5.0, 1000.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    static = ActivationScheme("fp8", "tensor", False, static="input_scale")
    quantized = quantize_activations(x, static, torch.tensor([0.5])).double()
    codes = set(E4M3_TABLE[torch.isfinite(E4M3_TABLE)].tolist())
    assert all(v / 0.5 in codes for v in quantized.flatten().tolist())
    assert quantized[0, 3] == 448 * 0.5  # saturates at the largest finite E4M3
    token = ActivationScheme("fp8", "token", True)
    dynamic = quantize_activations(x, token).double()
    assert dynamic[0].abs().max() == 1000.0 and torch.equal(dynamic[1], torch.zeros(4, dtype=torch.float64))


def test_nvfp4_activations_are_e2m1_times_an_e4m3_group_scale():
    x = torch.linspace(-3, 5, 32).reshape(1, 32)
    global_scale = 448 * 6 / 5.0  # compressed-tensors' divisor convention for amax 5
    scheme = ActivationScheme("nvfp4", "tensor_group", True, 16, "input_global_scale")
    quantized = quantize_activations(x, scheme, torch.tensor([global_scale])).double()
    for group in quantized.reshape(2, 16):
        block = group.abs().max() / 6  # the largest code is 6 unless the block scale rounded down
        values = set((E2M1_TABLE * block).tolist())
        assert all(any(abs(v - w) <= 0.05 * block for w in values) for v in group.tolist())
    multiplier = ActivationScheme("nvfp4", "tensor_group", True, 16, "input_scale", multiplier=True)
    inverse = torch.tensor([1 / global_scale], dtype=torch.float64)  # the same global in the other convention
    assert torch.allclose(quantize_activations(x, multiplier, inverse), quantized.float(), rtol=1e-6, atol=0)


def test_the_schemes_the_formats_declare_are_read():
    from harness.formats import get_format

    def scheme(name, **knobs):
        fmt = get_format(name)
        return scheme_of(fmt.quantization_config(fmt.resolve_knobs(knobs), []))

    assert scheme("ct-fp8-tensor") == ActivationScheme("fp8", "token", True, None, "")
    assert scheme("ct-fp8-tensor", input_scale=True).static == "input_scale"
    assert scheme("ct-fp8-block").strategy == "group" and scheme("ct-fp8-block").group_size == 128
    assert scheme("fp8-block").group_size == 128 and scheme("fp8-block").dynamic
    assert scheme("ct-nvfp4").static == "input_global_scale" and not scheme("ct-nvfp4").multiplier
    assert scheme("modelopt-nvfp4").multiplier and scheme("modelopt-fp8").static == "input_scale"
    assert scheme("ct-nvfp4a16") is None and scheme("ct-int4") is None


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    pytest.importorskip("transformers")
    session = EngineSession(["reference", SPECIFIED, IGNORED, INVERTED], tmp_path_factory.mktemp("engines"))
    yield session
    session.close()


@pytest.mark.parametrize(
    "fmt, knobs",
    [("ct-fp8-tensor", {"input_scale": True}), ("ct-fp8-tensor", {}), ("ct-nvfp4", {}), ("modelopt-fp8", {})],
)
def test_compare_tells_specified_from_ignored_from_inverted(session, tmp_path, fmt, knobs):
    generate(Recipe(format=fmt, arch="llama", knobs=knobs, layout={"dtype": "float32"}), tmp_path / "c")
    result = evaluate(tmp_path / "c", session)
    kinds = {(f.engine.rpartition(":")[2], f.kind): f.message for f in result.findings}
    assert not [engine for engine, _ in kinds if engine in ("reference", "ActivationsAsSpecifiedEngine")], kinds
    assert "activation quantization not applied" in kinds[("ActivationsIgnoredEngine", "activations")]
    if knobs or fmt != "ct-fp8-tensor":  # a static scale to invert
        assert "not quantized as specified" in kinds[("InvertedInputScaleEngine", "activations")]
