"""A known issue's preconditions (`when` in cases/known_issues.toml): small expressions over what
is known about the checkpoint and the module a finding is about. They are parsed once, when the
file is loaded, by a whitelist over Python's `ast` (never `eval`): names, numbers, strings,
True/False, + - * / // %, comparisons (`in` / `not in` a tuple or list), and/or/not. Anything
else, or a name no context defines, is an error at load. At match time a name the context lacks
makes the predicate false: no precondition, no attribution."""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.core.findings import Finding
from harness.core.machine import isa_class

#: config.json fields in the context (every scalar top-level field is; these are promised, the
#: quantization_config's two where it has them)
CONFIG_NAMES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "vocab_size",
    "model_type",
    "dtype",
    "quant_method",  # quantization_config's, e.g. "modelopt", "compressed-tensors", "fp8"
    "packing_format",  # quantization_config's, AutoRound's (e.g. "auto_round:auto_awq"); absent elsewhere
    # compressed-tensors' weight strategy ("tensor", "channel", "group", "block") and weight num_bits
    # where every config group declares the same one; absent elsewhere
    "weight_strategy",
    "weight_bits",
)
#: derived from the config: bytes per element of its dtype, and one routed expert's intermediate
#: size under whatever field the architecture keeps it (Mixtral's intermediate_size, the others'
#: moe_intermediate_size); only for a registered mixture-of-experts architecture
#: `isa`: this machine's instruction-set class (harness.core.machine.isa_class: amx-fp8, amx,
#: avx512-bf16, avx512, avx2), for an engine whose kernel, and so whose bug, depends on it
#: `dynamic_exclusions`: how many modules a GPTQModel config leaves unquantized through `-:` rules of
#: its quantization_config's `dynamic` (0 without any)
DERIVED_NAMES = ("dtype_bytes", "expert_width", "isa", "dynamic_exclusions")
#: read from the stored tensors, for any checkpoint: whether the parts a serving engine fuses into one
#: Linear (q/k/v, gate/up) store different per-tensor global scales (NVFP4's weight_global_scale or
#: weight_scale_2), which such an engine must requantize or refuse (stored_facts)
STORED_NAMES = ("fused_global_scales_differ",)
#: read from the checkpoint (its manifest, or GPTQ/AWQ tensors' headers): the largest power of two
#: (at most ALIGNMENT_CAP) dividing every quantized Linear's input width, and its output width. A
#: kernel that needs whole groups of g inputs, or outputs in multiples of 16, fails where it is
#: below that (`input_alignment < group_size`): whatever the architecture calls the width
#: (DeepSeek's kv_lora_rank, an expert's moe_intermediate_size)
ALIGNMENT_NAMES = ("input_alignment", "output_alignment")
ALIGNMENT_CAP = 1024
#: fused parts by the first part's module name, as vLLM and SGLang fuse them
FUSED_PARTS = {
    "q_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_proj": ("gate_proj", "up_proj"),
    "q_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # DeepSeek's fused_qkv_a_proj
    "w1": ("w1", "w3"),  # Mixtral's experts: w13
}
GLOBAL_SCALES = ("weight_global_scale", "weight_scale_2")
#: names of a finding about one module (weight-mismatch etc.); `stand_in`: found by running vLLM's
#: loaders with stand-in kernels where it has none here (harness.differential.stand_in)
MODULE_NAMES = ("rows", "cols", "block_rows", "block_cols", "partial", "expert", "tp", "parallel", "stand_in")
#: the options of the engine a finding is about (harness.engines.options), as `when` names; its
#: `dtype` option as `model_dtype`, the dtype the engine computes in (the checkpoint's without one;
#: `dtype` is the checkpoint's)
MODULE_NAMES += ("kv_cache_dtype", "enforce_eager", "model_dtype")

BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
COMPARISONS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
UNARY: dict[type, Callable[[Any], Any]] = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}


def known_names() -> frozenset[str]:
    """Every name a context can hold: config fields, every registered format's knobs, the
    recipe's layout and perturbations, and the module names."""
    from harness.checkpoints.architectures import ARCHITECTURES, TINY_DEFAULTS
    from harness.checkpoints.recipe import LAYOUT_DEFAULTS, PERTURB_DEFAULTS
    from harness.formats import FORMAT_NAMES, get_format

    names = (
        set(CONFIG_NAMES)
        | set(DERIVED_NAMES)
        | set(STORED_NAMES)
        | set(ALIGNMENT_NAMES)
        | set(TINY_DEFAULTS)
        | set(LAYOUT_DEFAULTS)
        | set(PERTURB_DEFAULTS)
        | set(MODULE_NAMES)
    )
    for arch in ARCHITECTURES.values():
        names |= set(arch.extra_defaults)
    for name in FORMAT_NAMES:
        names |= set(get_format(name).knobs)
    return frozenset(names)


