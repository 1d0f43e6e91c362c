"""Plugins: formats and engines that live outside the package, registered from one file each.

HARNESS_PLUGINS lists them, separated by commas: an importable module name or a path to a `.py`
file. Each is imported once per process, when the format or engine registry is first imported;
it registers with `harness.formats.register_format` and `harness.engines.register_engine`. The
variable is inherited by the engine workers, so a plugin's format and engine exist there too.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from harness.core.errors import HarnessError

VARIABLE = "HARNESS_PLUGINS"
_loading = False
_loaded: set[str] = set()


def module_name_for(path: Path) -> str:
    """A stable module name for a plugin file, the same in every process that loads it."""
    return "harness_plugin_" + "".join(c if c.isalnum() else "_" for c in path.resolve().stem)


def load_plugins() -> None:
    """Import every plugin HARNESS_PLUGINS names (once; re-entrant calls from a plugin's imports return)."""
    global _loading
    if _loading:
        return
    _loading = True
    try:
        for entry in filter(None, (e.strip() for e in os.environ.get(VARIABLE, "").split(","))):
            if entry in _loaded:
                continue
            _loaded.add(entry)
            try:
                if entry.endswith(".py"):
                    path = Path(entry)
                    name = module_name_for(path)
                    spec = importlib.util.spec_from_file_location(name, path)
                    if spec is None or not path.is_file():
                        raise FileNotFoundError(f"no such file: {path}")
                    module = importlib.util.module_from_spec(spec)
                    sys.modules[name] = module
                    spec.loader.exec_module(module)
                else:
                    importlib.import_module(entry)
            except Exception as error:  # noqa: BLE001  (any failure of the user's file is one line)
                raise HarnessError(
                    f"{VARIABLE}: cannot load plugin {entry!r}: {type(error).__name__}: {error}"
                ) from None
    finally:
        _loading = False
