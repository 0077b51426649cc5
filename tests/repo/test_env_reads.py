"""Every DEEPINFER_* variable declared in deepinfer/envs.py is read somewhere else: an
`envs.get("NAME")` call or an `envs.NAME` attribute in deepinfer/ (the server included)
or examples/. Found with ast, so a name that only appears in a string, a comment or an error
message does not count."""
import ast
from pathlib import Path

from tests.support import REPO as ROOT

ENVS = ROOT / "deepinfer" / "envs.py"
SOURCE_DIRS = ("deepinfer", "examples")


def declared_names(path: Path) -> list[str]:
    """Names of the `EnvVar("NAME", ...)` rows of an envs module, in order."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "EnvVar"
                and node.args and isinstance(node.args[0], ast.Constant)):
            names.append(node.args[0].value)
    return names


def _is_envs(node: ast.AST) -> bool:
    # `envs` as imported (`from deepinfer import envs`) or spelled out (`deepinfer.envs`).
    return (isinstance(node, ast.Name) and node.id == "envs") or (
        isinstance(node, ast.Attribute) and node.attr == "envs")


def read_names(files, root: Path = ROOT) -> dict[str, list[str]]:
    """name -> ["path:line", ...] of every read through deepinfer.envs in `files`."""
    reads: dict[str, list[str]] = {}
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            name = None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get" and _is_envs(node.func.value)
                    and node.args and isinstance(node.args[0], ast.Constant)):
                name = node.args[0].value
            elif isinstance(node, ast.Attribute) and node.attr.startswith("DEEPINFER_") and _is_envs(node.value):
                name = node.attr
            if isinstance(name, str):
                reads.setdefault(name, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return reads


def source_files() -> list[Path]:
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if p != ENVS]


def test_every_declared_variable_is_read():
    declared = declared_names(ENVS)
    assert len(declared) >= 10          # the parse found the registry
    reads = read_names(source_files())
    unread = [name for name in declared if name not in reads]
    assert not unread, (f"declared in deepinfer/envs.py but read nowhere: {unread}; "
                        "read each where it takes effect, or delete its row")


def test_every_read_is_declared():
    declared = set(declared_names(ENVS))
    unknown = {name: sites for name, sites in read_names(source_files()).items() if name not in declared}
    assert not unknown


def test_the_scan_counts_reads_only(tmp_path):
    envs_file = tmp_path / "envs.py"
    envs_file.write_text('ENV_VARS = [EnvVar("DEEPINFER_A", 0, "int", "a"), EnvVar("DEEPINFER_B", 0, "int", "b"),\n'
                         '            EnvVar("DEEPINFER_C", 0, "int", "c"), EnvVar("DEEPINFER_D", 0, "int", "d")]\n')
    user = tmp_path / "user.py"
    user.write_text("from deepinfer import envs\n"
                    "import deepinfer.envs\n"
                    "x = envs.get('DEEPINFER_A')\n"
                    "y = deepinfer.envs.DEEPINFER_B\n"
                    "# DEEPINFER_C in a comment\n"
                    "msg = 'DEEPINFER_C must be set'\n"
                    "z = other.get('DEEPINFER_D')\n")
    assert declared_names(envs_file) == ["DEEPINFER_A", "DEEPINFER_B", "DEEPINFER_C", "DEEPINFER_D"]
    assert set(read_names([user], root=tmp_path)) == {"DEEPINFER_A", "DEEPINFER_B"}
