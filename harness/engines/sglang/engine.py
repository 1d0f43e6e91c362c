"""`sglang`: SGLang's own model loader on CPU, in SGLang's interpreter, judged on what it places.

SGLang (0.5.23) cannot run a model on these CPUs (its kernels are CUDA builds; its CPU backend needs
sgl-kernel's CPU build and AMX for FP8: docs/measurements/sglang-cpu.md), but its loading runs: the
checkpoint is loaded as SGLang's engine loads it, by `DefaultModelLoader.load_model` (SGLang's model
class for the architecture, its quantization config, every parameter's own `weight_loader`, then
each layer's `process_weights_after_loading`), in a gloo world of one, with the kernel choices that
ask a CUDA driver stood in (`stand_ins`). The weights are read twice: as placed, just before
`process_weights_after_loading`, and as processed. SGLang lays weights out as vLLM does (fused
`qkv_proj` / `gate_up_proj` with their `output_partition_sizes`, FusedMoE's `w13` [gate; up] and
`w2`, a padded vocabulary), so the placed weights are read back under the checkpoint's names by the
vllm engine's reading. Where a Linear's processing leaves it applying other weights than it placed
(beyond one float32 rounding, and the one E4M3 requantization a per-tensor FP8 method does under its
kept scale), the processed weights are the ones reported, and the load report says so. The forward
is unsupported, in SGLang's own words. (Importing the vllm engine's reading also runs its
`setdefault` of VLLM_ENABLE_V1_MULTIPROCESSING in this worker, which nothing of SGLang reads.)
"""

from __future__ import annotations

import gc
import logging
import os
import re
import traceback
from contextlib import contextmanager

import torch

from harness.core.errors import first_line
from harness.core.naming import canonical_name
from harness.engines.base import Engine, EngineRefuses, EngineUnsupported, LoadReport
from harness.engines.hf_common import captured_warnings, stored_names
from harness.engines.sglang.applied import applied_weight
from harness.engines.sglang.stand_ins import stood_in
from harness.engines.vllm.engine import VllmEngine, checkpoint_config
from harness.engines.vllm.post_load import FLOAT32_ROUNDING, beyond, requantized_bound

# SGLang's loaders import only without its CPU backend (which needs sgl-kernel's CPU build):
# setdefault, so that a user's explicit choice still wins (and then says why it cannot load)
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "0")

#: SGLang's fused Linears and the checkpoint modules they stack, in row order (its models'
#: stacked_params_mapping; vLLM's models name the same in `packed_modules_mapping`)
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: SGLang's models log a checkpoint tensor they have no parameter for, then go on
NOT_LOADED = re.compile(r"Parameter (\S+) not found in params_dict")
#: SGLang's import-time chatter about the host and its own modules, not about the checkpoint
HOST_NOISE = (
    "Cannot detect CUDA architecture",
    "Ignore import error when loading",
    "is deprecated",
    "Triton is not supported on current platform",
)
#: SGLang's words where what it would run depends on a GPU it asks for and this machine lacks: a
#: limit of the machine (unsupported), not a finding. Each met on the AVX-512 kind with sglang 0.5.23:
MACHINE_LIMITS = (
    "Found no NVIDIA driver",  # a capability query no stand-in answers (compressed-tensors int4/int8)
    "Current platform does not support",  # NVFP4 MoE: "Please use Blackwell and above"
    "require SM",  # ModelOpt NVFP4's dense GEMM backends "require SM100+"
    "Unknown quantization method",  # gptq: SGLang maps it to gptq_marlin only where a GPU says so
    "is not supported for quantization method awq.",  # awq in bfloat16: awq_marlin is chosen by the GPU too
    "No compressed-tensors compatible scheme",  # MXFP4: no scheme without the GPU's capability
    "non-Marlin GPTQ CUDA kernel has been removed",  # AutoRound's gptq config: Marlin is chosen by the GPU
    "is implemented only for",  # int8 W8A8 MoE: "implemented only for NPU for now"
)
#: a module SGLang built with a quantization method that processes nothing
UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod", "NoneType")


