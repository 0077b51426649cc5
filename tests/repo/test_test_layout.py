"""The suite's own layout (tests/conftest.py, pytest.ini): every test file sits in a tier directory,
helpers live in tests/support under non-test names, no test imports another test module, and no test
edits sys.path (helpers are imported as tests.support.*, example scripts loaded by their path)."""
import ast
import re

from tests.support import REPO, TIERS
from tests.support.slow_tests import SLOW

TESTS = REPO / "tests"
FILES = sorted(p for p in TESTS.rglob("*.py"))


def _imported_modules(path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_every_test_file_is_in_a_tier():
    stray = [p.relative_to(REPO).as_posix() for p in FILES
             if p.name.startswith("test_") and p.relative_to(TESTS).parts[0] not in TIERS]
    assert not stray, f"test files outside tests/{{{','.join(TIERS)}}}: {stray}"


def test_support_holds_no_tests():
    support = [p for p in FILES if p.relative_to(TESTS).parts[0] == "support"]
    assert support
    named = [p.name for p in support if p.name.startswith("test_")]
    defined = [f"{p.name}:{n.name}" for p in support for n in ast.parse(p.read_text()).body
               if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and re.match(r"test_|Test", n.name)]
    assert not named and not defined, (named, defined)


def test_no_test_imports_another_test_module():
    bad = [f"{p.relative_to(REPO)} imports {m}" for p in FILES for m in _imported_modules(p)
           if m and m.split(".")[-1].startswith("test_")]
    assert not bad, bad


def test_no_test_edits_sys_path():
    bad = [p.relative_to(REPO).as_posix() for p in FILES
           if re.search(r"\bsys\.path\.(insert|append|extend)\b|\bsys\.path\s*=", p.read_text())]
    assert not bad, bad


def test_every_slow_entry_names_a_test():
    missing = []
    for entry in SLOW:
        path, _, name = entry.partition("::")
        file = TESTS / path
        if not file.is_file():
            missing.append(entry)
            continue
        functions = {n.name for n in ast.walk(ast.parse(file.read_text())) if isinstance(n, ast.FunctionDef)}
        if name and name.split("[", 1)[0] not in functions:
            missing.append(entry)
    assert not missing, f"tests/support/slow_tests.py names tests that do not exist: {missing}"


def test_scripts_import_test_helpers_as_tests_support():
    """examples/ and docker/ reach the helpers as tests.support.* from the repository root, never by
    putting tests/ itself on sys.path (tests/neuron/test_scripts.py runs them)."""
    scripts = [*(REPO / "examples").rglob("*.py"), REPO / "docker" / "neuron" / "Dockerfile"]
    bad = [p.relative_to(REPO).as_posix() for p in scripts
           if re.search(r"sys\.path\.insert\(.*[\"']tests[\"']", p.read_text())]
    assert not bad, bad
