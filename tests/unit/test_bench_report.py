"""The benchmarks page is rendered from the committed result files, never edited apart from them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from bench import report
from bench.results_io import command_line, result_slug, write_result
from bench.serving_load import RequestResult, steady_rate

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
    assert result_slug("1x NVIDIA H100 80GB HBM3") == "h100"


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


def test_a_goal_figure_shows_its_median_and_the_runs_range(tmp_path: Path) -> None:
    row = {"batch": 64, "context": 4096, "engine_ms": 8.694, "engine_ms_runs": [8.7, 8.694, 8.712],
           "x_floor": 1.144, "x_floor_runs": [1.144, 1.143, 1.147]}  # fmt: skip
    result = dict(RESULT, rows=[row, {"batch": 1, "context": 64, "engine_ms": 3.9}])
    (tmp_path / "decode_h200_2026-12-04.json").write_text(json.dumps(result))
    text = report.render_markdown(report.load_results(tmp_path))
    assert "| batch | context | engine ms | × floor |" in text  # runs beside their median
    assert "| 64 | 4096 | 8.694 (8.694–8.712) | 1.144 (1.143–1.147) |" in text
    assert "| 1 | 64 | 3.900 | — |" in text


def test_a_read_rate_floor_is_labelled_as_such(tmp_path: Path) -> None:
    old = dict(RESULT, benchmark="prefill", measured={"read_gbps": 4100})
    (tmp_path / "prefill_h200_2026-11-29.json").write_text(json.dumps(old))
    text = report.render_markdown(report.load_results(tmp_path))
    assert "| batch | context | engine ms | floor ms (read rate) | × floor (read rate) |" in text
    assert "over the `torch.sum` read rate" in text
    unrecorded = dict(RESULT, benchmark="prefill", measured={}, floor_rate="read")
    (tmp_path / "prefill_h200_2026-11-29.json").write_text(json.dumps(unrecorded))
    assert "| floor ms (read rate) |" in report.render_markdown(report.load_results(tmp_path))
    (tmp_path / "prefill_h200_2026-11-29.json").write_text(json.dumps(RESULT))  # copy rate
    text = report.render_markdown(report.load_results(tmp_path))
    assert "read rate" not in text and "| floor ms | × floor |" in text


def serving(*rows: tuple[float, str, float, float]) -> dict:
    """A serving result of (offered rate, mode, completed rate, goodput) rows."""
    fields = ("rate_per_s", "mode", "request_per_s", "goodput_req_per_s")
    out = [dict(zip(fields, r), median_tpot_ms=5.0) for r in rows]
    return dict(RESULT, benchmark="serving", rows=out, _file="serving_h200x2_2026-12-04.json")


def test_the_serving_headline_is_at_the_highest_rate_colocated_sustains() -> None:
    result = serving(
        (30, "disaggregated", 26.0, 20.0), (30, "colocated", 24.0, 3.0),  # overload
        (20, "disaggregated", 19.6, 18.0), (20, "colocated", 19.1, 12.0),  # 95.5%: sustained
        (10, "disaggregated", 9.9, 9.8), (10, "colocated", 9.8, 9.5),
    )  # fmt: skip
    assert report.sustained_rate(result) == 20
    label, figure = report.serving_headline(result) or ("", "")
    assert label == "Serving at 20 requests/s offered: disaggregated against colocated"
    assert figure.startswith("goodput 18.0 against 12.0 requests/s")
    # the overload rows kept, below the sustained ones
    assert [r["rate_per_s"] for r in report.serving_rows(result)] == [20, 20, 10, 10, 30, 30]
    text = "\n".join(report.section(result, [], "results"))
    assert "colocated sustains up to 20 requests/s" in text
    assert text.index("| 10 | colocated |") < text.index("| 30 | disaggregated |")


def test_without_a_sustained_rate_the_headline_says_overload() -> None:
    result = serving((28, "disaggregated", 19.2, 12.0), (28, "colocated", 18.2, 2.5),
                     (20, "disaggregated", 17.0, 16.5), (20, "colocated", 16.5, 6.5))  # fmt: skip
    assert report.sustained_rate(result) is None
    label, figure = report.serving_headline(result) or ("", "")
    assert label.startswith("Serving at 20 requests/s offered")
    assert "colocated completed 82% of it: it sustains no rate measured" in label
    assert "every row is in overload" in "\n".join(report.section(result, [], "results"))


def test_every_floor_is_the_copy_rate_and_the_datasheet_beside_it() -> None:
    from bench.gpu_common import Floor, datasheet_gbps

    assert datasheet_gbps("NVIDIA H200") == 4800 and datasheet_gbps("NVIDIA A10") is None
    cols = Floor(copy_gbps=4000, datasheet_gbps=4800).columns(4e9, 1.5)
    assert cols == {"floor_ms": 1.0, "x_floor": 1.5, "datasheet_floor_ms": 0.833,
                    "x_datasheet_floor": 1.8}  # fmt: skip
    assert Floor(4000).columns(4e6, 1.5, unit="us")["x_datasheet_floor"] is None
    assert Floor(4000).columns(4e6, 1.5, unit="us")["floor_us"] == 1.0


def test_the_decode_headline_shows_the_runs_range() -> None:
    row = {"batch": 1, "context": 1024, "engine_ms": 3.9, "engine_ms_runs": [3.9, 3.88, 3.95],
           "floor_ms": 3.6, "x_floor": 1.08, "x_floor_runs": [1.08, 1.078, 1.097]}  # fmt: skip
    result = dict(RESULT, rows=[row], _file="decode_h200_2026-12-04.json")
    assert "3.90 (3.88–3.95) ms, 1.080 (1.078–1.097)× the HBM floor" in report.render_headline(
        [result]
    )


def test_the_steady_rate_leaves_out_the_ramp_and_the_drain() -> None:
    """10 sends a second for 10 s; replies 1.0 s after each send. The whole run's rate (11 s for
    100 requests, 9.1/s) is the drain's; the steady rate is the sustained 10/s."""
    results = [
        RequestResult(ok=True, prompt_tokens=1, sent_at=t / 10, done_at=t / 10 + 1.0)
        for t in range(100)
    ]
    results.append(RequestResult(ok=False, prompt_tokens=1, sent_at=5.0))  # failed: not counted
    rate = steady_rate(results)
    assert rate["arrival_window_s"] == pytest.approx(9.9)
    # completions after the first (at 1.0 s) up to the last send (9.9 s): 89 in 8.9 s
    assert rate["steady_request_per_s"] == pytest.approx(10.0)
    # every reply after the last send (a burst): no steady rate to speak of
    burst = [RequestResult(ok=True, prompt_tokens=1, done_at=2.0 + i) for i in range(3)]
    assert steady_rate(burst) == {"arrival_window_s": 0.0}


def test_sustained_reads_the_steady_rate_first_and_old_files_still_work() -> None:
    assert report.COMPLETED_RATE == ("steady_request_per_s", "request_per_s")
    result = serving((20, "disaggregated", 18.0, 17.0), (20, "colocated", 18.0, 12.0))
    assert report.sustained_rate(result) is None  # old file: the whole run's 90%
    result["rows"][1]["steady_request_per_s"] = 19.5  # the drain pulled the whole run's down
    assert report.sustained_rate(result) == 20
    assert "from the first reply to the last send" in "\n".join(report.section(result, [], "r"))
    result["rows"][1]["steady_request_per_s"] = 17.0  # steady below 95%: not sustained
    assert report.sustained_rate(result) is None
