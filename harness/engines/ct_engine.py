"""`compressed-tensors`: its own decompression of its own formats.

The transformers model class provides the module tree; compressed-tensors attaches its
quantization scheme, lays out the compressed parameters (`compress_model`), receives the
checkpoint's tensors unmodified, and decompresses them (`decompress_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.checkpoints.reader import Checkpoint
from harness.core.naming import canonical_name
from harness.engines.base import EngineUnsupported, LoadReport
from harness.engines.hf_common import HFModelEngine, captured_warnings, unquantized_model


class CompressedTensorsEngine(HFModelEngine):
    name = "compressed-tensors"
    package = "compressed-tensors"

    def unsupported_reason(self, format_name):
        if not format_name.startswith("ct-"):
            return f"compressed-tensors reads its own formats only, not {format_name}"
        return None

    def load(self, directory: str) -> LoadReport:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

        raw = json.loads((Path(directory) / "config.json").read_text())
        method = raw["quantization_config"].get("quant_method")
        if method != "compressed-tensors":  # e.g. AutoRound's own config over compressed-tensors' tensors
            raise EngineUnsupported(f"compressed-tensors reads its own configs only, not quant_method {method!r}")
        quantization_config = QuantizationConfig.model_validate(raw["quantization_config"])
        warned: list[str] = []
        with captured_warnings(warned):
            self.model, tied = unquantized_model(directory)
            apply_quantization_config(self.model, quantization_config)
            compressor = ModelCompressor(quantization_config=quantization_config)
            compressor.compress_model(self.model)
            checkpoint = Checkpoint(directory)
            state = {canonical_name(name): tensor for name, tensor in checkpoint.tensors()}
            result = self.model.load_state_dict(state, strict=False)
            homeless_experts(self.model, result.unexpected_keys)
            compressor.decompress_model(self.model)
        report = self.checkpoint_report(raw, result.missing_keys, result.unexpected_keys, tied, checkpoint.names())
        report.warnings = warned
        return report

    def save(self, directory):
        raise EngineUnsupported(
            "this engine drives compressed-tensors' decompression only; its save path (compress, then "
            "save_pretrained) is not driven, and the model it holds has no transformers quantizer to save with"
        )


def homeless_experts(model, unexpected: list[str]) -> None:
    """compressed-tensors attaches its schemes to nn.Linear modules; transformers 5 packs a sparse
    layer's experts in 3-D parameters, so per-expert tensors have no module to load into. That
    is this way of driving compressed-tensors that cannot load the model: say so (unsupported)
    rather than judge random experts."""
    packed = [name for name, _ in model.named_parameters() if name.endswith(".experts.gate_up_proj")]
    orphans = [key for key in unexpected if ".experts." in key]
    if packed and orphans:
        raise EngineUnsupported(
            f"compressed-tensors quantizes nn.Linear modules; this transformers model packs its experts in 3-D "
            f"parameters ({packed[0]}), so {len(orphans)} per-expert checkpoint tensors have no module to load into"
        )
