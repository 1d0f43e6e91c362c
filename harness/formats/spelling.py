"""The letter case of a quantization config's enum-valued fields.

Producers write each such field in one case (compressed-tensors' `"strategy": "tensor"`,
ModelOpt's `"quant_algo": "FP8"`, AutoAWQ's `"version": "gemm"` in config.json and `"GEMM"` in
its quant_config.json). Where a format's own reader compares a field without case, the harness
reads it without case too (`canonical`), and the generator can write it in the other case
(`other_case`, the recipe's `layout.config_spelling`): the checkpoint is as valid as the producer's
spelling, so a loader must read the same value. The fields, with the reader that defines them:

- compressed-tensors' QuantizationArgs `type`, `strategy`, `dynamic` (its validators lower them);
- GPTQ `checkpoint_format`, AWQ `version` (transformers' GPTQConfig/AwqConfig and GPTQModel lower
  them), FineGrainedFP8 `activation_scheme` (transformers lowers it);
- ModelOpt `quant_algo` (vLLM's ModelOpt config uppers it; transformers has no ModelOpt loader).

Left as written, because the reader that defines them compares with case: compressed-tensors'
`format` and `quantization_status` (compressed-tensors 0.20 refuses "FLOAT-QUANTIZED": "Input should
be 'dense', ..."), FineGrainedFP8 `scale_fmt` (transformers raises on "UE8M0"), and `quant_method`,
which names the loader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CHOICES = ("producer", "other-case")

#: the fields read without case, by the case their producers write them in (`version` is AWQ's
#: kernel layout, "gemm"; compressed-tensors' is its package version, which has no letters)
LOWER = ("type", "strategy", "dynamic", "checkpoint_format", "version", "activation_scheme")
UPPER = ("quant_algo",)


def canonical(config: Any) -> Any:
    """`config` with every enum-valued field (at any depth) in its producers' case."""
    return _respell(config, lambda key, value: value.upper() if key in UPPER else value.lower())[0]


def other_case(config: Any) -> tuple[Any, list[str]]:
    """`config` with every enum-valued field whose value has letters in the other case, and the
    changed fields as `path=VALUE` (empty: the config has no such field)."""
    return _respell(config, lambda key, value: value.lower() if key in UPPER else value.upper())


def _respell(config: Any, spell, path: str = "") -> tuple[Any, list[str]]:
    if isinstance(config, Mapping):
        changed: list[str] = []
        result = {}
        for key, value in config.items():
            where = f"{path}.{key}" if path else str(key)
            if key in LOWER + UPPER and isinstance(value, str) and spell(key, value) != value:
                result[key] = spell(key, value)
                changed.append(f"{where}={result[key]!r}")
            else:
                result[key], inner = _respell(value, spell, where)
                changed += inner
        return result, changed
    if isinstance(config, list):
        items = [_respell(item, spell, f"{path}[{i}]") for i, item in enumerate(config)]
        return [item for item, _ in items], [c for _, inner in items for c in inner]
    return config, []
