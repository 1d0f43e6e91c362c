"""What vLLM's quantization methods make of a loaded Linear, decoded back to the weight it applies.

`process_weights_after_loading` rewrites a layer once its loaders are done: per-tensor FP8 parts
fused under one scale (the largest) and requantized, NVFP4's per-part global scales reduced to one
and inverted into a multiplier, an `alpha` precomputed for the kernel. Where the kernel itself runs
here the basis probe judges what it applies (harness/differential/effective_weights.py); where it
does not, the tensor-parallel lane's worker runs the method's own processing with the kernel's
step stood in (its repack is the kernel's private layout) and this module decodes what the layer
then holds, a small decoder per layout:

- FP8 `weight` (transposed where vLLM tags `input_dim` 0, or where the method left the `.t()` view
  of the loaded weight untagged, as Quark's FP8 schemes do) times `weight_scale`: one scalar, one per
  row, or a block grid;
- MXFP4 packed `weight` times its E8M0 group scales (read by their bits);
- NVFP4 packed `weight` times its E4M3 group scales times `weight_global_scale` (a multiplier
  after processing), and `alpha` = `input_global_scale` x `weight_global_scale`, whose input
  multiplier must be one the checkpoint stores.
- int4 routed experts that vLLM's EMULATION MoE backend dequantized at load (`w13_weight_packed`,
  `w13_qweight`, ... then hold the weights in bfloat16): read as they are, judged within bfloat16's
  weight tolerance.

Each part's decoded rows are judged against the reference. Exact up to one float32 rounding of a
reciprocal; where the method requantized a per-tensor FP8 Linear under its one kept scale (every
such Linear: fused parts under the largest part scale, an unfused one under its own), each element
may move by half an E4M3 step at that scale after vLLM's float16 dequantization: the bound of one
re-rounding, `requantized_bound`. A layout no decoder reads is said, not judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.core.numerics import decode_e4m3, unpack_e2m1

EXACT, FINDING, UNJUDGED = "exact", "finding", "unjudged"
#: one float32 rounding (a reciprocal or a product), relative, with room for a second
FLOAT32_ROUNDING = 2.0**-22
#: NVFP4's group: one E4M3 scale per 16 columns
NVFP4_GROUP = 16
#: MXFP4's group: one E8M0 scale per 32 columns, stored as bytes or typed
MXFP4_GROUP = 32
E8M0_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
#: how an NVFP4 format stores the activation's global scale: as a divisor or as a multiplier
INPUT_GLOBAL = {"input_global_scale": "divisor", "input_scale": "multiplier"}


@dataclass
class PostLoadVerdict:
    """One vLLM Linear after its method's processing: exact, a finding (which parts apply other
    weights, and by what ratio), or unjudged (the method raised, or no decoder reads its layout)."""

    module: str  # vLLM's fused name: qkv_proj, gate_up_proj, ...
    method: str  # the quantization method or scheme whose processing ran
    status: str
    details: list[str] = field(default_factory=list)
    #: checkpoint module -> its weight's shape, for each part applied wrong
    wrong: dict[str, list[int]] = field(default_factory=dict)

    def line(self) -> str:
        text = f"{self.module} ({self.method}): {self.status}"
        return text + (f": {'; '.join(self.details)}" if self.details else "")


def judge_post_load(report: dict, tensors: dict[str, torch.Tensor], truth) -> list[PostLoadVerdict]:
    """Per worker entry with a `post_load` record (harness.engines.vllm.tensor_parallel.worker),
    its verdict, then one per routed expert's w13 and w2 of each processed FusedMoE
    (`experts_processed`); `truth`: the tensor-parallel judge's Truth of the same layer."""
    from harness.engines.vllm.tensor_parallel.layout import lane_linears

    verdicts = []
    for entry in report["shards"]:
        post = entry.get("post_load")
        if post is None:
            continue
        linear = {linear.name: linear for linear in lane_linears(truth.config, entry["layer"])}[entry["module"]]
        prefix = f"post/tp{entry['tp']}/rank{entry['rank']}/{linear.module(entry['layer'])}."
        held = {name: tensors[prefix + name].to(getattr(torch, meta["dtype"])) for name, meta in post["params"].items()}
        verdicts.append(judge_linear(linear, entry, post, held, truth))
    for record in report.get("experts_processed", []):
        verdicts += judge_experts(record, tensors, truth)
    return verdicts


