"""DELIBERATELY BUGGY TEST DOUBLE with two unrelated bugs, in two formats: it proves that a
campaign keeps exploring after its first new finding and tells the two apart."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.engines.reference_engine import ReferenceEngine


class TwoBugsEngine(ReferenceEngine):
    """fp8-block: the first Linear's weight scaled x2 (a weight finding). ct-fp8-channel: every
    loaded bias replaced by NaN (the seed-000 class). Other formats load correctly."""

    name = "double-two-bugs"

    def load(self, directory):
        from harness.checkpoints.reader import read_json

        report = super().load(directory)
        quantization = read_json(Path(directory) / "config.json", "config.json").get("quantization_config")
        if quantization is None:  # e.g. its own save_pretrained copy (the relation round-trip): loads correctly
            return report
        from harness.oracle.reference import format_and_knobs

        fmt, _ = format_and_knobs(directory)
        with torch.no_grad():
            if fmt.name == "fp8-block":
                self.model.model.layers[0].mlp.down_proj.weight.mul_(2)
            elif fmt.name == "ct-fp8-channel":
                for name, parameter in self.model.named_parameters():
                    if name.endswith(".bias"):
                        parameter.fill_(float("nan"))
        return report
