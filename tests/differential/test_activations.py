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
KV_IGNORED = f"{DOUBLES}:KVCacheIgnoredEngine"
KV_IGNORED_UNTOLD = f"{DOUBLES}:KVCacheIgnoredUntoldEngine"
KV_DEFAULT = f"{DOUBLES}:KVScalesDefaultEngine"
FUSED = f"{DOUBLES}:FusedPartInputScaleEngine"


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


def test_mxfp4_activations_are_ocp_mx_as_autoround_computes_them():
    """The OCP MX definition (a power-of-two scale 2**(floor(log2 amax) - 2) per 32, E2M1 values,
    saturating at 6) equals AutoRound's own `quant_mx`, which its CPU Linear applies to its inputs,
    and the RCEIL rule (2**ceil(log2(amax / 6))) its `quant_mx_rceil`, bit for bit: on random
    groups, groups whose amax sits just below and at a power of two (where compressed-tensors'
    rounding of the amax differs), a zero group and a partial last group."""
    quant_mx = pytest.importorskip("auto_round.data_type.mxfp").quant_mx
    scheme = ActivationScheme("mxfp4", "group", True, 32)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=generator, dtype=torch.float64) * torch.exp2(
        torch.randint(-20, 20, (6, 1), generator=generator).double()
    )
    x[0, :32] = 0.0
    x[1, :32] = torch.linspace(-1.9, 1.99, 32) * 2.0**-5  # amax mantissa 1.99: OCP clamps, ct would round up
    x[2, 32:64] = torch.linspace(-1.0, 0.5, 32) * 2.0**4  # amax exactly a power of two
    quant_mx_rceil = pytest.importorskip("auto_round.data_type.mxfp").quant_mx_rceil
    rceil = ActivationScheme("mxfp4", "group", True, 32, exponent="ceil")
    for dtype in (torch.float32, torch.bfloat16):
        for columns in (96, 80):
            data = x[:, :columns].to(dtype)
            for theirs, ours in (
                (quant_mx(data, bits=4, group_size=32, data_type="mx_fp")[0], quantize_activations(data, scheme)),
                (quant_mx_rceil(data, bits=4, group_size=32, data_type="mx_fp")[0], quantize_activations(data, rceil)),
            ):
                assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (dtype, columns)
    # the two rules differ where the amax's mantissa is above 1.5 (6 = 1.5 x 4): OCP saturates at 6
    data = x[1:2, :32]
    assert not torch.equal(quantize_activations(data, scheme), quantize_activations(data, rceil))
    assert torch.equal(quantize_activations(x[:1, :32], scheme), torch.zeros(1, 32, dtype=torch.float64))


