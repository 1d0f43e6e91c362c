"""The project's tiny real language models: corpus, training, committed weights, quantized variants."""

from harness.lm.models import MODEL_NAMES, model_dir, model_spec

__all__ = ["MODEL_NAMES", "model_dir", "model_spec", "quantize_model"]


def quantize_model(name: str, fmt: str, out, producer: str = "harness", **options):
    """Write a quantized checkpoint of tiny model `name` in harness format `fmt` (see harness.lm.quantize)."""
    from harness.lm.quantize import quantize_model as quantize

    return quantize(name, fmt, out, producer=producer, **options)
