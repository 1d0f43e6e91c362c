"""Canonical tensor names: checkpoints may store the text model under a VLM prefix."""

VLM_PREFIX = "model.language_model."


def canonical_name(name: str) -> str:
    """`model.language_model.layers.0...` -> `model.layers.0...`; other names unchanged."""
    return "model." + name.removeprefix(VLM_PREFIX) if name.startswith(VLM_PREFIX) else name
