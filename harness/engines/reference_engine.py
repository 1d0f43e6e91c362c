"""`reference`: the harness's own loader. Weights from the float64 reference dequantizer,
cast once to the checkpoint's dtype, in the transformers model class for the forward.

It maps VLM-prefixed keys onto the text model and refuses what the reference refuses, i.e.
it behaves as the manifest says a correct loader must.
"""

from __future__ import annotations

import dataclasses

from harness.core.naming import canonical_name
from harness.engines.base import EngineUnsupported, LoadReport
from harness.engines.hf_common import HFModelEngine, checkpoint_dtype, unquantized_model


class ReferenceEngine(HFModelEngine):
    name = "reference"
    package = "quant-load-harness"
    #: as an engine under judgement (a subclass standing for some loader: a test double, a planted
    #: package), run the forward the checkpoint specifies, activations quantized, in `logprobs` and
    #: `probe_linears`; the reference itself answers weight-only there (its specified forward is
    #: `activation_logprobs`, the runner's second candidate)
    runs_specified = False

    def load(self, directory: str, dtype=None) -> LoadReport:
        """The oracle's weights in the checkpoint's dtype, or in `dtype` (a torch dtype): the float64
        dequantization cast once to it, as an engine loaded in that dtype must hold them."""
        from pathlib import Path

        from harness.checkpoints.kv_scales import is_kv_scale
        from harness.checkpoints.model_layout import misplaced_experts, to_model_state
        from harness.checkpoints.reader import Checkpoint
        from harness.core.errors import CheckpointError
        from harness.oracle import specified
        from harness.oracle.reference import dequantize_checkpoint

        dtype = dtype or checkpoint_dtype(directory)
        checkpoint = Checkpoint(directory)
        misplaced = misplaced_experts(checkpoint.config, checkpoint.names())
        if misplaced:  # the judgement refuses it too (harness.differential.judgement)
            raise CheckpointError(Path(directory) / "config.json", misplaced)
        if "quantization_config" in checkpoint.config:  # quantized: the oracle's dequantization
            tensors = dequantize_checkpoint(directory)
        else:  # an unquantized model (e.g. the tiny models' bf16 originals): its tensors as stored
            tensors = ((name, checkpoint.tensor(name)) for name in checkpoint.names())
        # KV-cache scales are not weights: the weight-only forward leaves the cache unquantized, the
        # activation candidate (activation_logprobs, harness.oracle.specified) applies them
        state = {
            canonical_name(n): t.to(dtype) if t.is_floating_point() else t for n, t in tensors if not is_kv_scale(n)
        }
        # routed experts by the checkpoint's names, [out, in]: an engine may hold them as Linears of
        # their own where this model packs them (basis_reference)
        self.expert_shapes = {
            name.removesuffix(".weight"): tuple(t.shape)
            for name, t in state.items()
            if ".experts." in name and name.endswith(".weight") and t.dim() == 2
        }
        state = to_model_state(checkpoint.config, state)
        self.checkpoint = checkpoint
        self.model, tied = unquantized_model(directory, dtype)
        self.activations = specified.plan(checkpoint)
        self.quantization_config = checkpoint.config.get("quantization_config") or {}
        result = self.model.load_state_dict(state, strict=False)
        return self.checkpoint_report(
            checkpoint.config, result.missing_keys, result.unexpected_keys, tied, checkpoint.names()
        )

    def load_variant(self, directory, variant):
        """`dtype=D`: the same oracle in model dtype D (D in harness.core.dtypes), the reference of an
        engine loaded with that dtype option; `quantization=S`: an unquantized checkpoint quantized
        online as scheme S defines (harness.oracle.online), the reference of an engine loaded with
        that option: its weights as the scheme applies them, its specified forward quantizing the
        quantized Linears' inputs (harness.engines.options)."""
        from harness.core.dtypes import MODEL_DTYPES
        from harness.oracle.online import SCHEMES

        key, _, value = variant.partition("=")
        if key == "dtype" and value in MODEL_DTYPES:
            return self.load(directory, MODEL_DTYPES[value])
        if key == "quantization" and value in SCHEMES:
            report = self.load(directory)
            self.quantize_online(value)
            return report
        return super().load_variant(directory, variant)

    def quantize_online(self, scheme: str) -> None:
        """Replace the loaded model's decoder-layer Linears by their weights as `scheme` applies them
        (model dtype), and plan their inputs quantized as its kernel quantizes them."""
        import torch

        from harness.oracle import online
        from harness.oracle.specified import Plan

        reason = online.refusal(self.checkpoint.config, scheme)
        if reason:
            raise EngineUnsupported(reason)
        linears = {n: m for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)}
        chosen = online.quantized_linears(linears)
        applied = online.fake_quantized({name: linears[name].weight.detach() for name in chosen}, scheme)
        with torch.no_grad():
            for name, weight in applied.items():
                linears[name].weight.copy_(weight.to(linears[name].weight.dtype))
        self.activations = Plan(online.activation_scheme(scheme), {name: None for name in chosen})

    def logprobs(self, sequences):
        if self.runs_specified and not isinstance(self.activations, str):
            return self.activation_logprobs(sequences)
        return super().logprobs(sequences)

    def probe_linears(self, inputs):
        from harness.engines.hf_common import run_linears

        if not self.runs_specified or isinstance(self.activations, str):
            return super().probe_linears(inputs)
        with self.activations.installed(self.model):
            return run_linears(self.model, inputs)

    def kv_cache_scales(self):
        """As an engine under judgement (`runs_specified`), its cache is quantized as the plan says,
        with the checkpoint's own scales; the reference's weight-only forward quantizes none."""
        if not self.runs_specified:
            raise EngineUnsupported("the reference's forward leaves its KV cache unquantized (weight-only)")
        if isinstance(self.activations, str):
            return {}
        return {
            name: (float(k.reshape(-1)[0]), float(v.reshape(-1)[0])) for name, (k, v) in self.activations.kv.items()
        }

    def activation_logprobs(self, sequences, variant: str = "float64"):
        """The checkpoint's full definition: weights as dequantized, each quantized Linear's input
        and the KV cache quantized as its config specifies (harness.oracle.specified); `variant`:
        "float64" (the definition) or one of its rounding variants (harness.oracle.specified.VARIANTS),
        optionally `VARIANT|key=value`: the forward an engine loaded with that option computes
        (harness.oracle.specified.modelled_option)."""
        from harness.core.errors import HarnessError
        from harness.engines.hf_common import model_logprobs
        from harness.oracle import specified

        variant, _, option = variant.partition("|")
        plan = specified.plan(self.checkpoint, option) if option else self.activations
        if isinstance(plan, str):
            raise EngineUnsupported(plan)
        try:
            with plan.installed(self.model, variant):
                return model_logprobs(self.model, sequences)
        except HarnessError as error:  # e.g. experts packed in 3-D: not Linears to hook
            raise EngineUnsupported(f"activation candidate: {error}") from None

    def probe_reference(self, rows: int = 8):
        """The activation probe's inputs (harness.differential.probe): for each quantized Linear of
        the plan, `NAME.input` (purpose-built rows, harness.oracle.probe_inputs) and `NAME.quantized`,
        those rows as the checkpoint's scheme quantizes them (model dtype); with a static scale s, also
        `NAME.inverted`: the same rows quantized with 1 / s (the scale read in the other convention);
        `NAME.quantized_held`: quantized with s as the model dtype holds it."""
        import torch

        from harness.engines.hf_common import LEAD
        from harness.oracle.activations import quantize_activations
        from harness.oracle.probe_inputs import probe_input

        plan = self.activations
        if isinstance(plan, str):
            raise EngineUnsupported(plan)
        if plan.scheme is None or not plan.inputs:
            raise EngineUnsupported("the config quantizes no Linear's input")
        modules = dict(self.model.named_modules())
        probe = {f"{name}{LEAD}": lead for name, lead in input_leads(self.model, plan.inputs).items()}
        quantized_outputs = plan.quantized_outputs()  # judged by the logits and the KV scales (the KV cache)
        for seed, (name, stored) in enumerate(sorted(plan.inputs.items())):
            if name in quantized_outputs:  # its output is quantized too: not by one Linear's output
                continue
            weight, scheme = modules[name].weight, plan.scheme_for(name)
            rows_in = probe_input(scheme, stored, weight.shape[1], rows, weight.dtype, seed)
            quantized = quantize_activations(rows_in, scheme, stored)
            if not (torch.isfinite(rows_in).all() and torch.isfinite(quantized).all() and quantized.any()):
                continue  # a scale the model dtype cannot carry inputs for (non-finite, or all would be 0)
            probe |= {f"{name}.input": rows_in, f"{name}.quantized": quantized}
            if scheme.static:  # engines hold the scale in the model dtype: its rounding, relative
                exact = stored.to(torch.float64).reshape(())
                held = stored.to(weight.dtype).to(torch.float64).reshape(())
                probe[f"{name}.scale_rounding"] = ((held - exact).abs() / exact.abs()).reshape(1)
                # and one that dequantizes with that held scale in the model dtype rounds each value
                # on its own (compressed-tensors' fake quantization): that input, exactly
                probe[f"{name}.quantized_held"] = quantize_activations(rows_in, scheme, stored.to(weight.dtype))
            elif scheme.dynamic:  # a dynamic scale computed in the model dtype, as compressed-tensors'
                # calculate_qparams does: an int8 grid is fine enough for that scale's rounding to move codes
                model_dtype = dataclasses.replace(scheme, arithmetic="model")
                probe[f"{name}.quantized_held"] = quantize_activations(rows_in, model_dtype)
            if scheme.static:
                inverted = quantize_activations(rows_in, scheme, 1.0 / stored.to(torch.float64))
                if torch.isfinite(inverted).all():
                    probe[f"{name}.inverted"] = inverted
        return probe | self.probe_experts(plan, rows)

    def basis_reference(self):
        """The effective-weight probe's inputs (harness.differential.effective_weights): for every
        Linear of the model, `NAME.basis`, `NAME.columns`, `NAME.candidates` and
        `NAME.scale_rounding` (harness.oracle.basis), its input quantized as the plan says where
        the checkpoint quantizes it; `NAME#lead` as the activation probe gives it. Where no Linear's
        input is quantized, routed experts that this model packs get the same entries under the
        checkpoint's per-expert names, marked `NAME.expert` (an engine may hold them as Linears of
        their own, as auto-round does; one that packs them has no module by that name)."""
        import torch

        from harness.core.errors import HarnessError
        from harness.engines.hf_common import LEAD
        from harness.oracle.activations import scheme_of
        from harness.oracle.basis import basis_input

        plan = self.activations
        try:
            declared = scheme_of(self.quantization_config) if self.quantization_config else None
        except HarnessError as error:
            raise EngineUnsupported(str(error)) from None
        if isinstance(plan, str) and declared is not None:
            raise EngineUnsupported(plan)  # activations quantized where the plan cannot say which
        inputs = {} if isinstance(plan, str) or plan.scheme is None else plan.inputs
        linears = sorted(  # a plain Linear's output is its product (Llama-4's router subclass returns scores)
            name for name, m in self.model.named_modules() if type(m).forward is torch.nn.Linear.forward
        )
        probe = {f"{name}{LEAD}": lead for name, lead in input_leads(self.model, linears).items()}
        folds = zero_point_products(self.checkpoint)
        shapes = {name: self.model.get_submodule(name).weight for name in linears}
        shapes = {name: (weight.shape[1], weight.dtype) for name, weight in shapes.items()}
        weight_only = isinstance(plan, str) or plan.scheme is None
        experts = {n: (s[1], self.model.dtype) for n, s in self.expert_shapes.items() if n not in shapes}
        experts = experts if weight_only else {}
        quantized_outputs = set() if isinstance(plan, str) else plan.quantized_outputs()
        for name in linears + sorted(experts):
            if name in quantized_outputs:  # its outputs are quantized too (the KV cache): no weight to read
                continue
            width, dtype = shapes.get(name) or experts[name]
            scheme = plan.scheme_for(name) if name in inputs else None
            try:
                basis = basis_input(scheme, inputs.get(name), width, dtype)
            except HarnessError:  # e.g. a static scheme whose module holds no scale: nothing to model
                continue
            if name in experts:
                basis["expert"] = torch.tensor([True])
            if torch.isfinite(basis["basis"]).all() and bool((basis["candidates"] != 0).all()):
                probe |= {f"{name}.{key}": value for key, value in basis.items()}
                folded = folds(name, basis["columns"]) if folds else None
                if folded is not None:
                    probe[f"{name}.zero_point_products"] = folded
        return probe

    def probe_experts(self, plan, rows: int) -> dict:
        """For each packed experts module (harness.differential.probe): `NAME#experts`, purpose-built
        rows (in the model dtype) for its gate and up; per expert E, `NAME#experts.E.specified` and
        `.weights_only`, what expert E computes from them with its Linears' inputs quantized as
        specified, or not, computed in float32 from the model's weights and rounded once to the model
        dtype (its down input, act(gate) * up, is no purpose-built row: in a reduced-precision model
        the engine's own rounding of it moves the specified output nearly as far as quantizing does,
        which the judge accounts for)."""
        import copy

        import torch

        from harness.oracle.expert_activations import EXPERTS, each_expert_candidates
        from harness.oracle.probe_inputs import probe_input

        if not plan.experts:
            return {}
        dtype = self.model.dtype
        modules, probe = dict(self.model.named_modules()), {}
        hidden_size = self.model.config.get_text_config().hidden_size
        for seed, (name, scales) in enumerate(sorted(plan.experts.items()), start=len(plan.inputs)):
            scheme = plan.scheme_for(name)
            rows_in = probe_input(scheme, scales[0][0], hidden_size, rows, dtype, seed)
            module = modules[name] if dtype == torch.float32 else copy.deepcopy(modules[name]).float()
            candidates = [
                tuple(t.to(dtype) for t in pair)
                for pair in each_expert_candidates(module, scheme, scales, rows_in.float())
            ]
            if not all(torch.isfinite(t).all() for pair in candidates for t in pair):
                continue
            probe[f"{name}{EXPERTS}"] = rows_in
            for expert, (specified, weights_only) in enumerate(candidates):
                probe |= {
                    f"{name}{EXPERTS}.{expert}.specified": specified,
                    f"{name}{EXPERTS}.{expert}.weights_only": weights_only,
                }
        return probe

    def unload(self):
        super().unload()
        self.activations = "no checkpoint loaded"


