"""The per-module driver the re-dequantizing fixes share: one bad module never stops the others."""

from __future__ import annotations

import pytest
import torch

from harness.checkpoints.recipe import Recipe, apply_settings
from harness.checkpoints.writer import generate
from harness.fixes._redequantize import QuantizedCheckpoint, mismatches, repair_each_module, write_rounded_once
from harness.fixes._shared import SkipTensor
from harness.fixes.base import FixReport


def test_each_module_is_repaired_skipped_or_refused_on_its_own(tmp_path):
    generate(apply_settings(Recipe(format="fp8-block", arch="llama", seed=0), ["num_hidden_layers=1"]), tmp_path)
    source = QuantizedCheckpoint.open(tmp_path)
    model = torch.nn.Module()
    modules = sorted(source.modules)
    broken, skipped = modules[0], modules[1]
    for module in modules:  # a live Linear under each checkpoint module's name
        parent = model
        *path, leaf = module.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, torch.nn.Linear(4, 4, bias=False))

    def repair_one(target):
        if target.module == broken:
            raise KeyError("weight_scale_inv")  # a malformed module
        _, _, weight = target.live_weight()
        if target.module == skipped:
            raise SkipTensor("not affected")
        return f"{tuple(weight.shape)} repaired"

    report = repair_each_module(model, source, FixReport("test"), None, repair_one)
    assert report.skipped == {
        f"{broken}.weight": "cannot check it: KeyError: 'weight_scale_inv'",
        f"{skipped}.weight": "not affected",
    }
    assert report.repaired == [f"{m}.weight" for m in modules[2:]]
    assert report.warnings == [f"{m}.weight: (4, 4) repaired" for m in modules[2:]]


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", devices())
def test_live_weights_are_judged_and_written_wherever_they_live(device):
    """A model on CUDA against the checkpoint's reading (float64, on the CPU): counted and
    repaired without a device error (issue 16 measured fp8-block-grid failing on a CUDA model:
    'Expected all tensors to be on the same device'). The CUDA case runs where a GPU is (the
    GPU lane); on the CPU the same rule holds."""
    want = torch.tensor([[1.0, 2.0], [3.0, 1e-3]], dtype=torch.float64)
    live = torch.nn.Parameter(want.to(torch.bfloat16).to(device), requires_grad=False)
    live.data[1, 1] = 7.0  # one element wrong
    assert mismatches(live, want, 0.0, 0.0) == 1
    write_rounded_once(live, want)
    assert live.device.type == device and mismatches(live, want, 0.0, 0.0) == 0