@pytest.mark.parametrize("bits", [4, 8])
def test_mx_activations_are_compressed_tensors_own(bits):
    """compressed-tensors' MXFP4 and MXFP8 inputs (its presets' float `group` args of 32 with uint8
    scales, dynamic) as `scheme_of` reads them equal compressed-tensors' own `calculate_qparams` and
    `fake_quantize`, bit for bit: random groups, a zero group, an amax mantissa of 1.99 (rounded up to
    the next power of two) and a partial group's neighbours, in bfloat16 and float32."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from harness.oracle.activations import scheme_of

    declared = {"num_bits": bits, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True}
    declared |= {"dynamic": True, "scale_dtype": "torch.uint8"}
    config = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"input_activations": declared}}}
    scheme = scheme_of(config)
    assert (scheme.kind, scheme.group_size, scheme.exponent) == (f"mxfp{bits}", 32, "even")
    args = QuantizationArgs(**(declared | {"scale_dtype": torch.uint8}))
    generator = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 96, generator=generator) * torch.exp2(
        torch.randint(-20, 20, (6, 1), generator=generator).float()
    )
    x[0, :32] = 0.0
    x[1, :32] = torch.linspace(-1.9, 1.99, 32) * 2.0**-5
    for dtype in (torch.bfloat16, torch.float32):
        data = x.to(dtype)
        grouped = data.reshape(6, 3, 32)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        theirs = fake_quantize(data, scale, zero, args)
        ours = quantize_activations(data, scheme)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), dtype
    # not the FP8 per-group rule (amax / 448): the probe's inputs tell the two apart
    from harness.oracle.probe_inputs import probe_input

    if bits == 8:
        probe = probe_input(scheme, None, 96, 8, torch.bfloat16, seed=0)
        fp8_groups = ActivationScheme("fp8", "group", True, 32)
        assert not torch.equal(quantize_activations(probe, scheme), quantize_activations(probe, fp8_groups))


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
    engines = ["reference", SPECIFIED, IGNORED, INVERTED, KV_IGNORED, KV_IGNORED_UNTOLD, KV_DEFAULT]
    session = EngineSession(engines, tmp_path_factory.mktemp("engines"))
    yield session
    session.close()


@pytest.fixture(scope="module")
def fused_session(tmp_path_factory):
    pytest.importorskip("transformers")
    session = EngineSession(["reference", FUSED], tmp_path_factory.mktemp("fused"))
    yield session
    session.close()


@pytest.fixture(scope="module")
def real_session(tmp_path_factory):
    """The reference and the two real CPU engines, started once for the module (each test names
    the engines it judges)."""
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    session = EngineSession(["reference", "transformers", "compressed-tensors"], tmp_path_factory.mktemp("real"))
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


def test_seed_002s_bug_class_is_caught_on_the_tiny_models_w4a4_variant(session, tmp_path):
    """Seed 002: an NVFP4 activation global scale wrong after loading, weights exact. On the tiny
    trained model's ct-nvfp4 (W4A4, bfloat16) variant, the double that reads the input global scale
    in the other convention is an `activations` finding; the engine that quantizes as specified and
    the reference are clean."""
    from harness.lm import quantize_model

    directory = quantize_model("tiny-llama", "ct-nvfp4", tmp_path / "tiny")
    result = evaluate(directory, session)
    kinds = {(f.engine.rpartition(":")[2], f.kind) for f in result.findings}
    assert ("InvertedInputScaleEngine", "activations") in kinds
    assert not [engine for engine, _ in kinds if engine in ("reference", "ActivationsAsSpecifiedEngine")], kinds


@pytest.mark.parametrize("seed", [0, 1])
def test_a_declared_fp8_kv_cache_is_part_of_the_definition(session, tmp_path, seed):
    """With `kv_cache_scheme` and k/v scales, the specified forward quantizes the cache: an engine
    that applies the Linears' activation quantization but not the cache is caught (float32): by its
    logits where it does not tell which scales its cache uses, by those scales where it does; one
    that quantizes the cache with scale 1.0 is caught by its scales (its logits are within the bound)."""
    layout = {"dtype": "float32", "kv_scales": "self_attn"}
    generate(Recipe(format="ct-fp8-channel", arch="llama", seed=seed, layout=layout), tmp_path / "c")
    result = evaluate(tmp_path / "c", session)
    kinds = {(f.engine.rpartition(":")[2], f.kind): f.message for f in result.findings}
    assert not [engine for engine, _ in kinds if engine in ("reference", "ActivationsAsSpecifiedEngine")], kinds
    assert "FP8 KV cache" in kinds[("KVCacheIgnoredUntoldEngine", "activations")]
    assert "KV cache not quantized" in kinds[("KVCacheIgnoredEngine", "kv-scales")]
    assert "k_scale 1 where the checkpoint stores" in kinds[("KVScalesDefaultEngine", "kv-scales")]
    assert {kind for engine, kind in kinds if engine.startswith("KV")} == {"activations", "kv-scales"}
    assert ("ActivationsIgnoredEngine", "activations") in kinds  # within 2x the wider bound: not named "not applied"


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_the_experts_forward_is_the_model_classs_own_when_nothing_is_quantized(arch, monkeypatch):
    """The packed-experts forward the activation candidate installs computes what the model's eager
    experts compute, once quantization is taken out (so only the quantization differs)."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.checkpoints.architectures import ARCHITECTURES
    from harness.oracle import expert_activations

    spec = ARCHITECTURES[arch]
    settings = spec.settings({"num_hidden_layers": 3})  # DeepSeek-V3 keeps its first layers dense
    config = AutoConfig.for_model(spec.model_type, **{**settings, **spec.fixed})
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    name, module = next((n, m) for n, m in model.named_modules() if hasattr(m, "gate_up_proj"))
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    experts = module.gate_up_proj.shape[0]
    hidden = torch.randn(7, module.gate_up_proj.shape[2])
    index = torch.stack([torch.randperm(experts)[:2] for _ in range(7)])
    weights = torch.rand(7, 2)
    monkeypatch.setattr(expert_activations, "quantize_activations", lambda x, scheme, scale: x)
    scheme = ActivationScheme("fp8", "token", True)
    ours = expert_activations._forward(module, scheme, [(None, None, None)] * experts, hidden, index, weights)
    assert torch.allclose(ours, module(hidden, index, weights), rtol=1e-5, atol=1e-6), name


