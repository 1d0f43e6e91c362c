"""`gptq`: GPTQ integer weights as AutoGPTQ / GPTQModel / AutoRound export them (`quant_method: gptq`).

Tensors, for a Linear with N outputs and K inputs, b bits (4 or 8), groups of g inputs (g = K
for `group_size: -1`), G = ceil(K/g):
- `qweight` int32 [ceil(K*b/32), N]: codes packed along the *inputs*; word w of column n holds
  rows (32/b)w + i in bits b*i.. (least significant first), unsigned codes in [0, 2**b - 1];
- `qzeros` int32 [G, ceil(N*b/32)]: zero points packed along the outputs the same way;
- `scales` [G, N] (float16 as the producers write it; bfloat16 and float32 read too);
- `g_idx` int32 [K]: the group of each input row.
W[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]. The zero point z is the stored value
plus one in `checkpoint_format: gptq` (v1: producers store z - 1) and the stored value itself in
`gptq_v2`. Without act-order (`desc_act: false`) g_idx[k] = k // g; with it, the producer
quantized the inputs in a permuted order (by decreasing Hessian diagonal), and g_idx names each
input's group, in any order. A checkpoint without `g_idx` means k // g. Config:
`{"quant_method": "gptq", "bits", "group_size", "desc_act", "sym", "checkpoint_format", ...}`;
modules left unquantized other than `lm_head` are named in GPTQModel's `dynamic` as `-:` regexes.
AutoRound's own format (`quant_method: auto-round`) with `packing_format` `auto_round:auto_gptq`
is this layout with v1 zeros (AutoRound packs it with its GPTQ packer, `g_idx` omitted);
`auto_round` and `auto_round:gptqmodel` store the zeros as they are (v2).

Scales follow GPTQ's `Quantizer.find_params` (float32, per group): lo = min(group min, 0),
hi = max(group max, 0); symmetric: hi = max(|lo|, hi), lo = -hi; an all-zero group gets
lo, hi = -1, 1; scale = (hi - lo) / (2**b - 1); z = 2**(b-1) (symmetric) or round(-lo / scale).
The stored float16 scale is what the codes are computed against, as AutoGPTQ's `pack` does:
q = clamp(round(w / scale) + z, 0, 2**b - 1). The generator quantizes by rounding (no Hessian
compensation: the format is the same) and, under act-order, orders the inputs by a fixed hash of
their index in the Hessian's place, one order per input width, so that q/k/v and gate/up share
their g_idx as a real producer's do (they read the same activations). v1 cannot store z = 0 (z - 1 = -1 is no unsigned code): v1's
quantizer keeps z >= 1, as a v1 producer must. Packing needs whole words: an N or K that is not a
multiple of 32/b is padded with zero slots, which GPTQ's own loaders do not allocate, so such a
module is `exact-or-refuse`.
"""

from __future__ import annotations

import re

import torch

from harness.core.errors import UnsupportedFormat
from harness.core.numerics import ceil_div
from harness.formats import int_packing
from harness.formats.auto_round import AUTO_ROUND
from harness.formats.base import (
    ROUTERS,
    FormatError,
    Knob,
    QuantFormat,
    QuantizedWeight,
    require_dtype,
    require_finite,
    require_shape,
    require_tensor,
)

QUANT_METHOD = "gptq"
#: AutoRound's packing formats in GPTQ's layout -> the checkpoint_format their zeros follow
AUTO_ROUND_GPTQ = "auto_round:auto_gptq"
AUTO_ROUND_GPTQMODEL = "auto_round:gptqmodel"
AUTO_ROUND_PACKING = {AUTO_ROUND_GPTQ: "gptq", "auto_round": "gptq_v2", AUTO_ROUND_GPTQMODEL: "gptq_v2"}
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
GROUP_SIZES = (32, 64, 128, -1)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: knob `scale_storage`: the dtype `scales` are stored in; producers write float16, some
#: checkpoints carry the model's bfloat16 or float32 (the codes are computed against the stored value)
SCALE_STORAGES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: modules every GPTQ producer leaves unquantized without saying so
IMPLICITLY_PLAIN = ("lm_head",)


