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
from harness.engines.base import LoadReport
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
        quantization_config = QuantizationConfig.model_validate(raw["quantization_config"])
        report = LoadReport()
        with captured_warnings(report.warnings):
            self.model, tied = unquantized_model(directory)
            apply_quantization_config(self.model, quantization_config)
            compressor = ModelCompressor(quantization_config=quantization_config)
            compressor.compress_model(self.model)
            state = {canonical_name(name): tensor for name, tensor in Checkpoint(directory).tensors()}
            result = self.model.load_state_dict(state, strict=False)
            compressor.decompress_model(self.model)
        report.missing = sorted(set(result.missing_keys) - tied)
        report.unexpected = sorted(result.unexpected_keys)
        return report