def test_an_moe_checkpoints_experts_are_part_of_the_definition(session, tmp_path):
    """qwen3_moe, dynamic FP8: the candidate quantizes the routed experts' inputs too, so an engine
    that quantizes as specified passes and one that ignores activations is caught (float32)."""
    recipe = Recipe(
        format="ct-fp8-tensor", arch="qwen3_moe", config={"num_hidden_layers": 2}, layout={"dtype": "float32"}
    )
    generate(recipe, tmp_path / "c")
    result = evaluate(tmp_path / "c", session)
    kinds = {(f.engine.rpartition(":")[2], f.kind): f.message for f in result.findings}
    assert not [engine for engine, _ in kinds if engine in ("reference", "ActivationsAsSpecifiedEngine")], kinds
    assert "not applied" in kinds[("ActivationsIgnoredEngine", "activations")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_input_scale_taken_from_the_wrong_fused_part_is_caught(fused_session, tmp_path, dtype):
    """q/k/v and gate/up with distinct static input scales (as a calibration writes them): the double
    that quantizes every part's input with the first part's scale is caught by the activation probe
    at exactly the sibling parts, in float32 and in bfloat16 (where the logits alone are within
    their noise); in float32 the logits say so too (0.29 from the definition, bound 0.1)."""
    fused = FUSED
    layout = {"dtype": dtype, "fused_scales": "distinct-inputs"}
    generate(Recipe(format="modelopt-fp8", arch="llama", layout=layout), tmp_path / "c")
    result = evaluate(tmp_path / "c", fused_session)
    assert {(f.engine, f.kind) for f in result.findings} == {(fused, "activations")}
    (probe,) = [f for f in result.findings if f.message.startswith("activation probe")]
    siblings = {m.rpartition(".")[2] for m in probe.metrics["modules"]}
    assert siblings == {"k_proj", "v_proj", "up_proj"}, probe.metrics["modules"]
    assert len(result.findings) == (2 if dtype == "float32" else 1)


def test_the_rounding_variants_nudge_only_quantized_weights_and_put_them_back(tmp_path):
    """Each weight variant moves every quantized Linear's weight exactly one ulp (toward or away
    from zero) while installed and restores it bit for bit; unquantized parameters never move; an
    unknown variant is a one-line HarnessError that leaves the model as it was."""
    pytest.importorskip("transformers")
    from harness.core.errors import HarnessError
    from harness.engines.reference_engine import ReferenceEngine
    from harness.oracle.specified import VARIANTS

    generate(Recipe(format="ct-fp8-tensor", arch="llama", layout={"dtype": "bfloat16"}), tmp_path / "c")
    engine = ReferenceEngine()
    engine.load(str(tmp_path / "c"))
    model, plan = engine.model, engine.activations
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    quantized = {f"{name}.weight" for name in plan.inputs}
    assert quantized and quantized < set(before)
    for variant in VARIANTS:
        handles = plan.install(model, variant)
        for name, parameter in model.named_parameters():
            if name not in quantized or "+" not in variant:
                assert torch.equal(parameter, before[name]), (variant, name)
                continue
            toward = variant.endswith("toward-zero")
            target = torch.zeros_like(before[name]) if toward else before[name] * 2
            assert torch.equal(parameter, torch.nextafter(before[name], target)), (variant, name)
            moved = parameter.float().abs() - before[name].float().abs()
            assert ((moved < 0) if toward else (moved > 0))[before[name] != 0].all(), (variant, name)
        for handle in handles:
            handle.remove()
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), variant
    with pytest.raises(HarnessError, match="unknown variant"):
        plan.install(model, "model+weights-sideways")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_an_ill_conditioned_checkpoint_is_not_an_activation_finding(real_session, tmp_path):
    """Run 7's false alarm (docs/campaign.md): x1000 weights in bfloat16 with dynamic per-token FP8
    activations. transformers quantizes the activations exactly as the "model" variant does and
    holds weights one bfloat16 ulp off (its scale cast to bfloat16), and this model turns that ulp
    into logits 6.3 apart; the weight variants show the reference itself moving as far, so the
    activation bound widens and nothing is claimed, while the weights are still judged exactly."""
    config = {"hidden_size": 30, "intermediate_size": 18, "num_attention_heads": 1, "num_key_value_heads": 1}
    config |= {"head_dim": 32, "num_hidden_layers": 1, "tie_word_embeddings": False}
    recipe = Recipe(
        format="ct-fp8-tensor",
        arch="qwen2",
        config=config,
        knobs={"scale_dtype": "float32"},
        layout={"dtype": "bfloat16"},
        perturb={"extreme_amax": "huge"},
    )
    generate(recipe, tmp_path / "c")
    result = evaluate(tmp_path / "c", real_session, engines=["reference", "transformers"])
    assert result.outcomes["transformers"].status == "loaded"
    assert not result.findings, [(f.engine, f.kind, f.message) for f in result.findings]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "scheme, stored",
    [
        (ActivationScheme("fp8", "token", True), None),
        (ActivationScheme("fp8", "tensor", True), None),
        (ActivationScheme("fp8", "group", True, 128), None),
        (ActivationScheme("fp8", "tensor", False, static="input_scale"), torch.tensor([0.0123])),
        (ActivationScheme("nvfp4", "tensor_group", True, 16, "input_global_scale"), torch.tensor([311.7])),
        (ActivationScheme("nvfp4", "tensor_group", True, 16, "input_scale", multiplier=True), torch.tensor([1 / 97.3])),
        (ActivationScheme("mxfp4", "group", True, 32), None),
        (ActivationScheme("mxfp8", "group", True, 32, exponent="even"), None),
    ],
)
def test_probe_inputs_quantize_the_same_in_every_arithmetic_and_far_from_their_grid(scheme, stored, dtype):
    """The probe's inputs are decided by the scheme alone: float64 and the model dtype's arithmetic
    pick the same grid point for every element (their values differ at most by a scale and the
    product rounded in the model dtype, three half-ulps < 2**-6 relative; the next grid point is
    >= 1/16 away), and quantizing
    moves every element a large fraction of its grid step (so an engine that skips it cannot land
    within rounding of the specified output)."""
    import dataclasses

    from harness.oracle.probe_inputs import probe_input

    for columns in (160, 200, 37):  # a partial last group of 128 and of 16
        x = probe_input(scheme, stored, columns, 8, dtype, seed=columns)
        assert x.dtype == dtype and x.shape == (8, columns) and torch.isfinite(x).all()
        exact = quantize_activations(x, scheme, stored)
        rounded = quantize_activations(x, dataclasses.replace(scheme, arithmetic="model"), stored)
        assert ((exact.double() - rounded.double()).abs() <= 2**-6 * exact.double().abs()).all()
        if scheme.kind in ("fp8", "mxfp8") and scheme.dynamic:  # a power-of-two scale: nothing to round at all
            assert torch.equal(exact, rounded)
        moved = (exact.double() - x.double()).abs() / x.double().abs().clamp_min(1e-30)
        if scheme.kind in ("fp8", "mxfp8"):
            from harness.oracle.probe_inputs import DYNAMIC_SCALES, MXFP8_AMAX

            top = MXFP8_AMAX if scheme.kind == "mxfp8" else 448
            amaxes = torch.tensor([top * s for s in DYNAMIC_SCALES], dtype=torch.float64)  # each group's amax
            saturated = torch.isin(x.double().abs(), amaxes) if scheme.dynamic else torch.zeros_like(x, dtype=bool)
            # a fraction f of a step 2**(e-3) above 2**e * m, m <= 1.875: at least f / 8 / 1.93 (f = 3/8
            # dynamic, 1/4 static less the model dtype's rounding of x and of its quantized value)
            assert (moved[~saturated] > (0.25 / 8 / 1.93 - 2**-8 if scheme.static else 0.375 / 8 / 1.93)).all()
        else:
            assert float((exact.double() - x.double()).norm() / x.double().norm()) > 0.05


