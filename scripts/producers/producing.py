"""What every producer script shares (each imports it from beside itself; it imports torch and, for
the base model, transformers, both in every producer's environment, never the harness): package
versions, the seeded tiny Llama, file digests, the truth under the saved names, the command line and the
loop over cases that records what fails."""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

#: transformers 5 holds Mixtral's experts under `mlp` (fused, and defused by the producers as
#: gate_proj/up_proj/down_proj) and saves them under `block_sparse_moe` (its checkpoint conversion,
#: reversed on save); some exports keep the projection names, others write Mixtral's w1/w3/w2
MIXTRAL_SAVED = {".mlp.": ".block_sparse_moe."}
MIXTRAL_SAVED_PARTS = {**MIXTRAL_SAVED, ".gate_proj": ".w1", ".up_proj": ".w3", ".down_proj": ".w2"}


def saved_names(truth: dict[str, torch.Tensor], directory: Path, renames: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The producer's truth (held module name + `.weight` -> tensor) under the names the saved files
    use: a module the files lack, with every `renames` substring replaced, where the files hold that."""
    from safetensors import safe_open

    stored = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            stored |= {key.rpartition(".")[0] for key in handle.keys()}
    result = {}
    for name, tensor in truth.items():
        module, _, leaf = name.rpartition(".")
        renamed = module
        for held, saved in renames.items():
            renamed = renamed.replace(held, saved)
        result[f"{renamed if module not in stored and renamed in stored else module}.{leaf}"] = tensor
    return result


def package_versions(names: Iterable[str]) -> dict[str, str]:
    """The installed version of each of `names` that is installed."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


def build_seeded_llama(directory: Path, model_config: dict, seed: int) -> None:
    """Save a tiny random Llama in bfloat16 (build_seeded)."""
    build_seeded(directory, "LlamaConfig", model_config, seed)


def build_seeded(directory: Path, config_class: str, model_config: dict, seed: int) -> None:
    """Save a tiny random model of transformers' `config_class` in bfloat16; weights come from one
    seeded generator in parameter-name order (N(0, 0.02), norms 1), so they do not depend on the
    transformers version's init."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**model_config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model.to(torch.bfloat16).save_pretrained(directory)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def digests(directory: Path) -> dict[str, str]:
    """sha256 of every file of a case's checkpoint, its provenance and the producer's truth aside."""
    return {
        path.relative_to(directory).as_posix(): sha256(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
        and path.name != "provenance.json"
        and not path.relative_to(directory).as_posix().startswith("producer_truth/")
    }


def chosen_cases(doc: str, producer: str, cases: Iterable[str]) -> tuple[Path, list[str]]:
    """A producer script's command line: `--out ROOT` (cases go to ROOT/<producer>/, the path resolved)
    and `--only` (names containing one of these; with `--exact`, whole names, an unknown one an error)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help=f"output root; cases go to OUT/{producer}/")
    parser.add_argument("--only", nargs="*", default=[], help="run only cases whose name contains one of these")
    parser.add_argument("--exact", action="store_true", help="--only names whole cases, not substrings")
    args = parser.parse_args()
    cases = list(cases)
    if args.exact and (unknown := sorted(set(args.only) - set(cases))):
        parser.error(f"unknown cases: {', '.join(unknown)}")
    chosen = [c for c in cases if not args.only or any(s == c if args.exact else s in c for s in args.only)]
    return args.out.resolve(), chosen


def run_cases(
    producer: str,
    cases: Iterable[str],
    out: Path,
    prepare: Callable[[Path], None],
    run_case: Callable[[str, Path, Path], None],
) -> int:
    """Build the base model once (`prepare` into a scratch directory), then `run_case(case, base, out)`
    for each case; a case that fails is removed and recorded, with its one-line error, in
    OUT/<producer>/FAILED.json (absent when nothing failed)."""
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix=f"{producer}-base-") as scratch:
        base = Path(scratch) / "base"
        prepare(base)
        for case in cases:
            print(f"[{producer}] {case} ...", flush=True)
            try:
                run_case(case, base, out)
            except Exception as error:  # every case failure is recorded, not raised
                message = f"{type(error).__name__}: {error}".splitlines()[0]
                failed[case] = message
                shutil.rmtree(out / producer / case, ignore_errors=True)
                print(f"[{producer}] {case} FAILED: {message}", flush=True)
    record = out / producer / "FAILED.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    if failed:
        record.write_text(json.dumps(failed, indent=2, sort_keys=True) + "\n")
    else:
        record.unlink(missing_ok=True)
    return 0
