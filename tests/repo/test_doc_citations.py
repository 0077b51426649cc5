"""The repository explains itself: comments and docs cite only files inside it, every cited
`docs/X.md §N` section exists as a heading of that page, and every cited tests/ or examples/ file exists."""
import re
from pathlib import Path

from tests.support import REPO as ROOT

SOURCES = [p for d in ("deepinfer", "serve", "examples", "tests", "docker", "docs") for p in (ROOT / d).rglob("*")
           if p.is_file() and p.suffix in (".py", ".md", ".txt", "") and p.name != Path(__file__).name] \
    + [ROOT / "README.md", ROOT / "requirements-neuron.txt", ROOT / "Makefile"]
# the notes this project was started from live outside the repository
OUTSIDE = re.compile(r"(?<![\w/])(design|model|neuron|upstream-engine|serving-conventions|peers-neuron-moe)\.md"
                     r"|seed-commit-log|shared/docs")
CITATION = re.compile(r"docs/([a-z_]+)\.md §(\d+(?:\.\d+)*)")
# a path in the suite or the examples, as comments and docs cite them: tests/engine/test_x.py, examples/soak.py
CITED_FILE = re.compile(r"(?<![\w/.])((?:tests|examples)/[\w./-]*\w\.(?:py|json|md))")


def _headings(page: Path) -> set[str]:
    out = set()
    for line in page.read_text().splitlines():
        m = re.match(r"#+\s+(\d+(?:\.\d+)*)[.\s]", line)
        if m:
            out.add(m.group(1))
    return out


def test_no_citation_of_a_file_outside_the_repository():
    bad = []
    for path in SOURCES:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if path.parent == ROOT / "docs":
                # the pages name their siblings without the folder: those are repository files
                line = re.sub(r"(?<![\w/])(model|neuron|architecture|benchmarks|chat_template)\.md", "", line)
            if OUTSIDE.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not bad, "citations of files outside the repository:\n" + "\n".join(bad)


def test_every_cited_docs_section_exists():
    missing = []
    for path in SOURCES:
        for page, section in CITATION.findall(path.read_text(errors="replace")):
            target = ROOT / "docs" / f"{page}.md"
            if not target.exists() or section not in _headings(target):
                missing.append(f"{path.relative_to(ROOT)} cites docs/{page}.md §{section}")
    assert not missing, "\n".join(sorted(set(missing)))


def test_the_checker_sees_an_outside_citation():
    assert OUTSIDE.search("see " + "design.md §3") and OUTSIDE.search("(" + "neuron.md A1)")
    assert not OUTSIDE.search("see docs/neuron.md §4 A1")


def test_every_cited_test_or_example_file_exists():
    missing = [f"{path.relative_to(ROOT)} cites {cited}" for path in SOURCES
               for cited in CITED_FILE.findall(path.read_text(errors="replace")) if not (ROOT / cited).is_file()]
    assert not missing, "\n".join(sorted(set(missing)))
    assert CITED_FILE.findall("(tests/unit/test_x.py checks it)") == ["tests/unit/test_x.py"]
