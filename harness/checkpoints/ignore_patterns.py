"""The ignore list as producers spell it (the recipe's `layout.ignore_style`).

- `names`: every ignored module by its full name (what the harness has always written);
- `patterns`: llm-compressor recipes' spelling, which its checkpoints keep in config.json: `lm_head`
  as is, a module ignored in every layer as one `re:` pattern on its name within the layer
  (`re:.*mlp\\.gate$`, the routers of Qwen-MoE checkpoints on the hub), any other module as a
  `re:` pattern anchored on its full name.

Both ignore exactly the same modules (compressed-tensors and vLLM match `re:` entries with
`re.match` against the module's name), so a checkpoint means the same either way.
"""

from __future__ import annotations

import re
from collections import Counter

CHOICES = ("names", "patterns")
_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)$")


def spell(ignored: list[str], style: str, layers: int, prefix: str = "model.") -> list[str]:
    """The ignore list's entries for modules named as the float model names them (`model.` prefix);
    `prefix` is the checkpoint's key prefix (a vision-language checkpoint's `model.language_model.`)."""
    full = [prefix + name.removeprefix("model.") if name.startswith("model.") else name for name in ignored]
    if style == "names":
        return full
    within = Counter(match.group(1) for name in ignored if (match := _LAYER.match(name)))
    entries: list[str] = []
    for name, named in zip(ignored, full, strict=True):
        match = _LAYER.match(name)
        if match and within[match.group(1)] == layers:
            entry = f"re:.*\\.{re.escape(match.group(1))}$"
        elif name == "lm_head":
            entry = name
        else:
            entry = f"re:^{re.escape(named)}$"
        if entry not in entries:
            entries.append(entry)
    return entries