def test_the_activation_probe_judges_bfloat16_where_logits_cannot(session, tmp_path):
    """Dynamic per-token FP8 in bfloat16: the logits of the weight-only forward are within the noise
    of the specified one (no logit-level finding can be claimed), but the probe names the double
    that ignores activations ("not applied", every quantized Linear) and passes the control."""
    generate(Recipe(format="ct-fp8-tensor", arch="llama", layout={"dtype": "bfloat16"}), tmp_path / "c")
    result = evaluate(tmp_path / "c", session)
    probe = {f.engine.rpartition(":")[2]: f for f in result.findings if f.message.startswith("activation probe")}
    assert "activation quantization not applied" in probe["ActivationsIgnoredEngine"].message
    assert len(probe["ActivationsIgnoredEngine"].metrics["modules"]) == 14
    assert set(probe) == {"ActivationsIgnoredEngine"}, {e: f.message for e, f in probe.items()}
    specified = result.outcomes[f"{DOUBLES}:ActivationsAsSpecifiedEngine"]
    assert specified.activation_probe == "14/14 quantized Linear(s) as specified"


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama4"])
def test_the_probe_judges_each_routed_expert_in_float32(session, tmp_path, arch):
    """A float32 MoE checkpoint: the probe runs the packed experts module with every probe row routed
    to one expert at a time (Llama-4's experts: every row to every expert) and judges each expert;
    the double that ignores activations is named for its experts as for its Linears, the control
    passes every expert."""
    recipe = Recipe(format="ct-fp8-tensor", arch=arch, config={"num_hidden_layers": 1}, layout={"dtype": "float32"})
    generate(recipe, tmp_path / "c")
    result = evaluate(tmp_path / "c", session)
    experts = [f for f in result.findings if "routed expert(s)" in f.message]
    assert [f.engine.rpartition(":")[2] for f in experts] == ["ActivationsIgnoredEngine"], [f.message for f in experts]
    assert (
        "activation quantization not applied" in experts[0].message and "at 3/3 routed expert(s)" in experts[0].message
    )
    assert "3/3 routed expert(s) as specified (1/1 packed experts module(s) found)" in (
        result.outcomes[SPECIFIED].activation_probe
    )


