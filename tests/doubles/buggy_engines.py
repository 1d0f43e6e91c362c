"""DELIBERATELY BUGGY TEST DOUBLES. Not engines anyone should use: each reproduces one bug class
on purpose, so the tests can prove the harness detects that class. They also show how a user's
own loader plugs in: `--engines tests.doubles.buggy_engines:DroppedScaleEngine`."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from harness.engines.base import EngineUnsupported, LoadReport
from harness.engines.reference_engine import ReferenceEngine
from harness.engines.transformers_engine import TransformersEngine


class DroppedScaleEngine(ReferenceEngine):
    """Bug class of seed 003: one Linear keeps its raw FP8 values, its scale reported unexpected."""

    name = "double-dropped-scale"

    def load(self, directory):
        from harness.checkpoints.reader import Checkpoint

        report = super().load(directory)
        checkpoint = Checkpoint(directory)
        scale_names = sorted(n for n in checkpoint.names() if n.endswith("weight_scale_inv"))
        victim = scale_names[-1]
        module = victim.removesuffix(".weight_scale_inv")
        raw = checkpoint.tensor(f"{module}.weight").to(torch.float32)
        self.model.get_submodule(module.replace("language_model.", "")).weight.data.copy_(raw)
        report.unexpected.append(victim)
        return report


class ClobberedBiasEngine(ReferenceEngine):
    """Bug class of seed 000: biases re-materialized after loading (torch.empty garbage / NaN)."""

    name = "double-clobbered-bias"

    def load(self, directory):
        report = super().load(directory)
        for name, parameter in self.model.named_parameters():
            if name.endswith(".bias"):
                parameter.data.fill_(float("nan"))
        return report


class SwappedGlobalScaleEngine(ReferenceEngine):
    """Bug class of seed 002: an NVFP4 global scale read with the other convention (here: every
    NVFP4 weight scaled by gs^2, as a divisor read as a multiplier would be)."""

    name = "double-swapped-global-scale"

    def load(self, directory):
        from harness.checkpoints.reader import Checkpoint

        report = super().load(directory)
        checkpoint = Checkpoint(directory)
        for name in checkpoint.names():
            if name.endswith("weight_global_scale"):
                module = name.removesuffix(".weight_global_scale")
                gs = float(checkpoint.tensor(name).float().reshape(-1)[0])
                self.model.get_submodule(module).weight.data.mul_(gs * gs)
        return report


class DoubleScaleEngine(ReferenceEngine):
    """An FP8 scale applied twice: every FP8 weight is its e4m3 codes times the scale squared, per
    scale block (fp8-block: codes x weight_scale_inv^2; ct-fp8-*: codes x weight_scale^2). The bug
    injected into transformers that the fp8-block grid known issue must not excuse."""

    name = "double-double-scale"

    def load(self, directory):
        from harness.checkpoints.reader import Checkpoint
        from harness.core.naming import canonical_name
        from harness.formats.fp8_block import expand_block_grid
        from harness.oracle.reference import format_and_knobs, group_modules

        report = super().load(directory)
        checkpoint = Checkpoint(directory)
        fmt, knobs = format_and_knobs(checkpoint)
        modules, _ = group_modules(checkpoint.names(), fmt)
        for module, names in modules.items():
            scale_name = names.get("weight_scale_inv") or names.get("weight_scale")
            codes = checkpoint.tensor(names["weight"]) if "weight" in names else None
            if scale_name is None or codes is None or codes.dtype != torch.float8_e4m3fn:
                continue
            scale = checkpoint.tensor(scale_name).to(torch.float64)
            rows, cols = codes.shape
            grid = scale.reshape(1, 1) if scale.numel() == 1 else scale
            twice = expand_block_grid(grid * grid, rows, cols, fmt.scale_block(knobs, (rows, cols)))
            weight = self.model.get_submodule(canonical_name(module)).weight
            weight.data.copy_((codes.to(torch.float64) * twice).to(weight.dtype))
        return report


class CrashingEngine(ReferenceEngine):
    """Dies hard in the middle of a load, as a segfaulting kernel would."""

    name = "double-crash"

    def load(self, directory):
        os._exit(139)


class HangingEngine(ReferenceEngine):
    name = "double-hang"

    def load(self, directory):
        time.sleep(3600)
        return LoadReport()


class MemoryHogEngine(ReferenceEngine):
    name = "double-memory-hog"

    def load(self, directory):
        hog = []
        for _ in range(64):
            hog.append(torch.ones(64 * 2**20, dtype=torch.uint8))  # 64 MiB at a time, touched
            time.sleep(0.05)
        time.sleep(3600)
        return LoadReport()


class ConfigTrustingEngine(ReferenceEngine):
    """Trusts the config over the tensors, the bug class every config/tensor disagreement
    (harness.checkpoints.disagreements) probes: a module the ignore list names gets its stored
    values as weights; a quantized module whose scale never arrived (absent, renamed, left out of
    the index, or placed by it where it is not) gets the scale's initial value 1 and loads anyway;
    a module stored plain but not ignored is forced through FP8; a "frozen" status makes every
    stored value a weight; an orphan scale is applied to the sibling module whose name it shares
    the prefix of. It reads the manifest to know which disagreement the checkpoint carries."""

    name = "double-config-trusting"

    def load(self, directory):
        from harness.checkpoints.reader import Checkpoint
        from harness.core.naming import canonical_name
        from harness.engines.hf_common import checkpoint_dtype, unquantized_model
        from harness.oracle.reference import format_and_knobs, group_modules

        manifest = json.loads((Path(directory) / "harness_manifest.json").read_text())
        kind = manifest["resolved"]["perturb"]["disagreement"]
        self._copy = tempfile.TemporaryDirectory(prefix="double-config-trusting-")  # removed with the engine
        checkpoint = Checkpoint(_index_entries_it_can_open(Path(directory), Path(self._copy.name)))
        fmt, knobs = format_and_knobs(checkpoint)
        modules, plain = group_modules(checkpoint.names(), fmt, checkpoint.storage_dtypes())
        config = checkpoint.quantization_config
        ignored = set(config.get("ignore", config.get("modules_to_not_convert", [])))
        report = LoadReport()
        state = {}
        for module, names in modules.items():
            if fmt.suffixes[0] not in names:  # an orphan scale: see below
                continue
            raw = checkpoint.tensor(names[fmt.suffixes[0]]).to(torch.float64)
            if module in ignored or kind == "status-not-compressed":
                state[f"{module}.weight"] = raw  # the stored codes as weights
                continue
            try:
                state[f"{module}.weight"] = fmt.dequantize({s: checkpoint.tensor(n) for s, n in names.items()}, knobs)
            except Exception:
                state[f"{module}.weight"] = raw  # the scale's initial value: 1
                report.missing.append(f"{module}.{fmt.marker}")
        for name in plain:
            module = name.rpartition(".")[0]
            forced = kind == "plain-not-ignored" and module in manifest["modules"]
            tensor = checkpoint.tensor(name)
            state[name] = (tensor.to(torch.float8_e4m3fn) if forced else tensor).to(torch.float64)
        for name in manifest.get("unused_tensors", []):  # the orphan scales a sibling by prefix
            parent = name.rsplit(".", 2)[0]
            sibling = next(m for m in sorted(modules) if m.rpartition(".")[0] == parent and m != name.rsplit(".", 1)[0])
            state[f"{sibling}.weight"] = state[f"{sibling}.weight"] * 2.0
        self.model, _ = unquantized_model(directory)
        dtype = checkpoint_dtype(directory)
        result = self.model.load_state_dict({canonical_name(n): t.to(dtype) for n, t in state.items()}, strict=False)
        report.unexpected = sorted(result.unexpected_keys)
        return report


def _index_entries_it_can_open(directory: Path, scratch: Path) -> Path:
    """`directory`, or where its index names a shard file or tensor that is not there, a copy in
    `scratch` whose index skips those entries (what ConfigTrustingEngine loads)."""
    from safetensors import safe_open

    index_path = directory / "model.safetensors.index.json"
    if not index_path.is_file():
        return directory
    index = json.loads(index_path.read_text())

    def there(name: str, shard: str) -> bool:
        if not (directory / shard).is_file():
            return False
        with safe_open(str(directory / shard), "pt") as stored:
            return name in stored.keys()

    kept = {name: shard for name, shard in index["weight_map"].items() if there(name, shard)}
    if kept == index["weight_map"]:
        return directory
    copy = scratch / "index-entries-it-can-open"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(directory, copy)
    (copy / index_path.name).write_text(json.dumps(index | {"weight_map": kept}))
    return copy


class KVScaleNamingEngine(ReferenceEngine):
    """Knows one KV-scale naming only (`self_attn.k_scale` / `v_scale`): the others are dropped as
    unexpected keys and a missing half of the pair is reported missing, then run with its initial
    value, as the engines that register those parameters do (cases/known_issues.toml)."""

    name = "double-kv-scale-naming"
    runs_specified = True  # its activations and KV cache as specified: only its naming is the bug

    def load(self, directory):
        from harness.checkpoints.kv_scales import is_kv_scale
        from harness.checkpoints.reader import Checkpoint
        from harness.oracle.kv_cache import declares_fp8_kv_cache

        report = super().load(directory)
        checkpoint = Checkpoint(directory)
        names = [n for n in checkpoint.names() if is_kv_scale(n)]
        report.unexpected += [n for n in names if not n.endswith(("self_attn.k_scale", "self_attn.v_scale"))]
        # where the config declares the cache, every layer's attention registers the pair
        declared = declares_fp8_kv_cache(checkpoint.quantization_config)
        layers = (
            [f"model.layers.{layer}" for layer in range(checkpoint.config["num_hidden_layers"])] if declared else []
        )
        for layer in layers:
            for half in ("k_scale", "v_scale"):
                if f"{layer}.self_attn.{half}" not in names:
                    report.missing.append(f"{layer}.self_attn.{half}")
        return report


class ActivationsAsSpecifiedEngine(ReferenceEngine):
    """NOT BUGGY: the control for the activation doubles below. The reference's forward with every
    quantized Linear's input quantized as the checkpoint specifies: what a correct engine computes.
    Its doubles change only `forward_plan`; the forward and the activation probe both run it."""

    name = "double-activations-as-specified"
    runs_specified = True

    def forward_plan(self):
        return self.activations

    def logprobs(self, sequences):
        return self._with_plan(lambda: super(ActivationsAsSpecifiedEngine, self).logprobs(sequences))

    def probe_linears(self, inputs):
        return self._with_plan(lambda: super(ActivationsAsSpecifiedEngine, self).probe_linears(inputs))

    def kv_cache_scales(self):
        return self._with_plan(lambda: super(ActivationsAsSpecifiedEngine, self).kv_cache_scales())

    def _with_plan(self, run):
        plan = self.activations
        if isinstance(plan, str):  # weight-only: nothing to change
            return run()
        self.activations = self.forward_plan()
        try:
            return run()
        finally:
            self.activations = plan


class ActivationsIgnoredEngine(ReferenceEngine):
    """Bug class: an activation-quantized checkpoint run with its activations left in the model
    dtype (input scales dropped, the scheme never applied): the weight-only forward."""

    name = "double-activations-ignored"


class InvertedInputScaleEngine(ActivationsAsSpecifiedEngine):
    """Bug class: the static activation scale read in the other convention (x * s for x / s; an
    NVFP4 input global scale taken as a multiplier where it is a divisor, or the reverse)."""

    name = "double-inverted-input-scale"

    def forward_plan(self):
        plan = self.activations
        return dataclasses.replace(
            plan, inputs={name: None if s is None else 1.0 / s.to(torch.float64) for name, s in plan.inputs.items()}
        )


class KVCacheIgnoredEngine(ActivationsAsSpecifiedEngine):
    """Bug class: a declared FP8 KV cache run unquantized (its k/v scales loaded or not, never
    applied); the activations of the Linears are quantized as specified."""

    name = "double-kv-cache-ignored"

    def forward_plan(self):
        return dataclasses.replace(self.activations, kv={})


class KVCacheIgnoredUntoldEngine(KVCacheIgnoredEngine):
    """Bug class as KVCacheIgnoredEngine, in an engine that does not tell which scales its cache uses
    (a user's loader): only its logits can show it."""

    name = "double-kv-cache-ignored-untold"

    def kv_cache_scales(self):
        raise EngineUnsupported("this double does not tell which scales its KV cache uses")


class KVScalesDefaultEngine(ActivationsAsSpecifiedEngine):
    """Bug class: the FP8 KV cache quantized with scale 1.0 for keys and values (the checkpoint's
    k/v scales never reach the attention layer, its placeholders' initial value stays), the
    Linears' activations as specified."""

    name = "double-kv-scales-default"

    def forward_plan(self):
        ones = {name: (torch.ones(1), torch.ones(1)) for name in self.activations.kv}
        return dataclasses.replace(self.activations, kv=ones)


class FusedPartInputScaleEngine(ActivationsAsSpecifiedEngine):
    """Bug class: fused parts (q/k/v, gate/up) quantize their inputs with one part's static scale (the
    first part's) instead of each part's own, as a loader that fuses the projections and keeps one
    input scale without merging them by the format's rule would."""

    name = "double-fused-part-input-scale"

    def forward_plan(self):
        inputs = dict(self.activations.inputs)
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            for name in [n for n in inputs if n.endswith(group[0])]:
                first = inputs[name]
                for other in group[1:]:
                    sibling = name.removesuffix(group[0]) + other
                    if sibling in inputs:
                        inputs[sibling] = first
        return dataclasses.replace(self.activations, inputs=inputs)


class CachedConversionEngine(ReferenceEngine):
    """Bug class for the relation `load-twice`: state kept across loads in one process. The final
    norm is stored in an offset convention (w - 1) and converted in place on a tensor the engine
    caches per checkpoint: right on the first load, converted again (w + 1) on every later one."""

    name = "double-cached-conversion"
    _stored: dict[str, torch.Tensor] = {}

    def load(self, directory):
        report = super().load(directory)
        norm = self.model.model.norm
        stored = self._stored.setdefault(str(directory), norm.weight.data.clone() - 1)
        stored.add_(1)  # BUG: the conversion runs on the cached tensor itself
        norm.weight.data = stored
        return report


class UnwrittenParameterEngine(ReferenceEngine):
    """Bug class for the relation `sentinel`: a parameter the loader never writes and never
    reports missing (the final norm's weight), so it keeps whatever its storage held: the model
    class's initial value here, the NaN sentinel under `sentinel`."""

    name = "double-unwritten-parameter"

    def load(self, directory):
        original = torch.nn.Module.load_state_dict

        def skipping(module, state, strict=True, assign=False):
            victim = "model.norm.weight"
            result = original(module, {k: v for k, v in state.items() if k != victim}, strict=strict, assign=assign)
            if victim in result.missing_keys:
                result.missing_keys.remove(victim)  # BUG: not reported either
            return result

        torch.nn.Module.load_state_dict = skipping
        try:
            return super().load(directory)
        finally:
            torch.nn.Module.load_state_dict = original


class NoForwardEngine(ReferenceEngine):
    """NOT BUGGY in its weights: an engine that loads correctly but has no kernel for the forward
    here (as vLLM's MoE on a CPU without one): every forward is EngineUnsupported."""

    name = "double-no-forward"

    def logprobs(self, sequences):
        raise EngineUnsupported("this double has no kernel for the forward here")


class NoForwardUnwrittenParameterEngine(UnwrittenParameterEngine):
    """Bug class of UnwrittenParameterEngine, in an engine with no kernel for the forward here: what
    it loaded is still compared."""

    name = "double-no-forward-unwritten-parameter"

    def logprobs(self, sequences):
        raise EngineUnsupported("this double has no kernel for the forward here")


class LossySaveEngine(ReferenceEngine):
    """Bug class for the relation `round-trip`: saving rounds every weight through float16 (a save
    path that casts to a default dtype), so the reloaded model is not the one that was loaded."""

    name = "double-lossy-save"

    def save(self, directory):
        dtype = self.model.dtype
        self.model.to(torch.float16)
        try:
            self.model.save_pretrained(directory)
        finally:
            self.model.to(dtype)
        config = Path(directory) / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "dtype": str(dtype).removeprefix("torch.")}))


