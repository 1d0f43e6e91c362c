"""Builds `planted_loader`, a DELIBERATELY BUGGY TEST DOUBLE distributed as wheels: versions
1.0.0 .. 1.6.0 of a tiny pure-Python package whose FP8 block dequantizer regresses in 1.4.0
(it divides by `weight_scale_inv` instead of multiplying: the name says "inverse", the value is
a multiplier). It exists so that `bisect` has a known first bad version to find, offline.

The wheels are written as zip files directly (no build backend, no network). The package's
engine, `planted_loader.engine:PlantedEngine`, is the harness's reference engine with every
FP8-block Linear re-dequantized by the package's own (versioned) code.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

VERSIONS = ("1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0", "1.5.0", "1.6.0")
FIRST_BAD = "1.4.0"
ENGINE = "planted_loader.engine:PlantedEngine"

CORRECT = '''
def dequantize_fp8_block(weight, scale_inv, block):
    """weight (float8_e4m3fn [N, K]) * its block's scale_inv (a multiplier), float64."""
    rows, cols = weight.shape
    expanded = scale_inv.double().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.double() * expanded
'''

REGRESSED = '''
def dequantize_fp8_block(weight, scale_inv, block):
    """PLANTED REGRESSION (1.4.0 on): reads weight_scale_inv as a divisor."""
    rows, cols = weight.shape
    expanded = scale_inv.double().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.double() / expanded
'''

ENGINE_SOURCE = '''"""DELIBERATELY BUGGY TEST DOUBLE (tests/doubles/planted_loader.py): the harness's reference
engine, except that FP8-block Linears are dequantized by planted_loader.dequant, whose code
regresses in 1.4.0."""

import torch

from harness.engines.reference_engine import ReferenceEngine


class PlantedEngine(ReferenceEngine):
    name = "planted-loader"
    package = "planted_loader"
    runs_specified = True  # activations quantized as the checkpoint says: only the dequantizer regresses

    def load(self, directory):
        from harness.checkpoints.reader import Checkpoint
        from harness.oracle.reference import format_and_knobs

        from planted_loader.dequant import dequantize_fp8_block

        report = super().load(directory)
        fmt, knobs = format_and_knobs(directory)
        if fmt.name != "fp8-block":
            return report
        checkpoint = Checkpoint(directory)
        block = (knobs["block_rows"], knobs["block_cols"])
        for name in checkpoint.names():
            if name.endswith(".weight_scale_inv"):
                module = name.removesuffix(".weight_scale_inv")
                weight = dequantize_fp8_block(checkpoint.tensor(module + ".weight"), checkpoint.tensor(name), block)
                target = self.model.get_submodule(module.replace("language_model.", "")).weight
                with torch.no_grad():
                    target.copy_(weight.to(target.dtype))
        return report
'''


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def write_wheel(directory: Path, version: str, first_bad: str = FIRST_BAD) -> Path:
    """planted_loader-VERSION-py3-none-any.whl in `directory`."""
    from packaging.version import Version

    dist_info = f"planted_loader-{version}.dist-info"
    files = {
        "planted_loader/__init__.py": f'"""Test double (see tests/doubles/planted_loader.py)."""\n__version__ = "{version}"\n',
        "planted_loader/dequant.py": REGRESSED if Version(version) >= Version(first_bad) else CORRECT,
        "planted_loader/engine.py": ENGINE_SOURCE,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: planted_loader\nVersion: {version}\n"
        "Summary: deliberately buggy test double for harness bisect\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: harness-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(path, text.encode()) for path, text in files.items()] + [f"{dist_info}/RECORD,,"]
    files[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    path = Path(directory) / f"planted_loader-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def write_wheels(directory: Path, versions=VERSIONS, first_bad: str = FIRST_BAD) -> list[Path]:
    Path(directory).mkdir(parents=True, exist_ok=True)
    return [write_wheel(directory, v, first_bad) for v in versions]


CASE = f'''# planted_loader's FP8-block regression (tests/doubles/planted_loader.py)
engine = "{ENGINE}"
expect = "agree"

[recipe]
format = "fp8-block"
arch = "llama"
config = {{ hidden_size = 64, intermediate_size = 128, num_hidden_layers = 1 }}
'''