class _Missing(Exception):
    """A name the context lacks: the predicate is false."""


@dataclass(frozen=True)
class Predicate:
    text: str
    tree: ast.Expression
    names: frozenset[str]

    @classmethod
    def parse(cls, text: str, where: str, allowed: frozenset[str] | None = None) -> Predicate:
        """Check `text` against the whitelist (and its names against `allowed`); HarnessError
        naming `where` (the entry) on anything else."""
        if not isinstance(text, str):
            raise HarnessError(f"{where}: a precondition must be a string, got {text!r}")
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as error:
            raise HarnessError(f"{where}: precondition {text!r} is not an expression ({error.msg})") from None
        names: set[str] = set()
        _check(tree.body, text, where, names)
        unknown = sorted(names - allowed) if allowed is not None else []
        if unknown:
            raise HarnessError(
                f"{where}: precondition {text!r} names {', '.join(unknown)}, which no checkpoint or finding "
                "defines (see the names at the top of cases/known_issues.toml)"
            )
        return cls(text, tree, frozenset(names))

    def holds(self, context: Mapping[str, Any]) -> bool:
        """True when the expression is truthy in `context`; a name it lacks, or values that do
        not compute (a string minus a number, a division by zero), make it false."""
        try:
            return bool(_evaluate(self.tree.body, context))
        except (_Missing, ArithmeticError, TypeError, ValueError):
            return False


def _check(node: ast.AST, text: str, where: str, names: set[str], container: bool = False) -> None:
    def refuse(what: str) -> None:
        raise HarnessError(
            f"{where}: precondition {text!r}: {what} is not allowed (names, numbers, "
            "strings, True/False, + - * / // %, comparisons, in/not in a tuple or list, and/or/not)"
        )

    if isinstance(node, ast.Name):
        names.add(node.id)
    elif isinstance(node, ast.Constant):
        if not isinstance(node.value, (bool, int, float, str)):
            refuse(f"the constant {node.value!r}")
    elif isinstance(node, (ast.Tuple, ast.List)):
        if not container:
            refuse("a tuple or list outside `in` / `not in`")
        for element in node.elts:
            _check(element, text, where, names)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            _check(value, text, where, names)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        _check(node.operand, text, where, names)
    elif isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        _check(node.left, text, where, names)
        _check(node.right, text, where, names)
    elif isinstance(node, ast.Compare) and all(type(op) in COMPARISONS for op in node.ops):
        _check(node.left, text, where, names)
        for op, right in zip(node.ops, node.comparators, strict=True):
            _check(right, text, where, names, container=isinstance(op, (ast.In, ast.NotIn)))
    else:
        refuse(f"`{ast.unparse(node)}` ({type(node).__name__})")


def _number(value: Any) -> Any:
    if isinstance(value, (int, float)):
        return value
    raise TypeError(f"arithmetic on {type(value).__name__}")


def _evaluate(node: ast.AST, context: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Name):
        if node.id not in context:
            raise _Missing(node.id)
        return context[node.id]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(_evaluate(e, context) for e in node.elts)
    if isinstance(node, ast.BoolOp):
        value = None
        for part in node.values:
            value = _evaluate(part, context)
            if bool(value) == isinstance(node.op, ast.Or):  # short-circuit as Python does
                return value
        return value
    if isinstance(node, ast.UnaryOp):
        operand = _evaluate(node.operand, context)
        return UNARY[type(node.op)](operand if isinstance(node.op, ast.Not) else _number(operand))
    if isinstance(node, ast.BinOp):  # numbers only: no string repetition or concatenation
        return BINARY[type(node.op)](_number(_evaluate(node.left, context)), _number(_evaluate(node.right, context)))
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, context)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _evaluate(comparator, context)
            if not COMPARISONS[type(op)](left, right):
                return False
            left = right
        return True
    raise TypeError(f"unexpected {type(node).__name__}")  # _check refused it at load


