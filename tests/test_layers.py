"""The package's folders are its layers, and imports go one way: down (docs/contributing.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "harness"
#: bottom first; a module may import its own layer and any layer before it, never one after
LAYERS = (
    "core",
    "formats",
    "checkpoints",
    "oracle",
    "lm",
    "engines",
    "fixes",
    "differential",
    "campaign",
    "gates",
    "lanes",
    "commands",
    "pytest_plugin",
    "__main__",
)


def layer_of(module: str) -> str:
    """`harness.differential.runner` -> `differential`; the bare package is the bottom."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "core"


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
            found |= {f"{node.module}.{a.name}" if node.module == "harness" else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("harness")}
    return found


def test_every_module_belongs_to_a_layer():
    stray = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if layer_of("harness." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)) not in LAYERS
        and p.name != "__init__.py"
    ]
    assert not stray, f"modules outside every layer (add the folder to LAYERS): {stray}"


def test_imports_go_down_only():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        module = "harness." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue
        own = LAYERS.index(layer_of(module))
        for target in imports(path):
            if target == "harness.__version__":
                continue
            if LAYERS.index(layer_of(target)) > own:
                upward.append(f"{module} imports {target}")
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def test_scripts_and_benchmarks_import_what_exists():
    """Outside the package (scripts, benchmarks, the materialize runner) every `from harness... import
    name` still resolves after a move."""
    import importlib

    root = PACKAGE.parent
    sources = [*root.glob("scripts/*"), *root.glob("benchmarks/*.py"), root / "tests/fixes/vllm_materialize_run.py"]
    broken = []
    for source in sources:
        if not source.is_file() or source.suffix not in ("", ".py"):
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
                if node.module.startswith("harness.engines.vllm") or "materialize" in source.name:
                    continue  # needs vLLM itself; its imports are exercised by the vLLM tests
                module = importlib.import_module(node.module)
                broken += [f"{source.name}: {node.module}.{a.name}" for a in node.names if not has(module, a.name)]
    assert not broken, broken


def has(module, name: str) -> bool:
    """`from module import name` resolves: an attribute, or a submodule of a package."""
    import importlib.util

    if hasattr(module, name):
        return True
    return hasattr(module, "__path__") and importlib.util.find_spec(f"{module.__name__}.{name}") is not None