class SglangEngine(VllmEngine):
    name = "sglang"
    package = "sglang"

    def __init__(self):
        super().__init__()
        self.processed: dict[str, torch.Tensor] = {}
        self.methods: dict[str, str] = {}
        #: checkpoint name -> the weight a Linear applies after processing, where it is not the placed one
        self.applied: dict[str, torch.Tensor] = {}

    def version(self) -> str:
        return Engine.version(self)

    def unsupported_reason(self, format_name):
        return None  # what SGLang cannot load it says itself, while it loads

    def load(self, directory: str) -> LoadReport:
        from harness.checkpoints.reader import declared_format

        config = checkpoint_config(directory)
        self.unload()
        self.fmt, self.knobs = declared_format(directory) if "quantization_config" in config else (None, None)
        self.vocab_size, self.config, self.stored_names = config["vocab_size"], config, stored_names(directory)
        report, used = LoadReport(), []
        join_world_of_one()
        try:
            with captured_warnings(report.warnings, loggers=("sglang",)), stood_in(used), self.capture_weights():
                model = build_and_load(directory, config.get("dtype") or config.get("torch_dtype") or "auto")
        except BaseException as error:
            self.unload()
            if asks_for_a_gpu(error):
                raise EngineUnsupported(f"SGLang cannot load this checkpoint here: {first_line(error)}") from error
            refusal = sglang_refusal(error)
            if refusal:
                raise EngineRefuses(f"SGLang: {refusal}") from error
            raise
        self.processed = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
        self.methods = {  # a compressed-tensors Linear's scheme says more than its method
            name: type(getattr(module, "scheme", None) or module.quant_method).__name__
            for name, module in model.named_modules()
            if getattr(module, "quant_method", None) is not None
        }
        del model
        self.forward_unsupported = forward_unsupported()
        not_loaded = [m.group(1) for m in map(NOT_LOADED.search, report.warnings) if m]
        report.unexpected += list(dict.fromkeys(not_loaded))
        said = [w for w in report.warnings if not NOT_LOADED.search(w) and not any(n in w for n in HOST_NOISE)]
        report.warnings = list(dict.fromkeys(said)) + used
        report.warnings += self.judge_processing()
        return report

    @contextmanager
    def capture_weights(self):
        """While active, SGLang's DefaultModelLoader copies every parameter (and what is needed to
        unfuse it) just before it runs each layer's process_weights_after_loading."""
        from sglang.srt.model_loader.loader import DefaultModelLoader

        original = DefaultModelLoader.__dict__["postprocess_weights"]
        self.snapshot, self.modules = {}, {}

        def snapshot_then_process(model, target_device):
            self.record(model)
            return original.__func__(model, target_device)

        DefaultModelLoader.postprocess_weights = staticmethod(snapshot_then_process)
        try:
            yield
        finally:
            DefaultModelLoader.postprocess_weights = original

    def record(self, model) -> None:
        """vLLM's record of the placed weights (copies that keep their strides), with SGLang's fused
        Linears' parts named: its models stack them by a mapping of their own."""
        super().record(model)
        self.snapshot = {name: tensor.clone() for name, tensor in self.snapshot.items()}
        stored_modules = {canonical_name(n).rpartition(".")[0] for n in self.stored_names or ()}
        for name, info in self.modules.items():
            parent, leaf = name.rpartition(".")[0], name.rpartition(".")[2]
            parts = STACKED.get(leaf, ())
            sizes = info.get("partitions", [])
            on_disk_fused = canonical_name(name) in stored_modules
            if len(parts) == len(sizes) and not on_disk_fused and f"{parent}.{parts[0]}" in stored_modules:
                info["parts"] = list(zip(parts, sizes, strict=True))
                del info["partitions"]

    def judge_processing(self) -> list[str]:
        """Each quantized Linear's processed weights decoded (applied.py) against its placed ones:
        where they differ beyond one float32 rounding and one E4M3 requantization under the one scale
        it kept, the processed ones are what `weights` reports; a line per such Linear, and one per
        method whose processed layout is not read here."""
        placed = self.vocabulary_rows(super().weights())
        notes, unread = [], set()
        for module, method in sorted(self.methods.items()):
            if method in UNQUANTIZED:
                continue
            before = self.tensors_of(self.snapshot, module)
            after = self.tensors_of(self.processed, module)
            if "weight" not in before and "weight_packed" not in before:
                continue  # a FusedMoE's or an attention's method: not a Linear
            applied = applied_weight(after, before, self.fmt, self.knobs)
            if applied is None:
                unread.add(method)
                continue
            names = self.checkpoint_names(module)
            if not all(n in placed for n in names):
                continue
            expected = torch.cat([placed[n].to(torch.float64) for n in names])
            applied = applied[: expected.shape[0]]  # a padded vocabulary's rows past it
            scale = after.get("weight_scale")
            bound = FLOAT32_ROUNDING * expected.abs()
            if after.get("weight", torch.empty(0)).dtype == torch.float8_e4m3fn and scale is not None:
                if scale.numel() == 1:  # requantized under the one scale it kept
                    bound = bound + requantized_bound(expected, float(scale.to(torch.float64)))
            problem = beyond(applied, expected, bound)
            if problem is None:
                continue
            start = 0
            for name in names:
                rows = placed[name].shape[0]
                self.applied[name] = applied[start : start + rows].to(torch.float32)
                start += rows
            notes.append(f"{module} ({method}): after process_weights_after_loading it {problem}")
        notes += [
            f"{method}: its processed layout is not read here; its placed weights are judged" for method in unread
        ]
        return notes

    @staticmethod
    def tensors_of(parameters: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
        prefix = f"{module}."
        return {
            n[len(prefix) :]: t for n, t in parameters.items() if n.startswith(prefix) and "." not in n[len(prefix) :]
        }

    def checkpoint_names(self, module: str) -> list[str]:
        parts = self.modules.get(module, {}).get("parts")
        parent = module.rpartition(".")[0]
        if not parts:
            return [canonical_name(f"{module}.weight")]
        return [canonical_name(f"{parent}.{part}.weight") for part, _ in parts]

    def weights(self):
        return self.vocabulary_rows(super().weights()) | self.applied

    def vocabulary_rows(self, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A vocabulary-parallel module's rows past the vocabulary (SGLang pads to a multiple of 64)
        dropped, a quantized one's too (vLLM's reading drops them for unquantized weights only)."""
        for module, info in self.modules.items():
            name = canonical_name(f"{module}.weight")
            if "vocab" in info and name in held and held[name].shape[0] > info["vocab"]:
                held[name] = held[name][: info["vocab"]]
        return held

    def dequantized_parts(self, module: str, tensors: dict, info: dict) -> dict[str, torch.Tensor]:
        """vLLM's reading, except that a fused Linear holding one entry per part of a tensor other than
        its weight scale (NVFP4's `weight_global_scale` and `input_global_scale`, before SGLang's
        processing reduces them to one) is read part by part, each part with its own entry."""
        parts = info.get("parts", [])
        per_part = len(parts) > 1 and any(t.dim() == 1 and t.numel() == len(parts) for t in tensors.values())
        if not per_part:
            return super().dequantized_parts(module, tensors, info)
        parent, rows_total = module.rpartition(".")[0], sum(rows for _, rows in parts)
        plain = {key: value for key, value in info.items() if key != "parts"}
        result, start = {}, 0
        for index, (part, rows) in enumerate(parts):
            piece = {}
            for suffix, tensor in tensors.items():
                if tensor.dim() == 1 and tensor.numel() == len(parts):
                    piece[suffix] = tensor[index : index + 1]
                elif tensor.dim() >= 1 and tensor.shape[0] == rows_total:
                    piece[suffix] = tensor[start : start + rows]
                else:
                    piece[suffix] = tensor
            result[f"{parent}.{part}.weight"] = super().dequantized_parts(f"{parent}.{part}", piece, plain)["weight"]
            start += rows
        return result

    def load_variant(self, directory, variant):
        """`sentinel`: SGLang's model built with every parameter's bytes 0xFF (NaN in every float dtype)
        before its loader writes any, as vLLM's reload tests fill them: a parameter no loader writes
        (a quantized head's, whose checkpoint tensors have no parameter) stays NaN."""
        if variant != "sentinel":
            return Engine.load_variant(self, directory, variant)
        with sentinel_parameters():
            return self.load(directory)

    def logprobs(self, sequences):
        raise EngineUnsupported(self.forward_unsupported or forward_unsupported())

    def generate(self, prompt, max_new_tokens):
        raise EngineUnsupported(self.forward_unsupported or forward_unsupported())

    def probe_linears(self, inputs):
        raise EngineUnsupported(self.forward_unsupported or forward_unsupported())

    def kv_cache_scales(self):
        raise EngineUnsupported(self.forward_unsupported or forward_unsupported())

    def unload(self):
        self.snapshot, self.modules, self.processed, self.methods, self.applied = {}, {}, {}, {}, {}
        gc.collect()


@contextmanager
def sentinel_parameters():
    """While active, every model SGLang's loader builds (`_initialize_model`, before load_weights) has
    each parameter's bytes set to 0xFF."""
    from sglang.srt.model_loader import loader

    original = loader._initialize_model

    def build_then_fill(*args, **kwargs):
        model = original(*args, **kwargs)
        with torch.no_grad():
            for parameter in filter(torch.numel, model.parameters()):  # contiguous as built: a flat view
                parameter.data.view(-1).view(torch.uint8).fill_(0xFF)
        return model

    loader._initialize_model = build_then_fill
    try:
        yield
    finally:
        loader._initialize_model = original


def join_world_of_one() -> None:
    """SGLang's layers need its parallel groups even at tensor-parallel size 1: a gloo world of one,
    made once per process as SGLang's own layer tests make it (sglang.test.layer_ut_utils, whose
    module cannot be imported with CUDA_VISIBLE_DEVICES empty: it reads the first device's id)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    if parallel_state.model_parallel_is_initialized():
        return
    for variable, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29000 + os.getpid() % 1000))):
        os.environ.setdefault(variable, value)
    if not torch.distributed.is_initialized():
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(
        ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test", ranks=SpawnRanks(world_rank=0)
    )
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")


def build_and_load(directory: str, dtype: str):
    """SGLang's engine's own path: ModelConfig of the checkpoint, DefaultModelLoader. The dtype is the
    checkpoint's, as the harness loads every engine: SGLang's "auto" loads a float32 checkpoint in
    float16 (measured: its embeddings and norms rounded to float16)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model_config = ModelConfig(directory, trust_remote_code=False, dtype=dtype)
    with torch.no_grad():
        return DefaultModelLoader(LoadConfig()).load_model(model_config=model_config, device_config=DeviceConfig("cpu"))


def asks_for_a_gpu(error: BaseException) -> bool:
    """SGLang's words say what it would run needs a GPU (MACHINE_LIMITS), or it failed on the line
    where it reads the GPU's capability (moe_wna16's `capability_tuple[0] * 10`: None on CPU)."""
    if any(limit in str(error) for limit in MACHINE_LIMITS):
        return True
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    return bool(frames) and "capability" in (frames[-1].line or "")


def forward_unsupported() -> str:
    """Why SGLang cannot run a forward here, in its own words: its kernel library does not load."""
    try:
        import sgl_kernel  # noqa: F401
    except BaseException as error:  # ImportError, or SGLang's own message about its binaries
        return f"SGLang has no kernel to run a forward here: {first_line(error)}"
    return "SGLang's forward needs its GPU kernels; the harness runs its loaders on CPU only"


def sglang_refusal(error: BaseException) -> str | None:
    """SGLang's own words when it refuses the checkpoint on purpose: a ValueError from one of its
    checks while it builds a layer or processes it (a partition that is not whole scale blocks,
    NVFP4 W4A16's fused global scales), or a bare `assert` in its quantization code while it picks
    a method; not an error while a tensor is copied in (a loader's crash is a load-error)."""
    if error.__traceback__ is None or not isinstance(error, ValueError | AssertionError):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if "/sglang/" in f.filename.replace(os.sep, "/")]
    if not own or any("weight_loader" in f.name or f.name == "load_weights" for f in frames):
        return None
    if isinstance(error, ValueError):
        return first_line(error) if str(error) else None
    last = own[-1]
    if "layers/quantization" not in last.filename.replace(os.sep, "/") and "layers/moe" not in last.filename:
        return None
    said = f": {error}" if str(error) else ""
    return f"`{last.line}` failed in {last.name} ({os.path.basename(last.filename)}:{last.lineno}){said}"


logging.getLogger("sglang").setLevel(logging.WARNING)  # its per-shard progress and kernel-choice chatter