def _scalars(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if isinstance(v, (bool, int, float, str))}


def checkpoint_context(directory: str | Path) -> dict[str, Any]:
    """What is known about a checkpoint: its config.json's scalar fields (`dtype` from dtype or
    torch_dtype, default bfloat16 as the runner judges; `head_dim` defaulting to hidden_size //
    num_attention_heads), its quantization_config's quant_method and the format knobs it declares and, for a checkpoint
    the harness generated, its recipe's resolved knobs, layout and perturbations. What cannot be
    read is left out (the predicates naming it are then false)."""
    from harness.checkpoints.manifest import read_manifest
    from harness.checkpoints.recipe import Recipe
    from harness.checkpoints.writer import MANIFEST_FILE
    from harness.oracle.reference import format_and_knobs

    directory = Path(directory)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        return {}
    context: dict[str, Any] = {}
    try:
        fmt, knobs = format_and_knobs(directory)
        context |= _scalars(knobs)
        if fmt.groups(knobs):
            context[SCHEMES] = scheme_contexts(fmt.groups(knobs))
    except (HarnessError, OSError, ValueError):
        pass
    if (
        directory / MANIFEST_FILE
    ).is_file():  # what the generator did, perturbations included, over what config declares
        try:
            resolved = Recipe.from_json(read_manifest(directory)["recipe"]).resolved()
            context |= _scalars(resolved.knobs) | _scalars(resolved.layout) | _scalars(resolved.perturb)
        except (HarnessError, KeyError, TypeError):
            pass
    else:  # a checkpoint the harness did not write: the same facts, read from the checkpoint itself
        context |= observed_facts(directory)
    context |= _scalars(config)
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict) and isinstance(quantization.get("quant_method"), str):
        context["quant_method"] = quantization["quant_method"]
        if isinstance(quantization.get("packing_format"), str):
            context["packing_format"] = quantization["packing_format"]
        context |= weight_scheme(quantization)
    context["dtype"] = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    context |= derived_facts(config, context["dtype"])
    context |= stored_facts(directory)
    context |= alignment_facts(directory)
    context["isa"] = isa_class()
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if config.get("head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        context["head_dim"] = hidden // heads
    return context


#: the context key of a mixed checkpoint's config groups (harness.formats.mixed): a list of (format
#: name, the facts of its knobs and weights), one per group; no predicate names it
SCHEMES = "_schemes"


def scheme_contexts(groups) -> list[tuple[str, dict[str, Any]]]:
    """Each config group of a mixed checkpoint (QuantFormat.groups) as (its format's name, the scalar
    knobs it reads with and the weight scheme it declares): what a known issue of that format is
    judged by on its modules."""
    return [(group.fmt.name, _scalars(group.knobs) | weight_scheme(group.config)) for group in groups]


def weight_scheme(quantization: dict) -> dict[str, Any]:
    """{"weight_strategy": ..., "weight_bits": ...}, each where every config group of a
    compressed-tensors config declares the same one (strategy, num_bits); empty otherwise."""
    groups = quantization.get("config_groups")
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)] if isinstance(groups, dict) else []
    scheme = {}
    for name, key, kind in (("weight_strategy", "strategy", str), ("weight_bits", "num_bits", int)):
        values = {w.get(key) for w in weights if isinstance(w, dict)}
        (value,) = values if len(values) == 1 else (None,)
        if isinstance(value, kind) and not isinstance(value, bool):
            scheme[name] = value
    return scheme


def stored_facts(directory: Path) -> dict[str, Any]:
    """STORED_NAMES, read from the checkpoint's per-tensor global scales (empty where it has none)."""
    import torch

    from harness.checkpoints.reader import Checkpoint

    try:
        checkpoint = Checkpoint(directory)
        names = set(checkpoint.names())
        if not any(name.endswith(GLOBAL_SCALES) for name in names):
            return {}
        for name in sorted(names):
            module, _, suffix = name.rpartition(".")
            parent, _, first = module.rpartition(".")
            if suffix not in GLOBAL_SCALES or first not in FUSED_PARTS:
                continue
            parts = [f"{parent}.{part}.{suffix}" for part in FUSED_PARTS[first]]
            if all(part in names for part in parts):
                values = {checkpoint.tensor(part).to(torch.float64).reshape(-1)[0].item() for part in parts}
                if len(values) > 1:
                    return {"fused_global_scales_differ": True}
    except (HarnessError, OSError, ValueError):
        return {}
    return {"fused_global_scales_differ": False}


