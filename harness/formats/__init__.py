"""Registry of quantization formats: a name -> the module attribute that implements it.

Importing this registry imports no torch (the CLI builds its help and choices from
FORMAT_NAMES); a format's module loads when `get_format` first asks for it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from harness.core.errors import UnknownFormat, UnsupportedFormat
from harness.core.plugins import load_plugins

if TYPE_CHECKING:
    from harness.formats.base import QuantFormat

REGISTRY: dict[str, str] = {
    "fp8-block": "harness.formats.fp8_block:FORMAT",
    "ct-fp8-tensor": "harness.formats.ct_fp8:TENSOR",
    "ct-fp8-channel": "harness.formats.ct_fp8:CHANNEL",
    "ct-fp8-block": "harness.formats.ct_fp8:BLOCK",
    "ct-nvfp4": "harness.formats.ct_nvfp4:W4A4",
    "ct-nvfp4a16": "harness.formats.ct_nvfp4:W4A16",
    "modelopt-nvfp4": "harness.formats.modelopt_nvfp4:FORMAT",
    "modelopt-fp8": "harness.formats.modelopt_fp8:FORMAT",
    "autofp8": "harness.formats.autofp8:FORMAT",
    "ct-int4": "harness.formats.ct_int4:FORMAT",
    "ct-int8": "harness.formats.ct_int4:INT8",
    "ct-w8a8": "harness.formats.ct_w8a8:FORMAT",
    "ct-mxfp4": "harness.formats.ct_mxfp4:FORMAT",
    "mxfp4": "harness.formats.mxfp4:FORMAT",
    "gptq": "harness.formats.gptq:FORMAT",
    "awq": "harness.formats.awq:FORMAT",
    "unquantized": "harness.formats.unquantized:FORMAT",
}

FORMAT_NAMES = tuple(REGISTRY)

#: formats the harness reads but never writes (no generator, no campaign cell): each is made of
#: the formats above, or holds one's tensors under a producer's own names
READ_ONLY: dict[str, str] = {
    "mixed-precision": "harness.formats.mixed:FORMAT",
    "gptq-dynamic": "harness.formats.mixed:GPTQ_DYNAMIC",
    "quark-nvfp4": "harness.formats.quark_nvfp4:FORMAT",
    "quark-int4": "harness.formats.quark_int4:FORMAT",
    "quark-int4-channel": "harness.formats.quark_int4_channel:FORMAT",
    "quark-mxfp4": "harness.formats.quark_mxfp4:FORMAT",
    "quark-int8": "harness.formats.quark_int8:FORMAT",
    "ct-w4a8": "harness.formats.ct_int_groups:FORMAT",
    "ct-mxfp8": "harness.formats.ct_mxfp8:FORMAT",
}


def register_format(name: str, spec: str) -> None:
    """Add a format from outside the package (a plugin, harness.core.plugins): `spec` is the
    `module:attribute` of its QuantFormat instance."""
    global FORMAT_NAMES
    if name in REGISTRY and REGISTRY[name] != spec:
        raise ValueError(f"format '{name}' is already registered as {REGISTRY[name]}")
    REGISTRY[name] = spec
    FORMAT_NAMES = tuple(REGISTRY)


def require_formats(*names: str) -> tuple[str, ...]:
    """`names`, each a registered format; else one line naming the first unknown one and the known."""
    for name in names:
        if name in READ_ONLY:
            raise UnknownFormat(f"format '{name}' is read, not written (written: {', '.join(FORMAT_NAMES)})")
        if name not in REGISTRY:
            raise UnknownFormat(f"unknown format '{name}' (known: {', '.join(FORMAT_NAMES)})")
    return names


def get_format(name: str) -> QuantFormat:
    """A registered format, or one the harness only reads (READ_ONLY)."""
    if name not in READ_ONLY:
        require_formats(name)
    module_name, attribute = (REGISTRY.get(name) or READ_ONLY[name]).split(":")
    return getattr(importlib.import_module(module_name), attribute)


def detect_format(quantization_config: Mapping) -> QuantFormat:
    """The one registered format whose definition matches a checkpoint's `quantization_config`."""
    from harness.formats.base import FormatError

    found = [fmt for fmt in map(get_format, FORMAT_NAMES + tuple(READ_ONLY)) if fmt.matches(quantization_config)]
    if not found:
        raise UnsupportedFormat(
            f"{describe_scheme(quantization_config)} matches no format the harness defines (it reads "
            f"{', '.join(FORMAT_NAMES)})"
        )
    if len(found) != 1:
        method = quantization_config.get("quant_method", "?")
        raise FormatError(
            f"quantization_config (quant_method={method!r}) matches several formats ({', '.join(f.name for f in found)})"
        )
    return found[0]


#: the fields of a compressed-tensors quantization args that say what a scheme is
_ARGS = ("type", "num_bits", "strategy", "symmetric", "group_size", "block_structure", "dynamic", "actorder")


def describe_scheme(quantization_config: Mapping) -> str:
    """What a quantization_config declares, in one line: its method and format, and each
    compressed-tensors config group's weights and input activations."""
    method = quantization_config.get("quant_method", "?")
    text = f"quantization_config (quant_method={method!r}"
    if quantization_config.get("format"):
        text += f", format={quantization_config['format']!r}"
    groups = quantization_config.get("config_groups")
    for name, group in groups.items() if isinstance(groups, Mapping) else ():
        if not isinstance(group, Mapping):
            continue
        for role in ("weights", "input_activations"):
            args = group.get(role)
            if isinstance(args, Mapping):
                fields = " ".join(f"{k}={args[k]}" for k in _ARGS if args.get(k) is not None)
                text += f"; {name} {role}: {fields}"
    for key in ("quant_algo", "bits", "group_size", "sym", "desc_act", "checkpoint_format", "version"):
        if quantization_config.get(key) is not None:
            text += f", {key}={quantization_config[key]!r}"
    return text + ")"


load_plugins()  # last: a plugin registers into the registry above