def judge_linear(linear, entry: dict, post: dict, held: dict[str, torch.Tensor], truth) -> PostLoadVerdict:
    verdict = PostLoadVerdict(linear.name, post["method"], EXACT)
    if post.get("error"):
        verdict.status, verdict.details = UNJUDGED, [f"its processing raised here: {post['error']}"]
        return verdict
    decoded = decode(held, post["params"], entry.get("block"))
    if decoded is None:
        verdict.status = UNJUDGED
        verdict.details = [f"no decoder reads what it holds ({', '.join(sorted(held))})"]
        return verdict
    judge_parts(verdict, linear, entry, decoded, weight_is_fp8(held), truth)
    alpha = alpha_problem(held, linear, entry["layer"], truth)
    if alpha:
        verdict.details.append(alpha)
        verdict.status = FINDING
    return verdict


def judge_experts(record: dict, tensors: dict[str, torch.Tensor], truth) -> list[PostLoadVerdict]:
    """One FusedMoE after its method's processing: each routed expert's slice of the stacked
    parameters (`w13_weight`, `w13_weight_scale` and, for NVFP4, the multiplier `w13_weight_scale_2`;
    w13 is [gate; up]) decoded like a Linear's and judged per part against the rank's slice.
    Without expert parallelism (the only placement processed), expert e sits in slot e."""
    from harness.engines.vllm.tensor_parallel.judge import weight_tolerance
    from harness.engines.vllm.tensor_parallel.layout import lane_linears

    layer, method = record["layer"], record["method"]
    experts = [linear for linear in lane_linears(truth.config, layer) if linear.expert is not None]
    if record.get("error"):
        detail = f"its processing raised here: {record['error']}"
        return [PostLoadVerdict("experts", method, UNJUDGED, [detail])]
    prefix = f"post/tp{record['tp']}/rank{record['rank']}/model.layers.{layer}.experts."
    held = {name: tensors[prefix + name].to(getattr(torch, meta["dtype"])) for name, meta in record["params"].items()}
    verdicts = []
    for linear in experts:
        group = linear.name.rpartition(".")[2]  # w13 or w2
        verdict = PostLoadVerdict(linear.name, method, EXACT)
        dequantized = dequantized_experts(held, group)
        piece, rounding = {}, None
        if dequantized is not None:
            held_as = str(dequantized.dtype).removeprefix("torch.")
            tolerance = weight_tolerance(truth.fmt.name, held_as)
            rounding = tolerance.weight_rel, tolerance.weight_abs
            note = f"dequantized at load (vLLM's EMULATION backend) into {held_as}: judged within {held_as}'s weight tolerance"
            decoded = dequantized[linear.expert].to(torch.float64), None, [note]
        else:
            piece = {
                role: held[f"{group}_{name}"][linear.expert]
                for role, name in (
                    ("weight", "weight"),
                    ("weight_scale", "weight_scale"),
                    ("weight_global_scale", "weight_scale_2"),
                )
                if f"{group}_{name}" in held
            }
            decoded = decode(piece, {"weight": {}}, None)
        if decoded is None:
            verdict.status = UNJUDGED
            verdict.details = [f"no decoder reads what it holds ({', '.join(sorted(held))})"]
        else:
            rows = decoded[0].shape[0] // len(linear.parts)
            entry = {
                "layer": layer,
                "tp": record["tp"],
                "rank": record["rank"],
                "partition_sizes": [rows] * len(linear.parts),
            }
            judge_parts(verdict, linear, entry, decoded, weight_is_fp8(piece), truth, rounding)
        verdicts.append(verdict)
    return verdicts


#: where a WNA16 MoE method keeps its experts' codes (compressed-tensors' `weight_packed`, GPTQ's and
#: AWQ's `qweight`); a floating-point tensor there is the weight itself, dequantized by the method
#: (vLLM's EMULATION backend: [experts, outputs, inputs] in bfloat16, zero points and scales applied)
PACKED_EXPERT_WEIGHTS = ("weight_packed", "qweight")