def test_the_probe_judges_autorounds_unpacked_experts(real_session, tmp_path):
    """transformers with auto-round holds a Qwen3-MoE's experts unpacked (a ModuleList of per-expert
    MLPs of AutoRound Linears, not transformers' packed module): the probe runs each expert's MLP on
    the reference's rows and judges it as it judges packed experts (it found none before)."""
    recipe = Recipe(
        format="ct-mxfp4", arch="qwen3_moe", config={"num_hidden_layers": 1}, knobs={"scale_storage": "uint8"}
    )
    recipe.layout = {"dtype": "float32", "producer_config": "auto-round"}
    generate(recipe, tmp_path / "c")
    result = evaluate(tmp_path / "c", real_session, engines=["reference", "transformers"])
    assert not result.findings, [(f.engine, f.kind, f.message) for f in result.findings]
    assert result.outcomes["transformers"].activation_probe == (
        "4/4 quantized Linear(s) as specified; 3/3 routed expert(s) as specified (1/1 packed experts module(s) found)"
    )


def test_the_basis_reaches_experts_an_engine_holds_as_linears(real_session, tmp_path):
    """A weight-only Qwen3-MoE (AutoRound's GPTQ packing): the reference packs the experts, auto-round
    holds each as Linears of its own, and the effective-weight probe runs those by the checkpoint's
    per-expert names: 4 attention Linears, the head and 9 expert Linears, where it ran 5 before."""
    recipe = Recipe(format="gptq", arch="qwen3_moe", config={"num_hidden_layers": 1}, knobs={"group_size": 32})
    recipe.layout = {"producer_config": "auto-round"}
    generate(recipe, tmp_path / "c")
    result = evaluate(tmp_path / "c", real_session, engines=["reference", "transformers"])
    assert result.outcomes["transformers"].effective_weights == "14/14 Linear(s) apply the weights placed"


