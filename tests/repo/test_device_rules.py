"""docs/neuron.md §4: every device rule has a row in the generated table (platforms/neuron/device_rules.py)
naming its check or saying it is documented only; the doc's table and the device report's `rules`
list come from that one table, and every named check exists (a test function, or a field the device
report writes: tools/device_report.py REPORT_FIELDS)."""
import re

from deepinfer.platforms.neuron import device_rules as dr
from deepinfer.tools.device_report import REPORT_FIELDS
from tests.support import REPO as ROOT

DOC = ROOT / "docs/neuron.md"


def _section_4() -> str:
    text = DOC.read_text()
    return text[text.index("## 4. Device rules"):text.index("## 5. Design")]


def test_doc_table_is_the_generated_one():
    assert dr.doc_block(DOC.read_text()) == dr.markdown_table(), \
        "regenerate it: python -m deepinfer.platforms.neuron.device_rules docs/neuron.md"


def test_every_rule_of_section_4_has_exactly_one_row():
    ids, group = [], None
    for line in _section_4().splitlines():
        head = re.match(r"\*\*([A-G])\. ", line)
        if head:
            group = head.group(1)
        item = re.match(r"(\d+)\. ", line)
        if group and item:
            ids.append(f"{group}{item.group(1)}")
    assert len(ids) > 50 and ids == [r.id for r in dr.RULES]


def test_report_rules_come_from_the_table():
    rows = dr.report_rules()
    assert [(r["id"], r["status"], r["check"]) for r in rows] == [(r.id, r.status, r.check) for r in dr.RULES]
    assert {r["status"] for r in rows} <= {"enforced", "documented"}


def test_every_named_check_exists():
    missing = []
    for rule in dr.RULES:
        if rule.check is None:
            assert rule.status == "documented"
            continue
        if rule.check.startswith("report:"):
            if rule.check.removeprefix("report:") not in REPORT_FIELDS:
                missing.append(f"{rule.id}: {rule.check}")
            continue
        path, _, name = rule.check.partition("::")
        file = ROOT / path
        if not file.is_file() or not re.search(rf"^(async )?def {re.escape(name)}\(", file.read_text(), re.M):
            missing.append(f"{rule.id}: {rule.check}")
    assert not missing, missing
