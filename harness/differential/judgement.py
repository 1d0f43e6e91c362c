"""One checkpoint being judged: what a correct loader must do and hold (read once, before any
engine loads it), and what the judgement records per engine. The runner, the relations and the
stand-in judge all work on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from harness.checkpoints.architectures import architecture_name
from harness.checkpoints.disagreements import misstates_its_index
from harness.checkpoints.kv_scales import is_kv_scale
from harness.checkpoints.manifest import read_manifest, read_truth
from harness.checkpoints.model_layout import misplaced_experts
from harness.checkpoints.reader import (
    CONFIG_FILE,
    Checkpoint,
    Hazard,
    contained_file,
    declared_format,
    hostile_layout,
    read_config,
)
from harness.checkpoints.writer import MANIFEST_FILE
from harness.core.errors import CheckpointError, FormatError, first_line
from harness.core.findings import Finding
from harness.core.naming import canonical_name
from harness.core.tolerances import loosest_tolerances
from harness.differential.misreadings import CheckpointMisreadings
from harness.differential.session import EngineSession
from harness.oracle.kv_cache import stored_kv_scales
from harness.oracle.reference import dequantize_checkpoint, format_and_knobs, group_modules

PROBE_LENGTH, PROBE_COUNT = 24, 3


def probe_sequences(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Fixed token sequences (ids past the three special tokens) that every engine scores."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (PROBE_LENGTH,), generator=generator).tolist() for _ in range(PROBE_COUNT)]


@dataclass
class EngineOutcome:
    engine: str
    version: str = ""
    status: str = "loaded"  # loaded, refused, unsupported, unavailable, failed
    detail: str = ""
    report: dict = field(default_factory=dict)
    perplexity: float | None = None
    generated: list[int] = field(default_factory=list)
    #: relation name -> "holds", "does not hold" or "not checked: why" (harness.differential.relations)
    relations: dict[str, str] = field(default_factory=dict)
    #: what the activation probe found, or why it did not run (harness.differential.probe)
    activation_probe: str = ""
    #: what the effective-weight probe found, or why it did not run (harness.differential.effective_weights)
    effective_weights: str = ""


@dataclass
class CheckpointResult:
    directory: str
    format: str
    expectation: str
    outcomes: dict[str, EngineOutcome] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    #: for a checkpoint the harness did not write: why the oracle expects a refusal
    expectation_reason: str = ""


@dataclass
class Judgement:
    """One checkpoint being judged: what a correct loader must do and hold, and the findings so far."""

    directory: Path
    session: EngineSession
    manifest: dict | None
    fmt: object
    knobs: dict
    config: dict
    dtype: str
    expectation: str
    truth: dict[str, torch.Tensor]
    module_notes: dict[str, list[str]]
    tol: object
    result: CheckpointResult
    sequences: list[list[int]]
    scratch: Path
    #: the known bugs' predicted readings of this checkpoint, compared with each weight finding
    misreadings: CheckpointMisreadings | None = None
    #: `compare --hostile`: what in the layout leads outside the directory (or is a header bomb)
    hazards: list[Hazard] = field(default_factory=list)
    #: the reference's logits with activations quantized as the checkpoint specifies (None: the
    #: format quantizes weights only, or the reference cannot model it here); `specified_reason`:
    #: what the config specifies, in words, or why there is no such candidate
    specified: list[torch.Tensor] | None = None
    specified_reason: str = ""
    #: how far the definition's rounding variants (harness.oracle.specified.VARIANTS: activations
    #: rounded in the model dtype; quantized weights one ulp off) move these logits: this
    #: checkpoint's own sensitivity, a floor under the activation bound
    specified_noise: float = 0.0
    #: the bound an engine's logits must keep from `specified` ([activations] tolerance, at least
    #: twice the noise floor)
    specified_bound: float = 0.0
    #: an engine loaded with an option that changes its forward (harness.oracle.specified
    #: MODELLED_OPTIONS) -> its own (specified, bound, reason), the reference's model of the option
    option_candidates: dict[str, tuple[list[torch.Tensor] | None, float, str]] = field(default_factory=dict)
    #: an engine loaded in another model dtype (`vllm[dtype=float32]`) -> the reference's weight-only
    #: logits in that dtype (None: the reference could not compute them, and why in `baseline_reasons`)
    baselines: dict[str, list[torch.Tensor] | None] = field(default_factory=dict)
    baseline_reasons: dict[str, str] = field(default_factory=dict)
    #: model dtype -> the reference's weight-only logits in float32 and how far its own in that dtype
    #: lie from them (runner._exact_forward: only where an engine is beyond the fixed tolerance)
    exact_forwards: dict[str, tuple[list[torch.Tensor], float] | None] = field(default_factory=dict)
    #: a reference variant (reference_variant) -> the basis inputs of that load and why there are none
    #: (harness.differential.effective_weights): the applied weights of an engine loaded with an option
    variant_bases: dict[str, tuple[dict | None, str]] = field(default_factory=dict)
    #: online scheme -> the truth with the decoder layers' Linears as that scheme applies them (engine_truth)
    online_truths: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: the tolerances of those other dtypes, by dtype (engine_tol)
    other_tols: dict[str, object] = field(default_factory=dict)
    #: the relations checked on each engine that loads it (harness.differential.relations)
    relations: tuple[str, ...] = ()
    #: the engines that load it (default: the session's)
    engines: list[str] = field(default_factory=list)
    #: the reference's activation probe inputs (harness.differential.probe), or None
    probe: dict | None = None
    #: the reference's basis inputs for every Linear (harness.differential.effective_weights), or
    #: None and why
    basis: dict | None = None
    basis_reason: str = ""

    @classmethod
    def of(cls, directory: Path, session: EngineSession, hostile: bool = False) -> Judgement:
        manifest = read_manifest(directory) if (directory / MANIFEST_FILE).is_file() else None
        refusal = ""  # why a checkpoint the harness did not write must be refused
        hazards: list[Hazard] = []
        try:
            fmt, knobs = format_and_knobs(directory)
        except CheckpointError as error:
            if not (hostile or misstates_its_index(manifest)):  # its manifest says what a loader must do
                raise
            fmt, knobs = _format_despite(directory, error)
            if hostile:
                refusal, hazards = f"the reference refuses it: {first_line(error)}", hostile_layout(directory)
        config = read_config(contained_file(directory, CONFIG_FILE, CONFIG_FILE, referrer=directory))
        dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        if refusal:  # --hostile: the harness refuses it; the engines load it all the same
            expectation, truth = "refuse", read_truth(directory, manifest) if manifest else {}
        elif manifest:
            expectation, truth = manifest["expectation"], read_truth(directory, manifest)
        else:  # a checkpoint the harness did not write: the oracle says what it holds, or that it must be refused
            try:
                # KV-cache scales are no module's weight: they are judged as the cache's scales (kv_scales)
                truth = {n: t for n, t in dequantize_checkpoint(directory) if not is_kv_scale(n)}
                expectation = "exact"
            except CheckpointError as error:
                truth, expectation = {}, "refuse"
                refusal = f"the reference refuses it: {first_line(error)}"
            misplaced = misplaced_experts(config, Checkpoint(directory).names())
            if misplaced and not refusal:
                truth, expectation, refusal = {}, "refuse", f"the reference refuses it: {misplaced}"
        notes = {canonical_name(m): info.get("notes", []) for m, info in (manifest or {}).get("modules", {}).items()}
        scratch = session.work / "scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        return cls(
            directory,
            session,
            manifest,
            fmt,
            knobs,
            config,
            dtype,
            expectation,
            {canonical_name(n): t for n, t in truth.items()},
            notes,
            loosest_tolerances([s.name for s in fmt.schemes(knobs)], dtype),
            CheckpointResult(str(directory), fmt.name, expectation, expectation_reason=refusal),
            probe_sequences(int(config.get("vocab_size", 260))),
            scratch,
            CheckpointMisreadings(directory, fmt.name, [s.name for s in fmt.schemes(knobs)]),
            hazards,
        )

    @cached_property
    def stored_kv_scales(self) -> dict[str, tuple[float | None, float | None]]:
        """The checkpoint's KV-cache scales by attention module, read once for every engine judged."""
        return stored_kv_scales(Checkpoint(self.directory))

    @cached_property
    def redundant_tensors(self) -> set[str]:
        """Canonical names of stored tensors the format defines as their absence would (a GPTQ
        `g_idx` of k // g): an engine that leaves them unread is not reported for it."""
        optional = {suffix for scheme in self.fmt.schemes(self.knobs) for suffix in scheme.optional}
        if not optional:
            return set()
        try:
            checkpoint = Checkpoint(self.directory)
            modules, _ = group_modules(checkpoint.names(), self.fmt, checkpoint.storage_dtypes())
            redundant = set()
            for module, parts in modules.items():
                if optional & set(parts):
                    own, own_knobs = self.fmt.for_module(module, self.knobs)  # a mixed checkpoint's group
                    tensors = {suffix: checkpoint.tensor(name) for suffix, name in parts.items() if suffix in optional}
                    redundant |= {canonical_name(parts[s]) for s in own.redundant(tensors, own_knobs)}
            return redundant
        except (CheckpointError, FormatError, OSError, ValueError, KeyError):  # judged elsewhere: nothing excused
            return set()

    def finding(self, engine: str, kind: str, message: str, **extra) -> Finding:
        item = Finding(
            engine=engine,
            engine_version=self.session.versions.get(engine, "?"),
            kind=kind,
            format=self.module_format(extra.get("module")),
            message=message,
            arch=architecture_name(self.config.get("model_type")),
            dtype=self.engine_dtype(engine),
            checkpoint=str(self.directory),
            **extra,
        )
        self.result.findings.append(item)
        return item

    def module_format(self, module: str | None) -> str:
        """The format a finding about `module` (a weight's canonical name) is in: the checkpoint's, or
        in a mixed checkpoint the config group's that targets it (its own where none does)."""
        if not module:
            return self.fmt.name
        return self.fmt.for_module(module.removesuffix(".weight"), self.knobs)[0].name

    def engine_dtype(self, engine: str) -> str:
        """The model dtype `engine` computes in: the checkpoint's, unless it was loaded with a `dtype`
        option (harness.engines.options); its weights and logits are judged in that dtype."""
        from harness.engines.options import model_dtype

        return model_dtype(engine) or self.dtype

    def reference_variant(self, engine: str) -> str:
        """The reference load `engine` is judged against (ReferenceEngine.load_variant): '' for the
        checkpoint's own, `quantization=S` for an engine that quantizes it online, `dtype=D` for one
        loaded in another model dtype (harness.engines.options)."""
        from harness.engines.options import split_engine

        scheme = split_engine(engine)[1].get("quantization")
        if scheme:
            return f"quantization={scheme}"
        dtype = self.engine_dtype(engine)
        return f"dtype={dtype}" if dtype != self.dtype else ""

    def engine_truth(self, engine: str) -> dict[str, torch.Tensor]:
        """What `engine` must hold: the truth, or for an engine that quantizes the checkpoint online
        its decoder layers' Linears as the scheme applies them (harness.oracle.online), computed once
        per scheme from the truth in the checkpoint's dtype."""
        from harness.core.dtypes import MODEL_DTYPES
        from harness.oracle import online

        variant = self.reference_variant(engine)
        if not variant.startswith("quantization="):
            return self.truth
        scheme = variant.partition("=")[2]
        if scheme not in self.online_truths:
            weights = {
                n.removesuffix(".weight"): t for n, t in self.truth.items() if n.endswith(".weight") and t.dim() == 2
            }
            chosen = {name: weights[name].to(MODEL_DTYPES[self.dtype]) for name in online.quantized_linears(weights)}
            applied = online.fake_quantized(chosen, scheme)
            self.online_truths[scheme] = self.truth | {f"{name}.weight": w for name, w in applied.items()}
        return self.online_truths[scheme]

    def engine_tol(self, engine: str):
        """The tolerances of `engine`'s model dtype for this checkpoint's format (read once per dtype)."""
        dtype = self.engine_dtype(engine)
        if dtype == self.dtype:
            return self.tol
        if dtype not in self.other_tols:
            self.other_tols[dtype] = loosest_tolerances([s.name for s in self.fmt.schemes(self.knobs)], dtype)
        return self.other_tols[dtype]

    def candidate(self, engine: str) -> tuple[list[torch.Tensor] | None, float, str]:
        """The reference's specified forward `engine` is held to, its bound and what it specifies:
        the checkpoint's own, or the model of the option the engine was loaded with."""
        return self.option_candidates.get(engine, (self.specified, self.specified_bound, self.specified_reason))

    def scratch_file(self, engine: str, what: str) -> Path:
        return self.scratch / f"{engine.replace(':', '_')}-{what}.safetensors"


def _format_despite(directory: Path, refusal: CheckpointError) -> tuple[object, dict]:
    """The format config.json declares when the checkpoint's layout is refused (`compare
    --hostile`, or a checkpoint the harness wrote to disagree with its index); the refusal
    itself when even that cannot be read."""
    try:
        return declared_format(directory)
    except CheckpointError:
        raise refusal from None
