"""The reference's model of online quantization (harness.oracle.online): bit for bit what vLLM's
own online FP8 functions compute, on shapes no block divides; fused parts quantized together."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
import torch

from harness.core.errors import HarnessError
from harness.engines.vllm.engine import find_vllm_python
from harness.oracle import online

VLLM_PYTHON = find_vllm_python()

#: vLLM's own functions against the oracle's, on 200 drawn shapes and magnitudes (zero rows too)
AGAINST_VLLM = textwrap.dedent(
    """
    import torch
    from vllm.model_executor.layers.quantization.online import fp8 as vllm_online
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax
    from vllm.utils.deep_gemm import per_block_cast_to_fp8
    from harness.oracle import online

    torch.manual_seed(0)
    differ = []
    for trial in range(200):
        n, k = torch.randint(1, 400, (2,)).tolist()
        weight = (torch.randn(n, k) * torch.exp(torch.randn(1) * 3)).to(torch.bfloat16)
        if trial % 7 == 0:
            weight[0] = 0
        scale = vllm_online._fp8_channel_scale(weight_amax(weight, dim=-1, keepdim=True))
        codes = vllm_online._fp8_quant_per_channel(weight, scale)
        mine = online.quantize(weight, "fp8_per_channel")
        if not (torch.equal(codes.view(torch.uint8), mine[0].view(torch.uint8)) and torch.equal(scale, mine[1])):
            differ.append(("fp8_per_channel", n, k))
        codes, scale = per_block_cast_to_fp8(weight, block_size=[128, 128], use_ue8m0=False)
        mine = online.quantize(weight, "fp8_per_block")
        if not (torch.equal(codes.view(torch.uint8), mine[0].view(torch.uint8)) and torch.equal(scale, mine[1])):
            differ.append(("fp8_per_block", n, k))
    print("differ", differ)
    """
)


@pytest.mark.skipif(VLLM_PYTHON is None, reason="no vLLM interpreter: set HARNESS_VLLM_PYTHON or `tox -e vllm-cpu`")
@pytest.mark.slow
def test_the_schemes_are_vllms_bit_for_bit():
    run = subprocess.run([VLLM_PYTHON, "-c", AGAINST_VLLM], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "differ []", run.stdout[-2000:]


def test_decode_inverts_quantize_within_half_an_e4m3_step():
    weight = (torch.randn(200, 300, generator=torch.Generator().manual_seed(1)) * 0.05).to(torch.bfloat16)
    for scheme in online.SCHEMES:
        codes, scale = online.quantize(weight, scheme)
        decoded = online.decode(codes, scale, scheme)
        error = (decoded - weight.to(torch.float64)).abs()
        # E4M3 has 3 mantissa bits: half a step is at most 1/16 of the value's binade, and of the scale's amax
        assert float(error.max()) <= float(weight.to(torch.float64).abs().max()) / 16, scheme


def test_fused_parts_share_blocks_per_block_only():
    names = ["m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj"]
    names += ["m.layers.0.self_attn.o_proj", "m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj", "lm_head"]
    assert online.fused_groups(names) == [
        ("m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj"),
        tuple(names[:3]),
        ("lm_head",),
        ("m.layers.0.self_attn.o_proj",),
    ]
    assert online.quantized_linears(names) == sorted(names[:-1])
    generator = torch.Generator().manual_seed(2)
    weights = {name: torch.randn(64, 128, generator=generator).to(torch.bfloat16) for name in names[:3]}
    weights[names[1]] = weights[names[1]] * 100  # k's rows share q's and v's blocks only when fused
    together = online.fake_quantized(weights, "fp8_per_block")
    alone = {name: online.decode(*online.quantize(w, "fp8_per_block"), "fp8_per_block") for name, w in weights.items()}
    assert not torch.equal(together[names[0]], alone[names[0]])  # q's block also holds k's large rows
    per_channel = online.fake_quantized(weights, "fp8_per_channel")
    for name, weight in weights.items():  # a row's scale is its own: fusing changes nothing
        assert torch.equal(
            per_channel[name], online.decode(*online.quantize(weight, "fp8_per_channel"), "fp8_per_channel")
        )


def test_an_unknown_scheme_or_a_scale_of_another_shape_is_one_line():
    with pytest.raises(HarnessError, match="'fp8' is not modelled"):
        online.quantize(torch.zeros(2, 2), "fp8")
    codes, scale = online.quantize(torch.ones(130, 130), "fp8_per_block")
    with pytest.raises(HarnessError, match=r"scales \[1, 2\] for a \[130, 130\] weight, expected \[2, 2\]"):
        online.decode(codes, scale[:1], "fp8_per_block")
