"""Mixed precision: a checkpoint whose Linears are stored in several schemes, one per group of its
config (compressed-tensors' config groups, ModelOpt's MIXED_PRECISION, GPTQModel's `dynamic` per-module
bits, AutoRound's mixed bits: harness/formats/mixed_groups.py reads the groups and which Linear each
names). Each module is read by its group's own format; a module no group names (producers write
targets in the model's in-memory names, which transformers may save under others: Mixtral's experts)
by the one group whose format its tensors fit; tensors that fit two groups differently are refused.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from harness.formats.base import FormatError, QuantFormat
from harness.formats.mixed_groups import (
    AUTO_ROUND,
    FIRST,
    SORTED,
    Member,
    auto_round_routes,
    ignore_list,
    members_of,
    targeting_group,
)


class MixedPrecision(QuantFormat):
    """Several config groups, each module read in its own group's format (see the module docstring).
    One instance per family of configs (`methods`, their quant_method): its tensors are any its groups'
    formats store, `marker` one every such quantized module stores; its knobs are its members."""

    def __init__(self, name: str, description: str, methods: tuple[str, ...], suffixes: tuple[str, ...], marker: str):
        self.name, self.description, self.methods = name, description, methods
        self.suffixes, self.marker = suffixes, marker

    def matches(self, quantization_config):
        """Several groups read here, unless they are one scheme whose format reads them all itself."""
        if quantization_config.get("quant_method") not in self.methods:
            return False
        members = members_of(quantization_config)
        if members is None:
            return False
        schemes = {(member.fmt.name, repr(member.knobs)) for member in members}
        return len(schemes) > 1 or not members[0].fmt.matches(quantization_config)

    def knobs_from_config(self, quantization_config):
        members = members_of(quantization_config)
        if members is None:
            raise FormatError("quantization_config is not several groups of schemes read here")
        method = quantization_config.get("quant_method")
        order = {"gptq": FIRST, AUTO_ROUND: AUTO_ROUND}.get(method, SORTED)
        knobs = {"members": members, "ignore": ignore_list(quantization_config), "order": order}
        return knobs | ({"routes": auto_round_routes(quantization_config, members)} if order == AUTO_ROUND else {})

    def quantization_config(self, knobs, ignore):
        raise FormatError(f"{self.name} is read, not written: the generator writes one scheme per checkpoint")

    def schemes(self, knobs):
        return tuple(dict.fromkeys(member.fmt for member in knobs["members"]))

    def groups(self, knobs):
        return tuple(knobs["members"])

    def for_module(self, module, knobs, tensors=None):
        member = targeting_group(knobs, module)
        if member is not None:
            return member.fmt, member.knobs
        return self.fitting(tensors, knobs) if tensors is not None else (self, knobs)

    def member(self, module: str, knobs, suffixes: set[str]) -> Member | None:
        """The group a stored module with tensors of these suffixes is read in, by its name, else by
        the suffixes alone (fitting_by_names); None where neither tells."""
        return targeting_group(knobs, module) or self.fitting_by_names(suffixes, knobs)

    def fitting_by_names(self, suffixes: set[str], knobs) -> Member | None:
        """The first member whose format stores exactly such tensors (by their suffixes alone: what a
        reader of the files' headers can tell), None where none does."""
        present = suffixes - {"bias"}
        for member in knobs["members"]:
            if {member.fmt.marker, member.fmt.suffixes[0]} <= present <= set(member.fmt.suffixes):
                return member
        return None

    def fitting(self, tensors: Mapping[str, torch.Tensor], knobs) -> tuple[QuantFormat, dict]:
        """The one member whose format the tensors fit (suffixes, then its dequantizer where two
        formats store the same suffixes); FormatError where none does or two do differently."""
        present = set(tensors) - {"bias"}
        candidates = [
            m for m in knobs["members"] if {m.fmt.marker, m.fmt.suffixes[0]} <= present <= set(m.fmt.suffixes)
        ]
        candidates = list({(m.fmt.name, repr(m.knobs)): m for m in candidates}.values())
        if len(candidates) == 1:
            return candidates[0].fmt, candidates[0].knobs
        groups = ", ".join(m.group for m in knobs["members"])
        if not candidates:
            raise FormatError(f"tensors {sorted(present)} fit none of the config groups ({groups})")
        fits, errors = [], []
        for member in candidates:
            try:
                fits.append((member, member.fmt.dequantize(tensors, member.knobs)))
            except FormatError as error:
                errors.append(f"{member.group}: {error}")
        if not fits:
            raise FormatError(f"tensors fit none of the config groups ({'; '.join(errors)})")
        first = fits[0][1]
        if any(value.shape != first.shape or not torch.equal(value, first) for _, value in fits[1:]):
            named = ", ".join(member.group for member, _ in fits)
            raise FormatError(f"tensors fit config groups {named}, which read them differently")
        return fits[0][0].fmt, fits[0][0].knobs

    def dequantize(self, tensors, knobs):
        fmt, own = self.fitting(tensors, knobs)
        return fmt.dequantize(tensors, own)

    def affine_parts(self, tensors, knobs):
        fmt, own = self.fitting(tensors, knobs)
        return fmt.affine_parts(tensors, own)

    def redundant(self, tensors, knobs):
        return set()  # a member's optional tensors are judged where its module is read (for_module)

    def scale_block(self, knobs, shape):
        blocks = {member.fmt.scale_block(member.knobs, shape) for member in knobs["members"]}
        if len(blocks) != 1:
            raise FormatError(f"the config groups scale {shape} in different blocks: ask for_module")
        return blocks.pop()

    def splits_by_rows(self, knobs):
        return all(member.fmt.splits_by_rows(member.knobs) for member in knobs["members"])

    def packed_across_rows(self, knobs):
        packed = (member.fmt.packed_across_rows(member.knobs) for member in knobs["members"])
        return tuple(dict.fromkeys(suffix for suffixes in packed for suffix in suffixes))


#: compressed-tensors' and ModelOpt's: the stored weight first ('weight' for FP8, int8 and ModelOpt's
#: NVFP4, 'weight_packed' for compressed-tensors' packed formats); every format of either stores a
#: weight_scale
FORMAT = MixedPrecision(
    "mixed-precision",
    "several config groups (compressed-tensors, ModelOpt MIXED_PRECISION), each a scheme read here",
    ("compressed-tensors", "modelopt"),
    (
        "weight",
        "weight_packed",
        "weight_scale",
        "weight_shape",
        "weight_zero_point",
        "weight_global_scale",
        "weight_scale_2",
        "input_global_scale",
        "input_scale",
    ),
    "weight_scale",
)
#: GPTQ with `dynamic` overrides that store some Linears in other bits, groups, symmetry or act-order,
#: and AutoRound's mixed bits over GPTQ's packing
GPTQ_DYNAMIC = MixedPrecision(
    "gptq-dynamic",
    "GPTQ whose `dynamic` (GPTQModel) or AutoRound's `extra_config` stores some Linears in other bits or groups",
    ("gptq", AUTO_ROUND),
    ("qweight", "qzeros", "scales", "g_idx"),
    "qweight",
)