def test_the_probe_names_routed_experts_not_applied_in_bfloat16(session, tmp_path):
    """bfloat16 MoE: an expert's down input rounded in the model dtype moves the specified output
    about as far as quantizing does, so only "not applied" is judged there
    (docs/measurements/expert-probe-precision.json): the double that ignores activations is caught at
    every expert, the control is not judged and never flagged."""
    layout = {"dtype": "bfloat16"}
    recipe = Recipe(format="ct-fp8-tensor", arch="qwen3_moe", config={"num_hidden_layers": 1}, layout=layout)
    generate(recipe, tmp_path / "c")
    result = evaluate(tmp_path / "c", session)
    experts = [f for f in result.findings if "routed expert(s)" in f.message]
    assert [f.engine.rpartition(":")[2] for f in experts] == ["ActivationsIgnoredEngine"], [f.message for f in experts]
    assert "activation quantization not applied" in experts[0].message and "at 3/3 routed" in experts[0].message
    assert "routed experts in a reduced-precision model: 0/3 not applied, the others not judged" in (
        result.outcomes[SPECIFIED].activation_probe
    )


@pytest.mark.parametrize(
    "fmt, knobs",
    [("ct-fp8-tensor", {"input_scale": True}), ("ct-nvfp4", {}), ("modelopt-fp8", {}), ("ct-fp8-block", {})],
)
def test_the_probe_tells_a_wrong_static_scale_from_none_in_bfloat16(session, tmp_path, fmt, knobs):
    """bfloat16: the probe names the double that skips activation quantization ("not applied") and
    the one that reads its static scale in the other convention (what 1/s computes), and nothing else."""
    generate(Recipe(format=fmt, arch="llama", knobs=knobs, layout={"dtype": "bfloat16"}), tmp_path / "c")
    result = evaluate(tmp_path / "c", session)
    probe = {
        f.engine.rpartition(":")[2]: f.message for f in result.findings if f.message.startswith("activation probe")
    }
    assert "not applied" in probe.pop("ActivationsIgnoredEngine")
    if fmt != "ct-fp8-block":  # dynamic groups: no static scale to invert
        assert "static scale in the other convention" in probe.pop("InvertedInputScaleEngine")
    assert not probe, probe


