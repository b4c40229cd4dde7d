"""The benchmarks page is rendered from the committed result files, never edited apart from them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from bench import report
from bench.results_io import command_line, result_slug, write_result

RESULT = {
    "benchmark": "decode",
    "title": "Decode step against the HBM floor",
    "command": "python -m bench.bench_decode --tokenizer-dir DIR",
    "hardware": "1x NVIDIA H200",
    "software": {"torch": "2.11.0", "triton": "3.6.0"},
    "date": "2026-11-30",
    "model": "Llama-3-8B shapes",
    "measured": {"copy_bandwidth_gbps": 4271},
    "rows": [
        {"batch": 1, "context": 1024, "engine_ms": [3.9, 3.908], "floor_ms": 3.6, "x_floor": 1.08},
        {"batch": 64, "context": 2048, "engine_ms": 8.914, "floor_ms": None, "x_floor": 1.175},
    ],
    "notes": "Five runs.",
}


def test_a_result_file_renders_as_a_section(tmp_path: Path) -> None:
    (tmp_path / "decode_h200_2026-11-30.json").write_text(json.dumps(RESULT))
    text = report.render_markdown(report.load_results(tmp_path), link_root="results")
    assert "`python -m bench.bench_decode --tokenizer-dir DIR`" in text
    assert "1x NVIDIA H200; date: 2026-11-30" in text
    assert "torch 2.11.0, triton 3.6.0" in text
    assert "copy bandwidth 4271 GB/s" in text
    assert "[decode_h200_2026-11-30.json](results/decode_h200_2026-11-30.json)" in text
    assert "| batch | context | engine ms | floor ms | × floor |" in text
    assert "| 1 | 1024 | 3.900–3.908 | 3.6 | 1.080 |" in text  # a column's decimals agree
    assert "| 64 | 2048 | 8.914 | — | 1.175 |" in text
    assert "Five runs." in text


def test_the_headline_replaces_only_the_marked_region() -> None:
    readme = f"# x\n\n{report.HEADLINE_START}\nold\n{report.HEADLINE_END}\n\nrest\n"
    result = dict(RESULT, _file="decode_h200_2026-11-30.json")
    new = report.replace_headline(readme, report.render_headline([result]))
    assert new is not None and "old" not in new and new.endswith("\n\nrest\n")
    assert "3.900–3.908 ms, 1.08× the HBM floor" in new
    assert "(docs/benchmarks.md#decode_h200_2026-11-30)" in new
    assert report.replace_headline("# no markers\n", "table") is None


def test_results_io_writes_what_the_report_reads(tmp_path: Path) -> None:
    path = write_result(tmp_path, "prefill", [{"prompts": 1, "step_ms": 2.5}], model="tiny")
    assert path is not None
    result = json.loads(path.read_text())
    assert {"command", "hardware", "software", "date", "model", "rows"} <= result.keys()
    assert "python" in result["software"]
    assert path.name == f"prefill_{result_slug(result['hardware'])}_{result['date']}.json"
    assert "| 1 | 2.5 |" in report.render_markdown(report.load_results(tmp_path))
    assert result_slug("2x NVIDIA H200") == "h200x2" and result_slug("CPU: x86_64, 2") == "cpu"


def test_the_committed_page_is_what_the_results_render() -> None:
    """docs/benchmarks.md must be regenerated (`python -m bench.report`) with the results."""
    expected = report.render_markdown(report.load_results(report.RESULTS))
    assert report.DOC.read_text() == expected, "run `python -m bench.report`"
    for plot in report.plan_plots(report.load_results(report.RESULTS)):
        assert (report.RESULTS / "plots" / plot.name).is_file(), plot.name


def test_the_notes_link_to_sections_that_exist() -> None:
    page = report.DOC.read_text()
    for note in (report.ROOT / "docs" / "notes").glob("*.md"):
        for target in re.findall(r"\(\.\./benchmarks\.md#([^)]+)\)", note.read_text()):
            assert f'<a id="{target}"></a>' in page, f"{note.name}: no section {target}"


def test_the_command_shows_folders_and_files_without_where_they_lay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model.gguf"
    model.write_text("")
    argv = ["bench/x.py", "--tokenizer-dir", str(tmp_path), "--model", str(model), "--k", "4"]
    monkeypatch.setattr("sys.argv", argv)
    monkeypatch.delitem(sys.modules, "__main__")
    assert command_line() == "python bench/x.py --tokenizer-dir DIR --model model.gguf --k 4"
