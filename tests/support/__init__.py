"""Helpers the tests share (no tests here): the repository root, and loading an example script by its
path as a module (examples/ is not a package: its scripts are run, not installed)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
# The tiers of the suite, one directory of tests/ each (pytest.ini has a marker for each).
TIERS = ("unit", "engine", "process", "neuron", "repo")


def load_script(relpath: str) -> ModuleType:
    """The script at REPO/relpath as a module named after its file, loaded once per process (it is
    registered in sys.modules before it runs, as an import would, so its dataclasses resolve)."""
    path = REPO / relpath
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
