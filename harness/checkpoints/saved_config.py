"""A config.json as its model class reads it, not as the raw JSON says.

transformers' `save_pretrained` writes configs the generator never writes: `"head_dim": null`
(Mixtral), no `head_dim` at all (Qwen2, Phi-3, Qwen3-MoE), Qwen3-MoE's `num_experts` saved as
`num_local_experts` (its class's `attribute_map`), defaults left out. The model reads each field
through its config class: an attribute map renames, a default fills, a derivation (`head_dim` =
hidden_size / num_attention_heads) completes. `model_settings` reads the fields an architecture's
layout needs the same way: through the registered config class where transformers is importable
(every engine's worker has it; a command's own process imports it only when it reads the layout of
a registered architecture, e.g. `audit`'s names check), else through the attribute maps and
derivations written here from those classes. Importing `harness` imports none of it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from harness.core.errors import HarnessError

#: the attribute maps of the registered architectures' config classes (transformers 5.23): a saved
#: name -> the name the layout reads, used where transformers cannot be imported
ATTRIBUTE_MAPS = {
    "mixtral": {"num_local_experts": "num_experts"},
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "gpt_oss": {"num_local_experts": "num_experts"},
    "deepseek_v3": {"n_routed_experts": "num_local_experts"},
}


def model_settings(config: Mapping, keys: tuple[str, ...]) -> dict[str, Any]:
    """`config` with each of `keys` as the model class reads it (absent where the class has none)."""
    read = _class_values(json.dumps(dict(config), sort_keys=True, default=str), keys)
    settings = dict(config)
    for key in keys:
        value = read.get(key, settings.get(key))
        if value is None:
            value = _aliased(config, key)
        if value is not None:
            settings[key] = value
    if settings.get("head_dim") is None and "head_dim" in keys:
        hidden, heads = settings.get("hidden_size"), settings.get("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            settings["head_dim"] = hidden // heads  # what every registered model does with a null head_dim
    return settings


def _aliased(config: Mapping, key: str) -> Any:
    """`key`'s value under the name the config class's attribute map saves it as, or None."""
    aliases = ATTRIBUTE_MAPS.get(str(config.get("model_type")), {})
    for saved, read in aliases.items():
        for one, other in ((saved, read), (read, saved)):
            if key == one and config.get(other) is not None:
                return config[other]
    return None


@lru_cache(maxsize=64)
def _class_values(config_json: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The values of `keys` the registered config class holds for this config (none where
    transformers is not importable, or the model type is not one of its classes)."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.utils import logging
    except ImportError:
        return {}
    config = json.loads(config_json)
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return {}
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # a tiny model's token ids outside its vocabulary are warned about
    try:
        instance = CONFIG_MAPPING[model_type].from_dict(config)
    except Exception as error:  # the class refuses the config: the model would too
        raise HarnessError(
            f"config.json: transformers' {CONFIG_MAPPING[model_type].__name__} refuses it ({type(error).__name__}: "
            f"{' '.join(str(error).split())[:300]})"
        ) from None
    finally:
        logging.set_verbosity(verbosity)
    values = {}
    for key in keys:
        try:
            values[key] = getattr(instance, key)
        except AttributeError:
            continue
    return {key: value for key, value in values.items() if value is not None}
