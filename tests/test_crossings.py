"""docs/crossings.md is what the tests' crossing marks say (tools/crossings.py), and a mark that
names no row or column of the table is refused rather than dropped."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def crossings():
    spec = importlib.util.spec_from_file_location("crossings", ROOT / "tools" / "crossings.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["crossings"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_crossings_page_is_what_the_tests_marks_say():
    tool = crossings()
    found = tool.marks()
    assert {(m.event, m.layout) for m in found} >= {("oom", "pipeline"), ("recut", "pipeline"), ("switch", "data")}
    doc = tool.DOC.read_text()
    assert tool.written(doc, found) == doc, "docs/crossings.md is out of date: run python tools/crossings.py"


def test_a_mark_outside_the_table_is_refused_with_its_place(tmp_path):
    tool = crossings()
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n\n@pytest.mark.crossing('oom', 'data')\ndef test_fine():\n    pass\n\n\n"
        "@pytest.mark.parametrize('a', [pytest.param(1, marks=pytest.mark.crossing('teleport', 'data'))])\n"
        "def test_bad(a):\n    pass\n")
    with pytest.raises(ValueError, match="test_x.py:9: event 'teleport' is not a row"):
        tool.marks(tmp_path)
    (tmp_path / "test_x.py").write_text("import pytest\n\n\n@pytest.mark.crossing('oom', 'data', refused=True)\n"
                                        "def test_refused():\n    pass\n")
    [mark] = tool.marks(tmp_path)
    assert (mark.event, mark.layout, mark.refused, mark.test) == ("oom", "data", True, "test_x.py::test_refused")
    assert "| OOM, micro-batch halved or a lighter layout | R test_x |" in tool.table([mark])