class GateUpBlocksEngine(ReferenceEngine):
    """Bug class for gpt-oss's packed experts: gate_up read as [gate rows; up rows], the order
    every other fused gate_up stores, instead of gpt-oss's interleaved gate, up, gate, ..."""

    name = "double-gate-up-blocks"

    def load(self, directory):
        report = super().load(directory)
        for name, parameter in self.model.named_parameters():
            if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.gate_up_proj_bias"):
                half = parameter.shape[-1] // 2
                # BUG: stored row j taken as gate j and row half + j as up j, then interleaved
                source = torch.stack([torch.arange(half), torch.arange(half, 2 * half)], dim=1).flatten()
                parameter.data.copy_(parameter.data[..., source])
        return report


class E8M0OffByOneEngine(ReferenceEngine):
    """Bug class for E8M0 scales: the exponent bias taken as 128 (2**7) instead of 127, every MXFP4
    expert weight half of what the checkpoint says (silent: the model still runs)."""

    name = "double-e8m0-off-by-one"

    def load(self, directory):
        report = super().load(directory)
        for name, parameter in self.model.named_parameters():
            if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
                parameter.data.mul_(0.5)
        return report


class RepackedAfterLoadingEngine(ReferenceEngine):
    """Bug class of an engine's processing after loading (a kernel's repack, a fused scale taken as
    min instead of max): its loader places every weight exactly, then the weights its forward
    applies to each k_proj are halved. What it holds, read where the loader put them, is right."""

    name = "double-repacked-after-loading"

    def load(self, directory):
        report = super().load(directory)
        self.placed = super().weights()
        for name, parameter in self.model.named_parameters():
            if name.endswith("self_attn.k_proj.weight"):
                parameter.data.mul_(0.5)  # BUG: the kernel's copy, after the loader's weights were read
        return report

    def weights(self):
        return self.placed


