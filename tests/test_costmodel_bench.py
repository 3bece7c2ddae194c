"""bench/costmodel.py --smoke: the bench's path end to end (two short Ray runs at world 2, the
calibration, a prediction at unequal speeds, the table and its JSON line), so a change that
breaks the bench fails here rather than in the next person's two-minute run. Its figures are
not judged: a loaded machine moves them."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.ray
def test_the_costmodel_bench_runs_its_smoke_form(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "costmodel.py"), "--smoke", "--keep", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("where") and "predicted ms" in line)
    fit, slow = lines[header + 1].split(), lines[header + 2].split()
    assert fit[:3] == ["loopback", "data", "2x1"] and fit[-1] == "(fit)", lines[header + 1]
    assert slow[:4] == ["loopback", "data", "2x1", "1@0.5"] and slow[-1].endswith("%"), lines[header + 2]
    assert any(line.startswith("worst error per layout (goal within 15%): data, a slow rank ") for line in lines)
    result = json.loads(lines[-1])
    rows = result["rows"]
    assert [r["layout"] for r in rows] == ["data 2x1", "data 2x1 1@0.5"]
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)
    # the slowed rank's prediction: the fitted compute at half speed, the comm tail as fitted
    assert rows[1]["predicted_compute_ms"] == pytest.approx(2 * rows[0]["predicted_compute_ms"])
    assert rows[1]["predicted_wait_ms"] == pytest.approx(rows[0]["predicted_wait_ms"])
    assert set(result["worst_rel_error_by_layout"]) == {"data, a slow rank"}
    assert result["worst_rel_error"] == pytest.approx(rows[1]["rel_error"])
    assert (tmp_path / "data2-slow" / "telemetry.jsonl").is_file()
