"""Produce int4 (and a few low-bit float) checkpoints with Intel AutoRound, exported as auto_round, gptq and awq.

Standalone producer script: it imports only auto-round, torch, safetensors, transformers (with tokenizers) and the
standard library, never the harness. It builds a tiny random-weight Llama in bfloat16 (and a one-layer Mixtral for
the ``mixtral_`` cases; fixed seed, weights drawn from a seeded generator so they do not depend on the transformers
version's init) and a minimal offline WordLevel tokenizer
(AutoRound refuses a model object without one), then runs ``AutoRound(model, tokenizer, iters=..., dataset=[random
token-id batches], device_map="cpu", seed=0, ...).quantize_and_save(dir, format=...)``. ``iters=0`` is AutoRound's
RTN mode (with its default optimized RTN); one case runs 2 SignRound iterations.

Output: ``OUT/autoround/<case>/`` holding the checkpoint as AutoRound saves it (tokenizer files removed),
``provenance.json`` and ``producer_truth/weights.safetensors``: for each Linear packed to an int format (auto_round,
auto_gptq, auto_awq), the float32 weight [out, in] = (q - z) * s that AutoRound's packer is handed, from its own
integer weight q (round(W / s + z) clamped, as the packer computes it, checked equal to the packed qweight), its
scales s and zero points z (before any storage convention such as GPTQ's z - 1), captured by wrapping the
packers (``auto_round_extension.torch.qlinear_torch[_zp].QuantLinear.pack``, ``WQLinear_GEMM.from_linear``)
and the exports' ``pack_layer`` for the name (observation only; AutoRound's code runs unchanged). The
nvfp4/mxfp4/fp8 auto_round exports go through other packers, not captured (provenance.json says so). Failures per
case go to ``OUT/autoround/FAILED.json``.

Usage: python scripts/producers/autoround_produce.py --out DIR [--only SUBSTRING ...] [--exact]
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import producing  # noqa: E402  (beside this script)
import torch  # noqa: E402
from auto_round import AutoRound  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
)

PRODUCER = "autoround"
SEED = 0
ARCH = "LlamaForCausalLM"
MODEL_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
CALIB_SAMPLES = 8
CALIB_SEQLEN = 32

# case -> (scheme label, export format, AutoRound keyword arguments besides the common ones)
CASES: dict[str, tuple[str, str, dict]] = {
    "w4g128_sym_autoround": ("int4 sym, group 128, RTN", "auto_round", {"iters": 0}),
    "w4g128_asym_autoround": ("int4 asym, group 128, RTN", "auto_round", {"iters": 0, "sym": False}),
    "w4g32_sym_autoround": ("int4 sym, group 32, RTN", "auto_round", {"iters": 0, "group_size": 32}),
    "w4g128_sym_autoround_iters2": ("int4 sym, group 128, SignRound 2 iters", "auto_round", {"iters": 2}),
    "w4g128_sym_plainrtn_autoround": (
        "int4 sym, group 128, plain RTN (opt-RTN off)",
        "auto_round",
        {"iters": 0, "disable_opt_rtn": True},
    ),
    "w4g128_sym_autoround_gptqmodel": ("int4 sym, group 128, RTN", "auto_round:gptqmodel", {"iters": 0}),
    "w4g128_asym_autoround_gptqmodel": (
        "int4 asym, group 128, RTN",
        "auto_round:gptqmodel",
        {"iters": 0, "sym": False},
    ),
    "w8g128_sym_autoround": ("int8 sym, group 128, RTN (W8A16)", "auto_round", {"iters": 0, "bits": 8}),
    "w4g128_mlp_w8g32_autoround": (
        "int4 sym, group 128, the MLP int8 group 32 (layer_config: AutoRound's mixed bits), RTN",
        "auto_round",
        {"iters": 0, "layer_config": {".*mlp.*": {"bits": 8, "group_size": 32}}},
    ),
    "w8g128_sym_autoround_gptqmodel": (
        "int8 sym, group 128, RTN (W8A16)",
        "auto_round:gptqmodel",
        {"iters": 0, "bits": 8},
    ),
    "w8g128_asym_autoround": ("int8 asym, group 128, RTN", "auto_round", {"iters": 0, "bits": 8, "sym": False}),
    "w8g128_sym_gptq": ("int8 sym, group 128, RTN", "auto_gptq", {"iters": 0, "bits": 8}),
    "w4g128_sym_gptq": ("int4 sym, group 128, RTN", "auto_gptq", {"iters": 0}),
    "w4g128_asym_gptq": ("int4 asym, group 128, RTN", "auto_gptq", {"iters": 0, "sym": False}),
    "w4g128_asym_awq": ("int4 asym, group 128, RTN", "auto_awq", {"iters": 0, "sym": False}),
    "nvfp4_autoround": ("nvfp4 (scheme NVFP4), RTN", "auto_round", {"iters": 0, "scheme": "NVFP4"}),
    "mxfp4_autoround": ("mxfp4 (scheme MXFP4), RTN", "auto_round", {"iters": 0, "scheme": "MXFP4"}),
    "fp8_static_autoround": (
        "fp8 weight and static activation (scheme FP8_STATIC), RTN",
        "auto_round",
        {"iters": 0, "scheme": "FP8_STATIC"},
    ),
    "mxfp4_rceil_autoround": ("mxfp4 (scheme MXFP4_RCEIL), RTN", "auto_round", {"iters": 0, "scheme": "MXFP4_RCEIL"}),
    "fp8_block_autoround": (
        "fp8 128x128 blocks (scheme FP8_BLOCK), RTN",
        "auto_round",
        {"iters": 0, "scheme": "FP8_BLOCK"},
    ),
    "mixtral_mxfp4_autoround": (
        "mxfp4 (scheme MXFP4) of a Mixtral, RTN",
        "auto_round",
        {"iters": 0, "scheme": "MXFP4"},
    ),
    "mixtral_w4g128_sym_gptq": (
        "int4 sym, group 128, RTN, GPTQ v1 export (auto_gptq) of a Mixtral",
        "auto_gptq",
        {"iters": 0},
    ),
    "mixtral_w4g128_asym_awq": (
        "int4 asym, group 128, RTN, AWQ GEMM export (auto_awq) of a Mixtral",
        "auto_awq",
        {"iters": 0, "sym": False},
    ),
    "mixtral_fp8_static_autoround": (
        "fp8 weight and static activation (scheme FP8_STATIC) of a Mixtral, RTN",
        "auto_round",
        {"iters": 0, "scheme": "FP8_STATIC"},
    ),
    "qwen3_moe_w4g128_sym_autoround": ("int4 sym, group 128, RTN, of a Qwen3-MoE", "auto_round", {"iters": 0}),
    "qwen3_moe_w4g128_asym_awq": (
        "int4 asym, group 128, RTN, AWQ GEMM export (auto_awq) of a Qwen3-MoE",
        "auto_awq",
        {"iters": 0, "sym": False},
    ),
    "qwen3_moe_fp8_static_autoround": (
        "fp8 weight and static activation (scheme FP8_STATIC) of a Qwen3-MoE, RTN",
        "auto_round",
        {"iters": 0, "scheme": "FP8_STATIC"},
    ),
    "qwen3_moe_nvfp4_autoround": (
        "nvfp4 (scheme NVFP4) of a Qwen3-MoE, RTN",
        "auto_round",
        {"iters": 0, "scheme": "NVFP4"},
    ),
}
#: the architecture of each base model (transformers' config class, its config); a case whose name
#: starts with one of these keys quantizes that model, any other the Llama
MOE_ARCHES = {
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        {**MODEL_CONFIG, "num_hidden_layers": 1, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            **MODEL_CONFIG,
            "num_hidden_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
        },
    ),
}


PACKAGES = ("torch", "auto-round", "transformers", "accelerate", "safetensors", "tokenizers", "huggingface-hub")


def save_tokenizer(directory: Path) -> None:
    """A minimal offline WordLevel tokenizer over the model's 512 ids: <unk>, <s>, </s>, then t3..t511."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, MODEL_CONFIG["vocab_size"])})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.save_pretrained(directory)


