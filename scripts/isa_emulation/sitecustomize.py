"""Emulate a CPU with fewer instruction-set extensions, for scripts/measure-gate-noise only.

Put this folder on PYTHONPATH and set HARNESS_EMULATE_ISA to `avx2` or `avx512` (no BF16):
torch's CPU feature queries then answer as such a CPU would, so vLLM loads the kernel library
built for it (`_C_AVX2`, `_C_AVX512`) and skips its AMX paths. With ATEN_CPU_CAPABILITY and
ONEDNN_MAX_CPU_ISA set to match, torch's vectorised ops and oneDNN's GEMMs do the same. Never
used by the suite.
"""

import os

_isa = os.environ.get("HARNESS_EMULATE_ISA")
if _isa:
    import torch

    def _no():
        return False

    torch.cpu._is_amx_tile_supported = _no
    torch.cpu._is_avx512_bf16_supported = _no
    if _isa == "avx2":
        torch.cpu._is_avx512_supported = _no