def auto_round_packing(quantization_config) -> str:
    """AutoRound's packing_format (its default, when absent, is its own v2 layout)."""
    return str(quantization_config.get("packing_format") or "auto_round")


def plain_pattern(module: str) -> str:
    """GPTQModel's `dynamic` key that leaves one module unquantized."""
    return f"-:^{re.escape(module)}$"


def group_count(cols: int, group: int) -> int:
    return 1 if group == -1 else ceil_div(cols, group)


#: Knuth's multiplicative hash constant: odd, so k -> k * HASH mod 2**32 is a bijection
HASH = 2654435761


def act_order(cols: int) -> torch.Tensor:
    """The producer's input order under act-order: decreasing importance. GPTQ ranks inputs by the
    Hessian's diagonal, the calibration activations' energy on each input, so Linears that read one
    input (q/k/v, gate/up, an expert's gate/up) share one order and one g_idx. With no calibration
    data, a fixed stand-in for that ranking that depends on the input width alone: inputs sorted by
    Knuth's multiplicative hash of their index."""
    return torch.argsort((torch.arange(cols, dtype=torch.int64) * HASH) % 2**32)


def group_index(cols: int, group: int, order: torch.Tensor | None) -> torch.Tensor:
    """g_idx: each input's group; under act-order, groups are runs of the permuted order."""
    if group == -1:
        return torch.zeros(cols, dtype=torch.int32)
    position = torch.arange(cols)
    if order is not None:
        position = torch.empty(cols, dtype=torch.int64)
        position[order] = torch.arange(cols)
    return (position // group).to(torch.int32)


def gptq_qparams(
    weight: torch.Tensor, members: torch.Tensor, bits: int, symmetric: bool, min_zero: int, dtype=torch.float16
):
    """GPTQ's find_params for the inputs in `members` (float32): (scale [N] in `dtype`, zero [N])."""
    block = weight[:, members].to(torch.float32)
    zero_t = torch.zeros((), dtype=torch.float32)
    lo, hi = torch.minimum(block.amin(dim=1), zero_t), torch.maximum(block.amax(dim=1), zero_t)
    if symmetric:
        hi = torch.maximum(lo.abs(), hi)
        lo = torch.where(lo < 0, -hi, lo)
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    maxq = 2**bits - 1
    scale = (hi - lo) / maxq
    if symmetric:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        zero = torch.round(-lo / scale).clamp(min_zero, maxq)
    return scale.to(dtype), zero.to(torch.int64)


def packed_tensors(tensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's and AWQ's qweight and qzeros (int32) and scales (a float dtype), each 2-D."""
    qweight, qzeros, scales = (require_tensor(tensors, s) for s in ("qweight", "qzeros", "scales"))
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        require_dtype(name, tensor, (torch.int32,))
    require_dtype("scales", scales, SCALE_DTYPES)
    if qweight.dim() != 2 or scales.dim() != 2:
        raise FormatError(f"qweight {list(qweight.shape)} and scales {list(scales.shape)} must be 2-D")
    return qweight, qzeros, scales


class Gptq(QuantFormat):
    name = "gptq"
    description = "GPTQ int4/int8 (qweight packed along inputs, qzeros, float16 scales, g_idx; v1 or v2 zeros)"
    suffixes = ("qweight", "qzeros", "scales", "g_idx")
    marker = "qweight"
    optional = ("g_idx",)  # absent: k // group_size
    # a GPTQ config names no router to skip: vLLM reads which modules the files store quantized
    # (AutoGPTQConfig.maybe_update_config) and transformers 5's routers are not Linears
    unlisted_plain = ROUTERS
    knobs = {
        "bits": Knob(4, (4, 8), "code width"),
        "group_size": Knob(128, GROUP_SIZES, "inputs per group (-1: one group per row)"),
        "sym": Knob(True, (True, False), "symmetric: every zero point is 2**(bits-1)"),
        "desc_act": Knob(False, (False, True), "act-order: groups over permuted inputs (g_idx)"),
        "checkpoint_format": Knob("gptq", CHECKPOINT_FORMATS, "gptq (v1, zeros stored minus one) or gptq_v2"),
        "scale_storage": Knob("float16", tuple(SCALE_STORAGES), "dtype of scales (producers write float16)"),
    }

    def matches(self, quantization_config):
        """GPTQ's config, AutoRound's over GPTQ's packing; not one whose `dynamic` stores some Linears
        in another scheme (harness.formats.mixed reads that)."""
        from harness.formats.mixed_groups import auto_round_overrides, gptq_overrides

        method = quantization_config.get("quant_method")
        if method == AUTO_ROUND:
            packing = auto_round_packing(quantization_config) in AUTO_ROUND_PACKING
            return packing and not auto_round_overrides(quantization_config)
        return method == QUANT_METHOD and not gptq_overrides(quantization_config)

    def quantization_config(self, knobs, ignore):
        config = {
            "bits": knobs["bits"],
            "checkpoint_format": knobs["checkpoint_format"],
            "damp_percent": 0.01,
            "desc_act": knobs["desc_act"],
            "group_size": knobs["group_size"],
            "lm_head": "lm_head" not in ignore,  # GPTQModel's flag for a quantized head
            "quant_method": QUANT_METHOD,
            "static_groups": False,
            "sym": knobs["sym"],
            "true_sequential": True,
        }
        plain = [m for m in ignore if m not in IMPLICITLY_PLAIN]
        if plain:
            config["dynamic"] = {plain_pattern(m): {} for m in plain}
        return config

    def knobs_from_config(self, quantization_config):
        if not self.matches(quantization_config):
            raise FormatError(f"quantization_config is not quant_method {QUANT_METHOD}")
        get = quantization_config.get
        if get("quant_method") == AUTO_ROUND:
            if get("data_type", "int") != "int":
                raise UnsupportedFormat(f"auto-round with data_type {get('data_type')!r} in GPTQ's layout")
            layout = AUTO_ROUND_PACKING[auto_round_packing(quantization_config)]
        else:
            layout = get("checkpoint_format") or "gptq"
        bits, group = get("bits"), get("group_size", 128)
        if bits not in (4, 8):
            raise UnsupportedFormat(f"GPTQ with bits={bits!r} (the harness defines 4 and 8)")
        if not isinstance(group, int) or isinstance(group, bool) or (group <= 0 and group != -1):
            raise FormatError(f"group_size {group!r} is not a positive int or -1")
        if layout not in CHECKPOINT_FORMATS:
            raise UnsupportedFormat(
                f"GPTQ checkpoint_format {layout!r} (the harness defines {', '.join(CHECKPOINT_FORMATS)})"
            )
        for key in ("sym", "desc_act"):
            if not isinstance(get(key, key == "sym"), bool):
                raise FormatError(f"{key} {get(key)!r} is not a bool")
        if get("static_groups"):
            raise UnsupportedFormat("GPTQ with static_groups")
        return {
            "bits": bits,
            "group_size": group,
            "sym": get("sym", True),
            "desc_act": get("desc_act", False),
            "checkpoint_format": layout,
        }

    def quantize(self, weight, knobs, *, model_dtype, activation_amax):
        weight = weight.to(model_dtype).to(torch.float32)  # the producer quantizes the model's weight
        rows, cols = weight.shape
        bits, group, v1 = knobs["bits"], knobs["group_size"], knobs["checkpoint_format"] == "gptq"
        order = act_order(cols) if knobs["desc_act"] else None
        g_idx = group_index(cols, group, order)
        groups = group_count(cols, group)
        dtype = SCALE_STORAGES[knobs.get("scale_storage", "float16")]
        scales = torch.empty(groups, rows, dtype=dtype)
        zeros = torch.empty(groups, rows, dtype=torch.int64)
        for g in range(groups):
            members = torch.nonzero(g_idx == g).flatten()
            scales[g], zeros[g] = gptq_qparams(weight, members, bits, knobs["sym"], int(v1), dtype)
        row_scale = scales.to(torch.float32)[g_idx.long()].T  # [N, K]
        row_zero = zeros[g_idx.long()].T
        codes = (torch.round(weight / row_scale) + row_zero).clamp(0, 2**bits - 1).to(torch.int64)
        stored_zeros = zeros - 1 if v1 else zeros
        tensors = {
            "qweight": int_packing.pack(codes.T, bits, dim=0),
            "qzeros": int_packing.pack(stored_zeros, bits, dim=1),
            "scales": scales,
            "g_idx": g_idx,
        }
        truth = (codes - row_zero).to(torch.float64) * row_scale.to(torch.float64)
        result = QuantizedWeight(tensors, truth=truth)
        per = int_packing.slots_per_word(bits)
        if rows % per or cols % per:
            result.expectation = "exact-or-refuse"
            result.notes.append(
                f"[{rows}, {cols}] is not a multiple of {per} (int{bits} codes per int32) in both dimensions: "
                "qweight/qzeros carry zero-padded words, which GPTQ's own loaders do not allocate"
            )
        if knobs["desc_act"]:
            result.notes.append("act-order: g_idx is a permutation of groups, not k // group_size")
        return result

    def dequantize(self, tensors, knobs):
        codes, zeros, scales = self.affine_parts(tensors, knobs)
        return (codes - zeros) * scales

    def affine_parts(self, tensors, knobs):
        qweight, qzeros, scales = packed_tensors(tensors)
        bits, group = knobs["bits"], knobs["group_size"]
        per = int_packing.slots_per_word(bits)
        rows = qweight.shape[1]
        g_idx = tensors.get("g_idx")
        if g_idx is None:
            cols = qweight.shape[0] * per
            g_idx = torch.arange(cols) // group if group != -1 else torch.zeros(cols, dtype=torch.int64)
        else:
            require_dtype("g_idx", g_idx, (torch.int32, torch.int64))
            if g_idx.dim() != 1:
                raise FormatError(f"g_idx has shape {list(g_idx.shape)}, expected [in_features]")
            cols = g_idx.shape[0]
        groups = group_count(cols, group)
        require_shape("qweight", qweight, (ceil_div(cols, per), rows), f"{per} int{bits} inputs per int32 word")
        require_shape("scales", scales, (groups, rows), f"one scale per {group} inputs and output")
        require_shape("qzeros", qzeros, (groups, ceil_div(rows, per)), f"{per} int{bits} zero points per int32 word")
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise FormatError(f"g_idx holds groups {int(g_idx.min())}..{int(g_idx.max())}, outside 0..{groups - 1}")
        require_finite("scales", scales)
        codes = int_packing.unpack(qweight, bits, cols, dim=0)  # [K, N]
        zeros = int_packing.unpack(qzeros, bits, rows, dim=1)  # [G, N]
        if knobs["checkpoint_format"] == "gptq":
            zeros = zeros + 1
        g = g_idx.long()
        return tuple(t.to(torch.float64).T.contiguous() for t in (codes, zeros[g], scales[g]))

    def redundant(self, tensors, knobs):
        g_idx = tensors.get("g_idx")
        if g_idx is None or g_idx.dim() != 1:
            return set()
        trivial = group_index(g_idx.shape[0], knobs["group_size"], None)  # no act-order: k // g
        return {"g_idx"} if torch.equal(g_idx.to(torch.int64), trivial.to(torch.int64)) else set()

    def scale_block(self, knobs, shape):
        return 1, (shape[1] if knobs["group_size"] == -1 else knobs["group_size"])

    def splits_by_rows(self, knobs):
        return False  # outputs lie along dim 1 (qweight, scales), packed in qzeros

    def subnormal_amax(self, knobs, weight_amax):
        # scale = 2 * amax / (2**b - 1) (symmetric span); float16 subnormal below 2**-14, the others
        # below 2**-126
        exponent = -20 if knobs.get("scale_storage", "float16") == "float16" else -130
        return (2 ** knobs["bits"] - 1) / 2 * 2.0**exponent


FORMAT = Gptq()