def dequantized_experts(held: dict[str, torch.Tensor], group: str) -> torch.Tensor | None:
    """`group`'s (w13 or w2) stacked experts where the method holds them dequantized, else None."""
    for name in PACKED_EXPERT_WEIGHTS:
        tensor = held.get(f"{group}_{name}")
        if tensor is not None and tensor.dim() == 3 and tensor.is_floating_point() and tensor.element_size() >= 2:
            return tensor
    return None


def judge_parts(verdict: PostLoadVerdict, linear, entry: dict, decoded, fp8: bool, truth, rounding=None) -> None:
    """Each part's decoded rows against the reference's slice the rank owns: within one float32
    rounding, plus one requantization where an FP8 method kept one scale for parts stored with
    different ones, or within `rounding` ((rel, abs): the weight tolerance of the dtype a method
    dequantized into). Llama-4's q/k rows, which vLLM permutes before loading, are put back first."""
    from harness.engines.vllm.tensor_parallel.judge import cut
    from harness.engines.vllm.tensor_parallel.layout import ROTARY_PERMUTED, owned_slice, unpermute_rotary_rows

    weight, scale_used, notes = decoded
    verdict.details += notes
    layer = entry["layer"]
    # vLLM requantizes every per-tensor FP8 Linear under its one kept scale, an unfused one too (by
    # float16: exact for most weights, not for those in float16's subnormal range)
    requantized = fp8 and scale_used is not None
    architecture = (truth.config.get("architectures") or ["?"])[0]
    permuted = architecture in ROTARY_PERMUTED and linear.kind == "qkv"
    start = 0
    for part, rows in zip(linear.parts, entry["partition_sizes"], strict=False):
        owned = owned_slice(linear, part, entry["tp"], entry["rank"], truth.config)
        reference = truth.reference[linear.reference_name(layer, part)]
        expected = cut(reference, owned) if owned is not None else reference
        applied = weight[start : start + rows]
        start += rows
        if permuted and part.shard_id in ("q", "k"):
            applied = unpermute_rotary_rows(applied, rows // linear.attention.head_dim)
        bound = FLOAT32_ROUNDING * expected.abs()
        if rounding is not None:
            bound = rounding[0] * expected.abs() + rounding[1]
        if requantized:
            bound = bound + requantized_bound(expected, scale_used)
        problem = beyond(applied, expected, bound)
        if problem:
            verdict.details.append(f"{part.name} {problem}")
            verdict.wrong[linear.part_module(layer, part)] = list(reference.shape)
    if verdict.wrong:
        verdict.status = FINDING


def weight_is_fp8(held: dict[str, torch.Tensor]) -> bool:
    return "weight" in held and held["weight"].dtype == torch.float8_e4m3fn


def decode(held: dict[str, torch.Tensor], meta: dict, block) -> tuple[torch.Tensor, float | None, list[str]] | None:
    """(float64 [rows, columns] weight the layer applies, the single weight scale it uses where
    there is one, notes), or None where no decoder reads the layout."""
    weight = held.get("weight")
    if weight is None or weight.dim() != 2:
        return None
    if weight.dtype == torch.float8_e4m3fn:
        if meta["weight"].get("input_dim") == 0 or meta["weight"].get("transposed_view"):  # (K, N) for the kernel
            weight = weight.t()
        scale = held.get("weight_scale", held.get("weight_scale_inv"))
        if scale is None:
            return None
        values = decode_e4m3(weight.contiguous())
        scale = scale.to(torch.float64)
        if scale.numel() == 1:
            return values * scale.reshape(()), float(scale.reshape(())), []
        if scale.numel() == values.shape[0] and not (block and scale.dim() == 2 and scale.shape[0] < scale.numel()):
            # one scale per row; a block grid of one row of blocks ([1, 16] for [16, 256] in 16 x 16
            # blocks) has as many entries, and is a grid
            return values * scale.reshape(-1, 1), None, []
        if scale.dim() == 2 and block:
            rows, columns = values.shape
            grid = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
            return values * grid, None, []
        return None
    if weight.dtype == torch.uint8 and "weight_global_scale" in held and "weight_scale" in held:
        groups = held["weight_scale"]
        if groups.dtype != torch.float8_e4m3fn or groups.shape[0] != weight.shape[0]:
            return None  # a kernel's swizzled group scales: its private layout
        columns = 2 * weight.shape[1]
        product = unpack_e2m1(weight, columns) * decode_e4m3(groups).repeat_interleave(NVFP4_GROUP, dim=1)[:, :columns]
        multiplier = held["weight_global_scale"].to(torch.float64).reshape(-1)
        if multiplier.numel() != 1:
            return None
        return product * multiplier[0], None, []
    if weight.dtype == torch.uint8 and held.get("weight_scale") is not None:  # MXFP4: E8M0 group scales
        from harness.formats.ct_mxfp4 import decode_e8m0

        groups, columns = held["weight_scale"], 2 * weight.shape[1]
        if groups.dtype not in E8M0_DTYPES or list(groups.shape) != [weight.shape[0], columns // MXFP4_GROUP]:
            return None
        return unpack_e2m1(weight, columns) * decode_e8m0(groups).repeat_interleave(MXFP4_GROUP, dim=1), None, []
    return None


def requantized_bound(expected: torch.Tensor, scale: float) -> torch.Tensor:
    """How far one requantization may move each element: vLLM dequantizes a part in float16
    (relative 2**-11, or 2**-25 among float16's subnormals), then rounds to E4M3 at `scale`: half a
    step, 2**-4 of the value among E4M3's normals, 2**-10 * scale among its subnormals."""
    magnitude = expected.abs() * (1 + 2.0**-11) + 2.0**-25
    return 2.0**-4 * magnitude + 2.0**-10 * scale + 2.0**-25


def beyond(applied: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> str | None:
    """None when every element is within `bound`; else how many are not, and applied / expected."""
    if applied.shape != expected.shape:
        return f"is applied with shape {list(applied.shape)} where the checkpoint's is {list(expected.shape)}"
    bad = ~((applied - expected).abs() <= bound)
    if not bad.any():
        return None
    nonzero = bad & (expected != 0) & torch.isfinite(applied)
    ratio = (applied[nonzero] / expected[nonzero]).median().item() if nonzero.any() else float("nan")
    return (
        f"applies other weights than the checkpoint's: {int(bad.sum())}/{bad.numel()} element(s) "
        f"beyond the bound, median ratio applied/checkpoint {ratio:.4g}"
    )


def alpha_problem(held: dict[str, torch.Tensor], linear, layer: int, truth) -> str | None:
    """NVFP4 W4A4: `alpha` must be input_global_scale x weight_global_scale (the kernel's output
    factor), and the input multiplier one the checkpoint stores for a part."""
    if "alpha" not in held or "input_global_scale" not in held or "weight_global_scale" not in held:
        return None
    alpha = float(held["alpha"].to(torch.float64).reshape(-1)[0])
    activation = float(held["input_global_scale"].to(torch.float64).reshape(-1)[0])
    weight = float(held["weight_global_scale"].to(torch.float64).reshape(-1)[0])
    problems = []
    if abs(alpha - activation * weight) > FLOAT32_ROUNDING * abs(activation * weight):
        problems.append(
            f"alpha {alpha:.6g} is not input_global_scale x weight_global_scale ({activation * weight:.6g})"
        )
    candidates = []
    for part in linear.parts:
        for name, convention in INPUT_GLOBAL.items():
            stored = truth.raw.get(f"{linear.part_module(layer, part)}.{name}")
            if stored is not None and stored.numel() == 1:
                value = float(stored.to(torch.float64).reshape(()))
                candidates.append(1 / value if convention == "divisor" else value)
    if candidates and not any(abs(activation - c) <= FLOAT32_ROUNDING * abs(c) for c in candidates):
        problems.append(
            f"input_global_scale {activation:.6g} is no part's activation multiplier "
            f"({', '.join(f'{c:.6g}' for c in candidates)})"
        )
    return "; ".join(problems) or None