def calibration_data() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED + 1)
    shape = (1, CALIB_SEQLEN)
    return [
        {
            "input_ids": torch.randint(3, MODEL_CONFIG["vocab_size"], shape, generator=generator),
            "attention_mask": torch.ones(shape, dtype=torch.long),
        }
        for _ in range(CALIB_SAMPLES)
    ]


CAPTURED: dict[str, torch.Tensor] = {}
# per captured weight: max |AutoRound's in-memory fake-quantized weight (as handed to the packer) - captured truth|
HELD_DIFF: dict[str, float] = {}
PACKING: list[str] = []  # the layer name whose pack_layer is running (innermost last)
PACKERS: set[str] = set()  # "packer class: scales dtype handed to it"


def _unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ-style qweight [K*bits/32, N] (32/bits input rows per int32 word, row p*w+i at bits*i) -> int [K, N]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, per, 1)
    return ((qweight.unsqueeze(1) >> shifts) & (2**bits - 1)).reshape(-1, qweight.shape[1])


def _unpack_awq(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """AWQ GEMM qweight [K, N*bits/32] (nibble i of word w holds column 8w + [0,2,4,6,1,3,5,7][i]) -> int [K, N]."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, 1, per)
    nibbles = (qweight.unsqueeze(2) >> shifts) & (2**bits - 1)  # [K, N/8, i]
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # column j of a word sits in nibble order[j]
    return nibbles[:, :, order].reshape(qweight.shape[0], -1)


def _intweight(weight: torch.Tensor, scales: torch.Tensor, zeros, group_size: int, maxq: int, device) -> torch.Tensor:
    """AutoRound's own integer weight [out, in], computed with the very operations its packers run
    (``auto_round_extension.torch.qlinear_torch*.QuantLinear.pack_248_bits`` and
    ``export_to_awq.utils.WQLinear_GEMM.from_linear``) on the same tensors: round(W / s + z), clamped to [0, maxq].
    `scales`/`zeros` here are [out, groups]; the packer's result is checked against this after it ran."""
    k = weight.shape[1]
    repeat_scales = scales.to(device).repeat_interleave(group_size, 1)
    if isinstance(zeros, torch.Tensor):
        repeat_zeros = zeros.to(device).repeat_interleave(group_size, 1)
        intweight = torch.round(weight.to(device) / repeat_scales[:, :k] + repeat_zeros[:, :k])
    else:
        intweight = torch.round(weight.to(device) / repeat_scales[:, :k] + zeros)
    return intweight.clamp_(0, maxq).to(torch.int32).cpu()


def _record(
    packer: str, linear: torch.nn.Module, intweight: torch.Tensor, scales: torch.Tensor, zeros, group_size: int
) -> None:
    """truth = (q - z) * s in float32, from AutoRound's int weight, scales and zero points as handed to the packer."""
    if not PACKING:
        raise RuntimeError("an AutoRound packer ran outside a wrapped pack_layer: cannot name the weight")
    k = intweight.shape[1]
    s = scales.detach().cpu().float().repeat_interleave(group_size, 1)[:, :k]
    if isinstance(zeros, torch.Tensor):
        z = zeros.detach().cpu().float().repeat_interleave(group_size, 1)[:, :k]
    else:
        z = float(zeros)
    truth = ((intweight.float() - z) * s).contiguous()
    name = f"{PACKING[-1]}.weight"
    if name in CAPTURED:
        raise RuntimeError(f"{name} packed twice")
    CAPTURED[name] = truth
    zero_kind = f"zeros {zeros.dtype}" if isinstance(zeros, torch.Tensor) else f"zero {zeros!r}"
    PACKERS.add(f"{packer} (weight {linear.weight.dtype}, scales {scales.dtype}, {zero_kind})")
    HELD_DIFF[name] = (linear.weight.detach().cpu().float() - truth).abs().max().item()


def install_truth_hooks() -> None:
    """Record, for each Linear AutoRound packs to an int format, the float weight its packed integers, scales and
    zero points stand for (observation only: every wrapper calls the original with the same arguments and returns
    its result; the wrappers only read the inputs and the packed output).

    - ``pack_layer`` of ``export_to_autogptq``, ``export_to_autoround`` and ``export_to_awq``: only to know the
      layer's name while it is packed.
    - ``QuantLinear.pack`` of ``auto_round_extension.torch.qlinear_torch_zp`` (auto_gptq; GPTQ's stored zero - 1)
      and ``qlinear_torch`` (auto_round, packing auto_round:auto_gptq; zero stored as is), and
      ``WQLinear_GEMM.from_linear`` (auto_awq): the integer weight is recomputed from the same (weight, scales,
      zeros) with the packer's own operations, then checked equal to what the packer wrote into qweight."""
    import auto_round.export.export_to_autogptq.export as gptq_export
    import auto_round.export.export_to_autoround.export as autoround_export
    import auto_round.export.export_to_awq.export as awq_export
    from auto_round.export.export_to_awq.utils import WQLinear_GEMM
    from auto_round.utils import get_packing_device
    from auto_round_extension.torch import qlinear_torch, qlinear_torch_zp

    for module in (gptq_export, autoround_export, awq_export):
        original_pack_layer = module.pack_layer

        def pack_layer(*args, _original=original_pack_layer, **kwargs):
            PACKING.append(args[0] if args else kwargs.get("name", kwargs.get("layer_name")))
            try:
                return _original(*args, **kwargs)
            finally:
                PACKING.pop()

        module.pack_layer = functools.wraps(original_pack_layer)(pack_layer)

    for cls in (qlinear_torch.QuantLinear, qlinear_torch_zp.QuantLinear):
        original_pack = cls.pack

        def pack(self, linear, scales, zeros, g_idx=None, device=None, _original=original_pack):
            observe = type(linear) is torch.nn.Linear and self.bits in (2, 4, 8)
            if observe:
                intweight = _intweight(
                    linear.weight.data, scales, zeros, self.group_size, self.maxq, get_packing_device(device)
                )
            result = _original(self, linear, scales, zeros, g_idx, device)
            if observe:
                if not torch.equal(_unpack_rows(self.qweight, self.bits).t(), intweight):
                    raise RuntimeError("the recomputed int weight differs from the one AutoRound packed")
                _record(f"{type(self).__module__}.QuantLinear.pack", linear, intweight, scales, zeros, self.group_size)
            return result

        cls.pack = functools.wraps(original_pack)(pack)

    original_from_linear = WQLinear_GEMM.from_linear.__func__

    def from_linear(cls, linear, w_bit, group_size, init_only=False, scales=None, zeros=None, device=None):
        observe = not init_only and w_bit == 4 and scales is not None and zeros is not None
        if observe:
            group = group_size if group_size != -1 else linear.in_features
            # from_linear takes scales/zeros as [groups, out]; its intweight uses their transpose
            intweight = _intweight(
                linear.weight,
                scales.t(),
                zeros.t() if isinstance(zeros, torch.Tensor) else zeros,
                group,
                2**w_bit - 1,
                get_packing_device(device),
            )
        result = original_from_linear(cls, linear, w_bit, group_size, init_only, scales, zeros, device)
        if observe:
            if not torch.equal(_unpack_awq(result.qweight, w_bit).t(), intweight):
                raise RuntimeError("the recomputed int weight differs from the one AutoRound packed (awq)")
            _record(
                "WQLinear_GEMM.from_linear",
                linear,
                intweight,
                scales.t(),
                zeros.t() if isinstance(zeros, torch.Tensor) else zeros,
                group,
            )
        return result

    WQLinear_GEMM.from_linear = classmethod(functools.wraps(original_from_linear)(from_linear))


def prepare(directory: Path) -> None:
    """The base models (the Llama in `directory`, each of MOE_ARCHES beside it) and the offline
    tokenizer AutoRound's calibration asks for."""
    producing.build_seeded_llama(directory, MODEL_CONFIG, SEED)
    save_tokenizer(directory)
    for arch, (_, config_class, config) in MOE_ARCHES.items():
        producing.build_seeded(directory.parent / arch, config_class, config, SEED)
        save_tokenizer(directory.parent / arch)


def base_of(case: str, base_dir: Path) -> tuple[Path, str, dict]:
    """The base model a case quantizes: its directory, architecture and config."""
    for arch, (architecture, _, config) in MOE_ARCHES.items():
        if case.startswith(f"{arch}_"):
            return base_dir.parent / arch, architecture, config
    return base_dir, ARCH, MODEL_CONFIG


def run_case(case: str, base_dir: Path, out_root: Path) -> None:
    scheme, fmt, kwargs = CASES[case]
    base_dir, architecture, model_config = base_of(case, base_dir)
    case_dir = out_root / PRODUCER / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    started = time.time()
    CAPTURED.clear()
    HELD_DIFF.clear()
    PACKERS.clear()
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    common = {
        "dataset": calibration_data(),
        "nsamples": CALIB_SAMPLES,
        "seqlen": CALIB_SEQLEN,
        "batch_size": 4,
        "device_map": "cpu",
        "seed": SEED,
    }
    with tempfile.TemporaryDirectory(prefix="autoround-save-") as tmp:
        autoround = AutoRound(model, tokenizer=tokenizer, **common, **kwargs)
        autoround.quantize_and_save(tmp, format=fmt)
        saved = [p for p in Path(tmp).rglob("config.json")]
        if len(saved) != 1:
            raise RuntimeError(f"expected one saved checkpoint under the output dir, found {len(saved)}")
        shutil.copytree(saved[0].parent, case_dir)
    for name in TOKENIZER_FILES:
        (case_dir / name).unlink(missing_ok=True)
    files = producing.digests(case_dir)
    if CAPTURED:
        (case_dir / "producer_truth").mkdir()
        truth = producing.saved_names(CAPTURED, case_dir, producing.MIXTRAL_SAVED)
        save_file(dict(sorted(truth.items())), case_dir / "producer_truth" / "weights.safetensors")
    notes = [
        f"base model: tiny random {architecture.removesuffix('ForCausalLM')}, bfloat16, weights ~ N(0, 0.02) "
        "from torch.Generator(seed), norms = 1",
        f"calibration: {CALIB_SAMPLES} random token-id sequences of length {CALIB_SEQLEN} (seed {SEED + 1})",
        "tokenizer: local WordLevel tokenizer (AutoRound requires one); its files are removed from the output",
        "producer_truth: per packed int Linear, float32 (q - z) * s with AutoRound's own integer weight q "
        "(round(W / s + z) clamped to [0, 2^bits - 1], recomputed with its packer's operations on the same tensors "
        "and checked equal to the qweight it packed), and the scales s and zero points z it handed to the packer "
        "(pre-storage: GPTQ's z - 1 and the fp16 cast of stored scales not applied); captured by wrapping "
        "auto_round_extension.torch.qlinear_torch(_zp).QuantLinear.pack, WQLinear_GEMM.from_linear and the "
        "exports' pack_layer (for the name); observation only",
        f"elapsed_s={time.time() - started:.2f}",
    ]
    if PACKERS:
        notes.append(
            "packed by: "
            + "; ".join(sorted(PACKERS))
            + " (the packers store scales as float16: where they were float32 in memory, the files' dequantization "
            "differs from producer_truth by that rounding)"
        )
    if HELD_DIFF:
        notes.append(
            "max |AutoRound's in-memory fake-quantized weight handed to the packer - producer_truth| over all weights: "
            f"{max(HELD_DIFF.values()):.3e}"
        )
    if not CAPTURED:
        notes.append(
            "no producer_truth: this format's packing path (not the int packers qlinear_torch(_zp) / "
            "WQLinear_GEMM) exposes no integer weight, scales and zeros to capture"
        )
    provenance = {
        "producer": "auto-round",
        "producer_version": importlib.metadata.version("auto-round"),
        "packages": producing.package_versions(PACKAGES),
        "case": case,
        "arch": architecture,
        "scheme": scheme,
        "recipe": {
            "AutoRound": {**{k: v for k, v in common.items() if k != "dataset"}, **kwargs},
            "quantize_and_save": {"format": fmt},
            "calibration": {"samples": CALIB_SAMPLES, "seqlen": CALIB_SEQLEN, "seed": SEED + 1},
            "model_config": model_config,
        },
        "command": " ".join([sys.executable, *sys.argv]),
        "seed": SEED,
        "files": files,
        "notes": notes,
    }
    (case_dir / "provenance.json").write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n")


def main() -> int:
    out, cases = producing.chosen_cases(__doc__, PRODUCER, CASES)
    install_truth_hooks()
    return producing.run_cases(PRODUCER, cases, out, prepare, run_case)


if __name__ == "__main__":
    sys.exit(main())