def alignment_facts(directory: Path) -> dict[str, Any]:
    """ALIGNMENT_NAMES from every quantized Linear's [outputs, inputs] (empty where none is known)."""
    shapes = linear_shapes(directory)
    if not shapes:
        return {}
    return {
        "input_alignment": min(power_of_two_dividing(cols) for _, cols in shapes),
        "output_alignment": min(power_of_two_dividing(rows) for rows, _ in shapes),
    }


def power_of_two_dividing(width: int) -> int:
    """The largest power of two dividing `width`, at most ALIGNMENT_CAP (0: ALIGNMENT_CAP)."""
    return min(width & -width, ALIGNMENT_CAP) if width else ALIGNMENT_CAP


def linear_shapes(directory: Path) -> list[tuple[int, int]]:
    """Each quantized Linear's [outputs, inputs]: as the harness's manifest records them, or, for a
    GPTQ/AWQ checkpoint it did not write, from its tensors' headers (GPTQ: g_idx's length, or
    qweight's packed rows, by scales' columns; AWQ: qweight's rows by scales' columns)."""
    from harness.checkpoints.manifest import read_manifest
    from harness.checkpoints.reader import Checkpoint
    from harness.checkpoints.writer import MANIFEST_FILE

    try:
        if (directory / MANIFEST_FILE).is_file():
            shapes = [info.get("shape") or [] for info in read_manifest(directory)["modules"].values()]
            return [tuple(shape) for shape in shapes if len(shape) == 2]  # an orphan scale's module has none
        checkpoint = Checkpoint(directory)
        quantization = checkpoint.quantization_config
        shapes = {n: checkpoint.headers[checkpoint.shard_of(n)][n]["shape"] for n in checkpoint.weight_map}
    except (HarnessError, OSError, ValueError, KeyError, TypeError):
        return []
    method, bits = quantization.get("quant_method"), quantization.get("bits", 4)
    if method not in ("gptq", "awq") or bits not in (4, 8):
        return []
    result = []
    for name, shape in shapes.items():
        module, _, suffix = name.rpartition(".")
        scales = shapes.get(f"{module}.scales")
        if suffix != "qweight" or len(shape) != 2 or not scales or len(scales) != 2:
            continue
        g_idx = shapes.get(f"{module}.g_idx")
        cols = shape[0] if method == "awq" else g_idx[0] if g_idx else shape[0] * 32 // bits
        result.append((scales[1], cols))
    return result


def derived_facts(config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """DERIVED_NAMES from a config.json (those it cannot give are left out)."""
    from harness.checkpoints.architectures import architecture_for
    from harness.core.dtypes import MODEL_DTYPES

    facts: dict[str, Any] = {}
    if dtype in MODEL_DTYPES:
        facts["dtype_bytes"] = MODEL_DTYPES[dtype].itemsize
    arch = architecture_for(str(config.get("model_type", "")))
    if arch is not None and arch.moe is not None and isinstance(config.get(arch.moe.intermediate_key), int):
        facts["expert_width"] = config[arch.moe.intermediate_key]
    quantization = config.get("quantization_config")
    dynamic = quantization.get("dynamic") if isinstance(quantization, dict) else None
    facts["dynamic_exclusions"] = sum(str(key).startswith("-:") for key in dynamic) if isinstance(dynamic, dict) else 0
    return facts


def observed_facts(directory: Path) -> dict[str, Any]:
    """What a recipe would say of a checkpoint the harness did not write, as the audit reads it
    (harness.oracle.audit): a non-finite scale (`nonfinite_scale`), an NVFP4 global scale in the
    other convention (`global_scale_convention`), keys under the VLM prefix (`key_prefix`), experts
    under a naming other than the architecture's own (`expert_naming`), the KV scales' naming
    (`kv_scales`), a head or embeddings stored with scales (`quantize_lm_head`, `quantize_embeddings`),
    a config.json as transformers saves it (`config_style`), enum values in another letter case than
    their producers' (`config_spelling`), a producer's own config over a defined format's tensors
    (`producer_config`)."""
    from harness.checkpoints.foreign_configs import producer_config_of
    from harness.checkpoints.reader import Checkpoint
    from harness.core.naming import VLM_PREFIX, canonical_name
    from harness.formats.spelling import canonical
    from harness.oracle.audit import audit_checkpoint

    facts: dict[str, Any] = {}
    try:
        audit = audit_checkpoint(directory)
        names = Checkpoint(directory).names()
    except (HarnessError, OSError, ValueError):
        return facts
    for item in audit.findings:
        if item.check == "scale-values" and "non-finite" in item.reason:
            facts["nonfinite_scale"] = "inf" if re.search(r": -?inf\)", item.reason) else "nan"
        elif item.check == "global-scale":
            facts["global_scale_convention"] = "swapped"
        elif item.check == "names" and item.reason.startswith("an expert named"):
            facts["expert_naming"] = "projections"
    if any(name.startswith(VLM_PREFIX) for name in names):
        facts["key_prefix"] = VLM_PREFIX
    naming = kv_naming(names)
    if naming:
        facts["kv_scales"] = naming
    config = audit_config(directory)
    if _saved_by_transformers(config):
        facts["config_style"] = "saved"
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict) and canonical(quantization) != quantization:
        facts["config_spelling"] = "other-case"
    if isinstance(quantization, dict):
        facts["producer_config"] = producer_config_of(quantization)
    if any(canonical_name(name).startswith("lm_head.") and "scale" in name for name in names):
        facts["quantize_lm_head"] = True
    if any(canonical_name(name).startswith("model.embed_tokens.") and "scale" in name for name in names):
        facts["quantize_embeddings"] = True
    return facts


