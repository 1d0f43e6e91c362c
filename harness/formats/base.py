"""What every quantization format module provides.

A format owns its tensor names, its `quantization_config` fragment, a quantizer that
computes scales the way the real producers do, and a float64 reference dequantizer
written from the format's definition. Formats never import an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.core.errors import FormatError  # noqa: F401  (raised by every format; its home is core)


@dataclass(frozen=True)
class Knob:
    """A format parameter settable with `gen --set NAME=VALUE`; `choices` bounds it."""

    default: Any
    choices: tuple = ()
    help: str = ""


EXPECTATIONS = ("exact", "exact-or-refuse", "refuse")


@dataclass
class QuantizedWeight:
    """One Linear weight as a format writes it: tensors by suffix (`weight`, `weight_scale`, ...).

    `truth` is the float64 weight a correct loader must produce, computed by the quantizer
    on its own path (not by `dequantize`). `expectation` says what a correct loader does
    with this module: load it exactly, load it exactly or refuse it, or refuse it; `notes`
    say why, for the manifest.
    """

    tensors: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)
    truth: torch.Tensor | None = None
    expectation: str = "exact"
    #: the weight that was quantized, after the writer's weight-level perturbations
    source: torch.Tensor | None = None


#: a mixture's routers, as ignore-list entries (`mlp.gate`, `block_sparse_moe.gate`, Qwen2-MoE's
#: `shared_expert_gate`): modules the producers that write no exclusion for them never quantize
ROUTERS = ("re:.*\\.gate$", "re:.*\\.shared_expert_gate$")


class QuantFormat:
    """Base class: subclasses set the attributes and implement the four methods."""

    name: str = ""
    description: str = ""
    #: tensor suffixes that belong to a quantized Linear, besides `bias`
    suffixes: tuple[str, ...] = ()
    #: the suffix whose presence marks a module as quantized in a checkpoint
    marker: str = ""
    #: suffixes the quantizer writes that a checkpoint may omit, the format defining their default
    optional: tuple[str, ...] = ()
    #: format parameters (block size, scale dtype, perturbation switches)
    knobs: Mapping[str, Knob] = {}
    #: False for a format that stores weights as they are (`unquantized`): no scale and no
    #: quantization config for a layout or perturbation to change
    has_scales: bool = True
    #: modules (ignore-list entries) its checkpoints leave plain without any config naming them,
    #: since its loaders never quantize them
    unlisted_plain: tuple[str, ...] = ()

    def resolve_knobs(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        values = {name: knob.default for name, knob in self.knobs.items()}
        for name, value in overrides.items():
            if name not in self.knobs:
                raise KeyError(name)
            knob = self.knobs[name]
            if knob.choices and value not in knob.choices:
                raise ValueError(f"{name}={value!r}: expected one of {list(knob.choices)}")
            values[name] = value
        return values

    def schemes(self, knobs: Mapping[str, Any]) -> tuple[QuantFormat, ...]:
        """The formats whose kernels an engine needs to load it: itself, a mixed checkpoint's groups'
        (mixed), or the written format whose tensors a producer's layout holds under its own names
        (Quark's: AWQ's, ct-mxfp4's, modelopt-nvfp4's), which a capability probe can write; a read-only
        format that is itself is answered by the checkpoint's own load."""
        return (self,)

    def probe_answers(self, knobs: Mapping[str, Any]) -> bool:
        """Whether an engine's capability probe (a checkpoint of the default knobs) answers for a
        checkpoint of these knobs, which then needs the same kernels; else that checkpoint's own
        load answers."""
        return True

    def groups(self, knobs: Mapping[str, Any]) -> tuple:
        """A mixed checkpoint's config groups in the config's order (harness.formats.mixed_groups.Member:
        each group's format, knobs, targets and config alone); none for a checkpoint of one scheme."""
        return ()

    def for_module(
        self, module: str, knobs: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[QuantFormat, Mapping[str, Any]]:
        """The format and knobs that read the module stored as `module` (its name without `.weight`):
        itself, or in a mixed checkpoint its config group's (mixed), chosen by the module's
        `tensors` where no group names it."""
        return self, knobs

    def matches(self, quantization_config: Mapping[str, Any]) -> bool:
        """True when a checkpoint's `quantization_config` declares this format."""
        raise NotImplementedError

    def quantization_config(self, knobs: Mapping[str, Any], ignore: list[str]) -> dict:
        """The `quantization_config` fragment for config.json."""
        raise NotImplementedError

    def knobs_from_config(self, quantization_config: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters the dequantizer needs, read back from `quantization_config`."""
        raise NotImplementedError

    def quantize(
        self,
        weight: torch.Tensor,
        knobs: Mapping[str, Any],
        *,
        model_dtype: torch.dtype,
        activation_amax: float,
    ) -> QuantizedWeight:
        """Quantize one [N, K] weight (any float dtype) as the real producer would."""
        raise NotImplementedError

    def dequantize(self, tensors: Mapping[str, torch.Tensor], knobs: Mapping[str, Any]) -> torch.Tensor:
        """Reference dequantization to float64 [N, K]; raise FormatError on malformed input."""
        raise NotImplementedError

    def affine_parts(
        self, tensors: Mapping[str, torch.Tensor], knobs: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For an integer format with zero points, W = (codes - zeros) * scales: the three, each
        float64 [N, K] (a zero point and scale per element); None for other formats. A kernel may
        fold the zero point into a float offset (codes * s - zeros * s, each product rounded to its
        compute dtype): the effective-weight probe bounds that rounding with them."""
        return None

    def dequantize_held(self, tensors: Mapping[str, torch.Tensor], knobs: Mapping[str, Any]) -> torch.Tensor:
        """An engine's held tensors decoded as they are. A non-finite scale an engine holds (a slot
        its loader never wrote, left uninitialised) is the engine's state, judged as its weights
        (non-finite or mismatched), not a file to refuse; malformed shapes still raise. A per-tensor
        scale is read as an engine holds it, [1], whatever the file's shape (SCALAR_SCALES)."""
        token = _FINITE_REQUIRED.set(False)
        try:
            return self.dequantize(tensors, {k: v for k, v in knobs.items() if k != SCALAR_SCALES})
        finally:
            _FINITE_REQUIRED.reset(token)

    def redundant(self, tensors: Mapping[str, torch.Tensor], knobs: Mapping[str, Any]) -> set[str]:
        """The `optional` suffixes among a module's stored `tensors` whose values are what the format
        defines when they are absent: a loader that leaves them unread loses nothing."""
        return set()

    def scale_block(self, knobs: Mapping[str, Any], shape: tuple[int, int]) -> tuple[int, int]:
        """The [rows, cols] region of a weight of `shape` that shares one scale."""
        raise NotImplementedError

    def subnormal_amax(self, knobs: Mapping[str, Any], weight_amax: float) -> float:
        """An amax for one scale block that makes its stored scale subnormal in its dtype."""
        raise NotImplementedError

    def splits_by_rows(self, knobs: Mapping[str, Any]) -> bool:
        """Whether every tensor a module stores holds its output rows unpacked along dim 0, so that
        the rows of a weight stacked from parts split back into each part's tensors."""
        return True

    def packed_across_rows(self, knobs: Mapping[str, Any]) -> tuple[str, ...]:
        """The suffixes whose stored tensor packs several output rows into one element (compressed-
        tensors' asymmetric zero points: 8 int4 a word along the rows), the others holding each row on
        its own: a slice of rows may begin inside an element, so it is judged by its values
        (`unpack_rows`) and through the weight it decodes to, never by its bytes."""
        return ()

    def unpack_rows(self, suffix: str, tensor: torch.Tensor, rows: int, knobs: Mapping[str, Any]) -> torch.Tensor:
        """A `packed_across_rows` tensor as `rows` rows of values, one row per output row."""
        raise NotImplementedError(f"{self.name} packs no tensor across rows")


#: the reading knob that says a per-tensor scale is stored 0-D in the file, not [1] (Quark's exports,
#: harness.formats.equivalents); an engine holds it as its own parameter, [1], whatever the file's shape
SCALAR_SCALES = "scalar_scales"
#: False while an engine's held state is decoded (QuantFormat.dequantize_held)
_FINITE_REQUIRED: ContextVar[bool] = ContextVar("finite_required", default=True)


def require_finite(name: str, tensor: torch.Tensor, why: str = "") -> None:
    """Refuse scales that are NaN or infinite in a checkpoint: no definition gives them a meaning."""
    if not _FINITE_REQUIRED.get():
        return
    values = tensor.to(torch.float64)
    bad = ~torch.isfinite(values)
    if bad.any():
        detail = f" ({why})" if why else ""
        raise FormatError(f"{name} has {int(bad.sum())} non-finite value(s){detail}")


def require_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise FormatError(f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}, expected {names}")


def require_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], why: str = "") -> None:
    if tuple(tensor.shape) != tuple(expected):
        detail = f" ({why})" if why else ""
        raise FormatError(f"{name} has shape {list(tensor.shape)}, expected {list(expected)}{detail}")


def require_tensor(tensors: Mapping[str, torch.Tensor], suffix: str) -> torch.Tensor:
    if suffix not in tensors:
        raise FormatError(f"missing tensor '{suffix}'")
    return tensors[suffix]
