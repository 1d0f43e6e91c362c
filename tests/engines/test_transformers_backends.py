"""How transformers' quantizers say a backend package is missing (harness.engines.transformers_engine.
missing_backend): a package that is really not importable here makes the engine `unsupported`, in
its words; one that is importable leaves the error a load failure to judge."""

from __future__ import annotations

import pytest

from harness.engines.transformers_engine import missing_backend


@pytest.mark.parametrize(
    ("message", "package"),
    [
        ("Loading a GPTQ quantized model requires nosuch_optimum (`pip install nosuch_optimum`)", "nosuch_optimum"),
        ("Loading an AWQ model requires the `nosuch-gptq` library. Please install it with ...", "nosuch-gptq"),
        # QuarkHfQuantizer without amd-quark
        ("Please install the latest version of NosuchQuark (>=0.12).Please refer to https://quark.docs", "NosuchQuark"),
        ("Please install the latest version of Torch (>=2).", None),  # importable: not missing
        ("Loading failed: a size mismatch", None),
    ],
)
def test_a_quantizer_naming_a_package_not_importable_here_is_a_missing_backend(message, package):
    assert missing_backend(RuntimeError(message)) == package