def audit_config(directory: Path) -> dict:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _saved_by_transformers(config: Mapping[str, Any]) -> bool:
    """A registered architecture's config.json without a field its release writes and transformers'
    save_pretrained drops (harness.checkpoints.architectures: release_only)."""
    from harness.checkpoints.architectures import architecture_for

    arch = architecture_for(str(config.get("model_type", "")))
    return bool(arch and arch.release_only and any(key not in config for key in arch.release_only))


#: the generator's KV-scale namings (harness.checkpoints.kv_scales) by the key scale's name ending
_KV_NAMINGS = {"self_attn.k_scale": "self_attn", "k_proj.output_scale": "output_scale", "k_proj.k_scale": "proj"}


def kv_naming(names: list[str]) -> str | None:
    """The KV-scale naming a checkpoint's tensors use (`k-only` where keys have no value scales,
    `v-only` where values have no key scales)."""
    for ending, naming in _KV_NAMINGS.items():
        keys = [n for n in names if n.endswith(ending)]
        if keys:
            values = ending.replace("k_", "v_")
            return naming if any(n.endswith(values) for n in names) or naming != "self_attn" else "k-only"
    return "v-only" if any(n.endswith("self_attn.v_scale") for n in names) else None


def module_context(finding: Finding) -> dict[str, Any]:
    """A finding about one weight: its shape (rows, cols) and scale block (block_rows,
    block_cols), `partial`: a dimension is not a multiple of the block, `expert`: the module
    is one of a mixture's experts, `tp`: the tensor-parallel size it was found at (or the
    expert-parallel size), `parallel`: which of the two ("tp" or "ep"), `stand_in`: found with
    stand-in kernels; the options the engine was loaded with (`kv_cache_dtype`, `enforce_eager`), and
    `model_dtype`, the dtype it computes in (the finding's)."""
    from harness.engines.options import split_engine

    shape, block = finding.metrics.get("shape"), finding.metrics.get("block")
    context: dict[str, Any] = {"stand_in": bool(finding.metrics.get("stand_in"))}
    context |= {key: value for key, value in split_engine(finding.engine)[1].items() if key != "dtype"}
    if finding.dtype:
        context["model_dtype"] = finding.dtype
    if finding.module:
        context["expert"] = ".experts." in finding.module
    if isinstance(finding.metrics.get("tp"), int):  # the tensor-parallel size a relation finding is at
        context["tp"] = finding.metrics["tp"]
        context["parallel"] = finding.metrics.get("parallel", "tp")
    if not (isinstance(shape, (list, tuple)) and len(shape) == 2):
        return context
    context |= {"rows": shape[0], "cols": shape[1]}
    if isinstance(block, (list, tuple)) and len(block) == 2 and all(block):
        context |= {"block_rows": block[0], "block_cols": block[1]}
        context["partial"] = bool(shape[0] % block[0] or shape[1] % block[1])
    return context