class RefusingEngine(ReferenceEngine):
    """Bug class of an engine that refuses, on purpose and in its own words, a checkpoint its format
    allows (a shape check stricter than the format: vLLM's validate_fp8_block_shape)."""

    name = "double-refusing"

    def load(self, directory):
        from harness.engines.base import EngineRefuses

        raise EngineRefuses("double: every partition must be whole 128-row blocks")


class GptqV1ZerosNotConvertedEngine(TransformersEngine):
    """DELIBERATELY BUGGY: transformers with GPTQModel, whose conversion of a `checkpoint_format:
    gptq` (v1) checkpoint's zero points to its kernels' internal v2 (the stored value plus one) is
    skipped: every zero point one too small, the bug class of a v1/v2 offset lost on the way.
    The kernels then apply what the loader placed; the placed weights are off by one step."""

    name = "double-transformers-gptq-v1-zeros-not-converted"

    def load(self, directory):
        import gptqmodel.utils.model as model_utils

        original = model_utils.convert_gptq_v1_to_v2_format
        model_utils.convert_gptq_v1_to_v2_format = lambda model, cfg, qlinear_kernel: model
        try:
            return super().load(directory)
        finally:
            model_utils.convert_gptq_v1_to_v2_format = original


class DtypeIgnoredEngine(ReferenceEngine):
    """DELIBERATELY BUGGY: given a model dtype option (`[dtype=float32]`), it loads and computes in
    the checkpoint's dtype all the same, the bug class of a dtype argument dropped on the way (the
    weights rounded to the checkpoint's dtype, the forward run in it)."""

    name = "double-dtype-ignored"


class DtypeHonouredEngine(ReferenceEngine):
    """NOT BUGGY: the control for DtypeIgnoredEngine: the reference's weights cast once to the model
    dtype its option names, its forward in that dtype, as a correct engine loaded with it computes."""

    name = "double-dtype-honoured"

    def load(self, directory):
        from harness.core.dtypes import MODEL_DTYPES

        return super().load(directory, MODEL_DTYPES[self.options["dtype"]])