#: the main job's session-9 false alarm: a float16 qwen2 whose one-row up_proj cancels, with static
#: float32 input scales (both engines hold the scale, and each dequantized input, in float16)
CANCELLING = {"hidden_size": 18, "intermediate_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1}


@pytest.mark.parametrize(
    "fmt, knobs, dtype, arch, config",
    [
        ("ct-fp8-tensor", {}, "bfloat16", "llama", {}),
        ("ct-fp8-tensor", {"input_scale": True, "scale_dtype": "float32"}, "bfloat16", "llama", {}),
        ("ct-fp8-channel", {}, "float16", "llama", {}),
        ("ct-nvfp4", {}, "bfloat16", "llama", {}),
        (
            "ct-fp8-channel",
            {"input_scale": True, "scale_dtype": "float32"},
            "float16",
            "qwen2",
            {**CANCELLING, "head_dim": 26},
        ),
    ],
)
def test_transformers_and_compressed_tensors_quantize_every_probed_linear_as_specified(
    real_session, tmp_path, fmt, knobs, dtype, arch, config
):
    """Measured, not assumed: both real engines quantize each Linear's input as the definition does
    on the probe's inputs (with float32 scales the weights sit one ulp off and the probe still
    judges the activation path against the engine's own weights; with a static scale both hold it,
    and each dequantized input value, in the model dtype)."""
    generate(Recipe(format=fmt, arch=arch, config=config, knobs=knobs, layout={"dtype": dtype}), tmp_path / "c")
    result = evaluate(tmp_path / "c", real_session)
    for engine in ("transformers", "compressed-tensors"):
        assert result.outcomes[engine].activation_probe == "14/14 quantized Linear(s) as specified", engine
    assert not [f for f in result.findings if f.kind == "activations"]


def test_an_fp8_kv_cache_option_is_modelled_with_unit_scales_where_none_is_declared(tmp_path):
    """vLLM's `kv_cache_dtype=fp8` on a checkpoint that declares no FP8 cache quantizes it with
    scale 1.0 (harness.oracle.specified.MODELLED_OPTIONS): the reference's model of that forward is
    its own with every layer's cache quantized at unit scales; where the checkpoint declares the
    cache, the option changes nothing."""
    from harness.checkpoints.reader import Checkpoint
    from harness.engines.reference_engine import ReferenceEngine
    from harness.oracle.specified import modelled_option, plan

    assert modelled_option({"kv_cache_dtype": "fp8", "enforce_eager": "false"}) == "kv_cache_dtype=fp8"
    assert modelled_option({"kv_cache_dtype": "fp8_e5m2"}) == "kv_cache_dtype=fp8_e5m2"
    assert modelled_option({"kv_cache_dtype": "auto"}) == modelled_option({"enforce_eager": "false"}) == ""
    for kv_scales in ("none", "self_attn"):
        directory = tmp_path / kv_scales
        layout = {"dtype": "float32", "kv_scales": kv_scales}
        generate(Recipe(format="ct-int4", arch="llama", config={"num_hidden_layers": 2}, layout=layout), directory)
        checkpoint = Checkpoint(directory)
        own, option = plan(checkpoint), plan(checkpoint, "kv_cache_dtype=fp8")
        assert sorted(option.kv) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        if kv_scales == "none":  # weight-only W4A16: no forward of its own beyond the weights
            assert own == "the config quantizes weights only"
            assert all(float(k) == float(v) == 1.0 for k, v in option.kv.values())
            assert option.kv_kind == "fp8" and plan(checkpoint, "kv_cache_dtype=fp8_e5m2").kv_kind == "fp8_e5m2"
        else:
            assert {m: (float(k), float(v)) for m, (k, v) in own.kv.items()} == {
                m: (float(k), float(v)) for m, (k, v) in option.kv.items()
            }
    engine = ReferenceEngine()
    engine.load(str(tmp_path / "none"))
    sequences = [[1, 5, 9, 13, 17, 21, 25, 29]]
    plain = engine.logprobs(sequences)[0]
    cached = engine.activation_logprobs(sequences, "float64|kv_cache_dtype=fp8")[0]
    assert not torch.equal(plain, cached)  # the cache's E4M3 rounding moves the logits...
    assert (plain - cached).abs().max() < 0.5  # ...by rounding, not more
    # an E5M2 cache (2 mantissa bits, not 3) moves them further, still by rounding
    coarser = engine.activation_logprobs(sequences, "float64|kv_cache_dtype=fp8_e5m2")[0]
    assert (plain - cached).abs().max() < (plain - coarser).abs().max() < 1.0
    with pytest.raises(Exception, match="weights only"):
        engine.activation_logprobs(sequences)
