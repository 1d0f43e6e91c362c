"""gptq and awq: the packing orders from their definitions (hand-built words), the reference against
the quantizer's own truth over every knob, configs as the producers write them (AutoRound's own
format included), refusals. The producers' own output is judged in tests/producers/test_corpus.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from harness.core.errors import Unsupported
from harness.formats import detect_format
from harness.formats.awq import FORMAT as AWQ
from harness.formats.base import FormatError
from harness.formats.gptq import FORMAT as GPTQ
from harness.formats.int_packing import AWQ_ORDER, pack, unpack


def make_weight(shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(shape, generator=generator) * torch.exp(torch.randn(shape, generator=generator))
    weight[0] = 0  # an all-zero row: GPTQ's empty-group range (-1, 1)
    weight[1] = weight[1].abs()  # a one-signed row: asymmetric zero points at the edge
    return weight.to(torch.bfloat16)


def word(nibbles):
    """An int32 from eight nibbles, the first in the lowest bits."""
    value = sum(n << (4 * i) for i, n in enumerate(nibbles))
    return value - 2**32 if value >= 2**31 else value


def test_gptq_packs_eight_inputs_per_word_along_dim_0():
    codes = torch.arange(16).reshape(16, 1) % 16  # [K=16, N=1]: inputs 0..15
    packed = pack(codes, 4, dim=0)
    assert packed.shape == (2, 1) and packed[:, 0].tolist() == [word(range(8)), word(range(8, 16))]
    assert torch.equal(unpack(packed, 4, 16, dim=0), codes)


def test_awq_interleaves_the_outputs_of_each_word():
    """The nibble at bits 4i holds output 8w + AWQ_ORDER[i] (AutoAWQ's pack)."""
    codes = torch.arange(8).reshape(1, 8)  # one input row, outputs 0..7 with codes 0..7
    packed = pack(codes, 4, dim=1, order=AWQ_ORDER)
    assert packed.tolist() == [[word([0, 2, 4, 6, 1, 3, 5, 7])]]
    assert torch.equal(unpack(packed, 4, 8, dim=1, order=AWQ_ORDER), codes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("extent", [1, 7, 8, 9, 33])
def test_packing_round_trips_with_a_padded_last_word(bits, extent):
    codes = torch.randint(0, 2**bits, (3, extent), generator=torch.Generator().manual_seed(extent))
    for dim, order in [(1, None), (1, AWQ_ORDER if bits == 4 else None), (0, None)]:
        source = codes.T.contiguous() if dim == 0 else codes
        assert torch.equal(unpack(pack(source, bits, dim, order), bits, extent, dim, order), source)


GPTQ_KNOBS = [
    dict(zip(("bits", "group_size", "sym", "desc_act", "checkpoint_format"), values, strict=False))
    for values in itertools.product((4, 8), (32, 128, -1), (True, False), (False, True), ("gptq", "gptq_v2"))
]


@pytest.mark.parametrize("knobs", GPTQ_KNOBS, ids=lambda k: "-".join(str(v) for v in k.values()))
@pytest.mark.parametrize("shape", [(16, 256), (24, 96), (9, 50)])
def test_gptq_reference_equals_the_quantizers_truth(knobs, shape):
    resolved = GPTQ.resolve_knobs(knobs)
    result = GPTQ.quantize(make_weight(shape, sum(shape)), resolved, model_dtype=torch.bfloat16, activation_amax=1.0)
    read = GPTQ.knobs_from_config(GPTQ.quantization_config(resolved, ["lm_head"]))
    assert read == {k: v for k, v in resolved.items() if k != "scale_storage"}  # the tensors say that
    assert torch.equal(GPTQ.dequantize(result.tensors, read), result.truth)
    rows, cols = shape
    per = 32 // knobs["bits"]
    assert result.tensors["qweight"].shape == (math.ceil(cols / per), rows)
    assert result.expectation == ("exact" if rows % per == 0 and cols % per == 0 else "exact-or-refuse")
    g_idx = result.tensors["g_idx"]
    if knobs["desc_act"] and knobs["group_size"] != -1 and cols > knobs["group_size"]:
        assert not torch.equal(g_idx, torch.arange(cols, dtype=torch.int32) // knobs["group_size"])
    if not knobs["desc_act"]:  # without act-order, g_idx is k // group and may be left out
        without = {k: v for k, v in result.tensors.items() if k != "g_idx"}
        if cols % per == 0:
            assert torch.equal(GPTQ.dequantize(without, read), result.truth)


def test_act_order_is_one_order_per_input_as_a_producer_writes_it(tmp_path):
    """GPTQ ranks inputs by the Hessian of the activations a Linear reads: q/k/v share one g_idx,
    gate/up another (each a permutation of whole groups, not k // group), as GPTQModel writes them."""
    from harness.checkpoints.reader import Checkpoint
    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import generate

    recipe = Recipe(
        format="gptq", arch="llama", config={"num_hidden_layers": 1}, knobs={"desc_act": True, "group_size": 32}
    )
    generate(recipe, tmp_path)
    checkpoint = Checkpoint(tmp_path)
    layer = "model.layers.0"
    for parts in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        first, *others = (checkpoint.tensor(f"{layer}.{part}.g_idx") for part in parts)
        assert all(torch.equal(first, other) for other in others), parts
        assert torch.equal(torch.bincount(first.long()), torch.full((len(first) // 32,), 32))
        assert not torch.equal(first, torch.arange(len(first), dtype=torch.int32) // 32)


def test_gptq_v1_stores_every_zero_point_minus_one():
    weight = make_weight((16, 128), 3)
    v1, v2 = (
        GPTQ.quantize(
            weight,
            GPTQ.resolve_knobs({"sym": False, "checkpoint_format": f}),
            model_dtype=torch.bfloat16,
            activation_amax=1,
        )
        for f in ("gptq", "gptq_v2")
    )
    stored1, z2 = (unpack(r.tensors["qzeros"], 4, 16, dim=1) for r in (v1, v2))
    z1 = stored1 + 1
    kept = z2 >= 1  # v1 cannot store a zero point of 0 (z - 1 = -1): its quantizer keeps z >= 1
    assert torch.equal(z1[kept], z2[kept]) and bool((z1[~kept] == 1).all()) and not bool(kept.all())
    rows = kept.all(dim=0)  # outputs whose zero points agree quantize alike
    assert torch.equal(v1.truth[rows], v2.truth[rows])
    symmetric = GPTQ.quantize(weight, GPTQ.resolve_knobs({}), model_dtype=torch.bfloat16, activation_amax=1)
    assert set(unpack(symmetric.tensors["qzeros"], 4, 16, dim=1).flatten().tolist()) == {7}  # 8 - 1


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("shape", [(16, 256), (9, 100), (8, 20)])
def test_awq_reference_equals_the_quantizers_truth(group, shape):
    knobs = AWQ.resolve_knobs({"group_size": group})
    result = AWQ.quantize(make_weight(shape, group), knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    assert AWQ.knobs_from_config(AWQ.quantization_config(knobs, ["lm_head"])) == {"group_size": group}
    assert torch.equal(AWQ.dequantize(result.tensors, knobs), result.truth)
    assert result.expectation == ("exact" if shape[0] % 8 == 0 else "exact-or-refuse")


def test_configs_as_producers_write_them():
    autogptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    assert detect_format(autogptq) is GPTQ and GPTQ.knobs_from_config(autogptq)["checkpoint_format"] == "gptq"
    auto_round = {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": True, "data_type": "int"}
    assert detect_format(auto_round | {"packing_format": "auto_round:auto_gptq"}) is GPTQ
    assert (
        GPTQ.knobs_from_config(auto_round | {"packing_format": "auto_round:auto_gptq"})["checkpoint_format"] == "gptq"
    )
    assert GPTQ.knobs_from_config(auto_round)["checkpoint_format"] == "gptq_v2"  # its own default packing
    awq = auto_round | {"packing_format": "auto_round:auto_awq", "sym": False}
    assert detect_format(awq) is AWQ and AWQ.knobs_from_config(awq) == {"group_size": 32}
    with pytest.raises(Unsupported):
        detect_format(auto_round | {"packing_format": "auto_round:llm_compressor"})
    for config, message in [
        (autogptq | {"bits": 3}, "bits=3"),
        (autogptq | {"checkpoint_format": "marlin"}, "marlin"),
        (autogptq | {"static_groups": True}, "static_groups"),
        ({"quant_method": "awq", "version": "gemv"}, "gemv"),
        ({"quant_method": "awq", "zero_point": False}, "zero_point"),
    ]:
        fmt = detect_format(config)
        with pytest.raises(Unsupported, match=message):
            fmt.knobs_from_config(config)


def test_malformed_tensors_raise_one_line():
    knobs = GPTQ.resolve_knobs({"group_size": 32})
    tensors = GPTQ.quantize(make_weight((16, 64)), knobs, model_dtype=torch.bfloat16, activation_amax=1.0).tensors
    nan = tensors["scales"].clone()
    nan[0, 0] = math.nan
    for change, message in [
        ({"qweight": tensors["qweight"].to(torch.int64)}, "qweight has dtype"),
        ({"qweight": tensors["qweight"][:-1]}, "qweight has shape"),
        ({"qzeros": tensors["qzeros"][:, :1]}, "qzeros has shape"),
        ({"scales": tensors["scales"][:1]}, "scales has shape"),
        ({"scales": nan}, "non-finite"),
        ({"g_idx": tensors["g_idx"] + 5}, "g_idx holds groups"),
        ({"g_idx": tensors["g_idx"].reshape(2, -1)}, "g_idx has shape"),
    ]:
        with pytest.raises(FormatError, match=message) as raised:
            GPTQ.dequantize({**tensors, **change}, knobs)
        assert "\n" not in str(raised.value)
    awq = AWQ.quantize(
        make_weight((16, 64)), AWQ.resolve_knobs({"group_size": 32}), model_dtype=torch.bfloat16, activation_amax=1
    )
    with pytest.raises(FormatError, match="qzeros has shape"):
        AWQ.dequantize({**awq.tensors, "qzeros": awq.tensors["qzeros"][:1]}, {"group_size": 32})
    with pytest.raises(FormatError, match="missing tensor 'scales'"):
        AWQ.dequantize({k: v for k, v in awq.tensors.items() if k != "scales"}, {"group_size": 32})


@pytest.mark.parametrize("storage", ["bfloat16", "float32"])
@pytest.mark.parametrize("fmt", [GPTQ, AWQ], ids=lambda f: f.name)
def test_scales_stored_in_another_dtype_read_back_the_truth(fmt, storage):
    """scale_storage: the codes are computed against the scale as stored, in its dtype."""
    knobs = fmt.resolve_knobs({"scale_storage": storage})
    result = fmt.quantize(make_weight((16, 256), 5), knobs, model_dtype=torch.bfloat16, activation_amax=1.0)
    assert result.tensors["scales"].dtype == getattr(torch, storage)
    assert torch.equal(fmt.dequantize(result.tensors, fmt.resolve_knobs({})), result.truth)
    default = fmt.quantize(
        make_weight((16, 256), 5), fmt.resolve_knobs({}), model_dtype=torch.bfloat16, activation_amax=1.0
    )
    assert not torch.equal(default.truth, result.truth)  # float16 scales round otherwise


@pytest.mark.parametrize("group", [32, -1])
def test_a_g_idx_of_k_over_g_is_redundant_an_act_order_one_is_not(group):
    """A g_idx that says what its absence would (k // g, or 0 for one group) may be left unread by
    a loader without act-order (auto-round's plain QuantLinear); a permuted one may not."""
    knobs = GPTQ.resolve_knobs({"group_size": group})
    plain = GPTQ.quantize(make_weight((16, 64)), knobs, model_dtype=torch.bfloat16, activation_amax=1.0).tensors
    assert GPTQ.redundant(plain, knobs) == {"g_idx"}
    assert GPTQ.redundant({k: v for k, v in plain.items() if k != "g_idx"}, knobs) == set()
    if group != -1:
        ordered = GPTQ.resolve_knobs({"group_size": group, "desc_act": True})
        permuted = GPTQ.quantize(make_weight((16, 64)), ordered, model_dtype=torch.bfloat16, activation_amax=1.0)
        assert GPTQ.redundant(permuted.tensors, ordered) == set()
    assert AWQ.redundant(plain, knobs) == set()  # the base: nothing is redundant