def input_leads(model, names, tokens: int = 5) -> dict:
    """The shape before the last dimension that `model`'s forward gives each named module, with -1
    where the tokens are (one forward of `tokens` tokens)."""
    import torch

    modules, leads, handles = dict(model.named_modules()), {}, []
    for name in names:

        def hook(module, args, name=name):
            leads[name] = torch.tensor([-1 if d == tokens else d for d in args[0].shape[:-1]])

        handles.append(modules[name].register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(3, 3 + tokens).unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    return leads


def zero_point_products(checkpoint):
    """For an integer format with zero points (one that defines QuantFormat.affine_parts), a
    function (module, probed columns) -> [N, C] float64: the largest product of a code and a scale,
    (2**bits - 1) * scale, at each column, which bounds every term a kernel that folds the zero
    point into a float offset rounds (codes * s, zeros * s, or both taken from a midpoint); it
    returns None for a module stored otherwise. None for every other checkpoint."""
    from harness.formats import detect_format
    from harness.formats.base import QuantFormat

    quantization = checkpoint.config.get("quantization_config")
    if not isinstance(quantization, dict):
        return None
    fmt = detect_format(quantization)
    if type(fmt).affine_parts is QuantFormat.affine_parts:
        return None
    knobs = fmt.knobs_from_config(quantization)
    names = set(checkpoint.names())
    suffix = f".{fmt.marker}"
    stored = {canonical_name(n).removesuffix(suffix): n.removesuffix(suffix) for n in names if n.endswith(suffix)}

    def products(module: str, columns):
        prefix = stored.get(module)
        if prefix is None:
            return None
        tensors = {s: checkpoint.tensor(f"{prefix}.{s}") for s in fmt.suffixes if f"{prefix}.{s}" in names}
        own, own_knobs = fmt.for_module(prefix, knobs, tensors)  # a mixed checkpoint's group
        parts = own.affine_parts(tensors, own_knobs)
        return None if parts is None else (2 ** own_knobs.get("bits", 4) - 1) * parts[2][:, columns].abs()

    return products
