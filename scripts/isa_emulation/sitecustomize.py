"""Emulate a CPU with fewer instruction-set extensions (scripts/measure-gate-noise, and a developer
on one machine kind checking another: docs/ci.md, "Every machine kind").

Put this folder on PYTHONPATH and set HARNESS_EMULATE_ISA to `avx2` or `avx512` (no BF16):
torch's CPU feature queries then answer as such a CPU would, so vLLM loads the kernel library
built for it (`_C_AVX2`, `_C_AVX512`) and skips its AMX paths, and the harness's own instruction-set
class (harness.core.machine.isa_class, which known issues' `isa` preconditions read) says the
same. With ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA set to match, torch's vectorised ops and
oneDNN's GEMMs do the same. torch is patched when a process imports it, never imported here (a
process that imports no torch still imports none). Never used by the suite itself.
"""

import importlib.abc
import importlib.util
import os
import sys
import tempfile

_isa = os.environ.get("HARNESS_EMULATE_ISA")


def _emulate(torch) -> None:
    def _no():
        return False

    torch.cpu._is_amx_tile_supported = _no
    torch.cpu._is_avx512_bf16_supported = _no
    if _isa == "avx2":
        torch.cpu._is_avx512_supported = _no


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: once `torch` is imported by whoever imports it, patches it."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _emulate(module)
            sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module
        return spec


if _isa:
    sys.meta_path.insert(0, _PatchTorchOnImport())
    # inductor's cache key does not include the patched feature queries: a kernel compiled for this
    # machine's own vector width and reused under the emulation aborts (GPTQModel's TorchLinear:
    # "index out of bounds: 0 <= tmp7 < 1L"), so an emulated kind compiles into a cache of its own
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor-emulated-{_isa}")
    )
