"""Render the benchmark result files (bench/results/*.json) into docs/benchmarks.md, plots beside
the results (bench/results/plots/*.png) and README.md's headline table.

    python -m bench.report                      # rewrite the three from bench/results
    python -m bench.report --results DIR --stdout   # print DIR's results as markdown, write nothing

README.md's headline goes between the lines `<!-- bench:headline -->` and
`<!-- /bench:headline -->`; without them README.md is left alone (a warning says so).
tests/unit/test_bench_report.py checks that docs/benchmarks.md is what this renders.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.report")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
HEADLINE_START, HEADLINE_END = "<!-- bench:headline -->", "<!-- /bench:headline -->"
COMMAND = "python -m bench.report"
SERVING_TITLE = "Disaggregated against colocated serving, "

# The order of the sections; benchmarks not listed follow, by name.
ORDER = (
    "decode",
    "decode-fp8",
    "decode-tp2",
    "decode-attention",
    "gemm-decode",
    "gemm-decode-tp2",
    "gemm-decode-gated",
    "prefill",
    "moe",
    "lora-decode",
    "offline-gpu",
    "serving",
    "serving-long-prompts",
    "serving-stream-interval",
    "serving-router-replicas",
    "kv-transfer",
    "kv-transfer-dtypes",
    "kv-staged",
    "prefix-cache",
    "kv-tiers",
    "routing",
    "routing-decision",
    "kv-channel",
)
# Column-name pieces and how a header spells them.
WORDS = {
    "ms": "ms",
    "us": "µs",
    "s": "s",
    "gbps": "GB/s",
    "tbps": "TB/s",
    "tflops": "TFLOP/s",
    "mib": "MiB",
    "pct": "%",
    "p50": "P50",
    "p99": "P99",
    "gpu": "GPU",
    "gemm": "GEMM",
    "cublas": "cuBLAS",
    "nixl": "NIXL",
    "ttft": "TTFT",
    "tpot": "TPOT",
    "itl": "ITL",
    "e2e": "E2E",
    "hf": "HF",
    "kv": "KV",
    "tok": "tok",
    "req": "req",
}


Result = dict[str, Any]


def load_results(folder: Path) -> list[Result]:
    """Every result file in `folder`, in section order (within a benchmark, newest first)."""
    results = []
    for path in sorted(folder.glob("*.json")):
        result = json.loads(path.read_text())
        result["_file"] = path.name
        results.append(result)
    rank = {name: i for i, name in enumerate(ORDER)}
    results.sort(key=lambda r: r["_file"])
    results.sort(key=lambda r: r["date"], reverse=True)
    results.sort(key=lambda r: (rank.get(r["benchmark"], len(ORDER)), r["benchmark"]))
    return results


def anchor(result: Result) -> str:
    return result["_file"].removesuffix(".json")


def decimals(values: list[Any]) -> int:
    """How many decimals a column's floats need (JSON drops trailing zeros: 4.30 -> 4.3)."""
    flat = [x for v in values for x in (v if isinstance(v, list) else [v])]
    return max((len(repr(x).partition(".")[2]) for x in flat if isinstance(x, float)), default=0)


def number(value: Any, places: int = 0) -> str:
    """A figure as the table shows it: floats to `places` decimals (at least their own), ranges
    low–high, big integers with thin groups."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        places = max(places, decimals(value))
        return "–".join(number(v, places) for v in value)
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}".replace(",", " ")
    if isinstance(value, float):
        return f"{value:.{max(places, decimals([value]))}f}"
    return str(value)


def header(key: str) -> str:
    """`median_ttft_ms` -> `median TTFT ms`, `x_floor` -> `× floor`, `tok_per_s` -> `tok/s`."""
    text = key.replace("_per_", "/")
    words = ["×" if w == "x" else WORDS.get(w, w) for w in text.split("_")]
    return " ".join(words).replace("/ s", "/s")


def measured_text(measured: dict[str, Any]) -> str:
    """`copy_bandwidth_gbps: 4271` -> `copy bandwidth 4271 GB/s`."""
    parts = []
    for key, value in measured.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):  # a sweep's points
            points = "; ".join(", ".join(f"{k} {v}" for k, v in p.items()) for p in value)
            parts.append(f"{header(key)}: {points}")
            continue
        name, _, unit = key.rpartition("_")
        parts.append(f"{header(name)} {number(value)} {WORDS[unit]}")
    return ", ".join(parts)


RUNS = "_runs"  # `k_runs`: every run of figure `k` (its median); shown as median (min–max)


def with_runs(value: Any, runs: list[float] | None, places: int = 0) -> str:
    """A figure and the runs it is the median of: `8.694 (8.690–8.712)`, to the decimals of
    the most precise (at least `places`)."""
    if not runs:
        return number(value, places)
    places = max(places, decimals([value, runs]))
    return f"{number(value, places)} ({number([min(runs), max(runs)], places)})"


def table(rows: list[dict[str, Any]], rename: Callable[[str], str] = header) -> list[str]:
    """A markdown table of `rows`: every key any row has (in first-seen order), less columns
    empty in every row and `k_runs` columns, whose runs go beside `k`'s median; a column's
    floats to the same number of decimals. `rename` spells a key as a header."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    keys = [k for k in keys if any(row.get(k) is not None for row in rows)]
    keys = [k for k in keys if not (k.endswith(RUNS) and k.removesuffix(RUNS) in keys)]
    places = {k: decimals([row.get(k) for row in rows] + [row.get(k + RUNS) for row in rows])
              for k in keys}  # fmt: skip
    lines = ["| " + " | ".join(rename(k) for k in keys) + " |", "|" + " --- |" * len(keys)]
    lines += [
        "| " + " | ".join(with_runs(row.get(k), row.get(k + RUNS), places[k]) for k in keys) + " |"
        for row in rows
    ]
    return lines


def read_rate_floor(result: Result) -> bool:
    """Whether `result` was measured against the `torch.sum` read rate (files before every
    benchmark took the copy rate; the read rate is 3-5% lower, its ratios so much lower): its
    `floor_rate` says so, or its measured rates do."""
    measured = result.get("measured") or {}
    if "floor_rate" in result:
        return result["floor_rate"] == "read"
    return "read_gbps" in measured and "copy_bandwidth_gbps" not in measured


def floor_header(key: str) -> str:
    """A read-rate file's header: its floor columns say which rate they are over."""
    text = header(key)
    return f"{text} (read rate)" if "floor" in key and "datasheet" not in key else text


def software_text(software: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in software.items()) or "not recorded"


@dataclass(frozen=True)
class Plot:
    """A PNG under bench/results/plots, shown in the section of result `under`."""

    name: str
    under: str
    caption: str
    draw: Callable[[Path], None]


def midpoint(value: Any) -> float | None:
    if isinstance(value, list):
        return sum(value) / len(value)
    return value


def decode_points(results: list[Result]) -> dict[int, list[tuple[int, float, float]]]:
    """Context -> (batch, step ms, floor ms): the newest one-GPU figure of each point that has
    both a step time and a floor (ranges at their midpoint)."""
    seen: dict[tuple[int, int], tuple[float, float]] = {}
    for result in results:  # newest first
        if result["benchmark"] != "decode":
            continue
        for row in result["rows"]:
            step = midpoint(row.get("engine_ms")) or midpoint(row.get("overlap_ms"))
            floor = midpoint(row.get("floor_ms"))
            point = (row["batch"], row["context"])
            if step and floor and point not in seen:
                seen[point] = (step, floor)
    by_context: dict[int, list[tuple[int, float, float]]] = {}
    for (batch, context), (step, floor) in sorted(seen.items()):
        by_context.setdefault(context, []).append((batch, step, floor))
    return by_context


def plain_ticks(axis: Any) -> None:
    """Tick labels of a log axis as plain numbers (5, 10, 20), not powers of ten."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def draw_decode(results: list[Result], hardware: str) -> Callable[[Path], None]:
    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for i, (context, points) in enumerate(sorted(decode_points(results).items())):
            batches, steps, floors = zip(*points, strict=True)
            color = f"C{i}"
            ax.plot(batches, steps, "o-", color=color, label=f"step, context {context}")
            ax.plot(batches, floors, "--", color=color, alpha=0.7, label=f"HBM floor, {context}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({b for pts in decode_points(results).values() for b, _, _ in pts}))
        plain_ticks(ax.xaxis)
        ax.set_xlabel("batch (sequences)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"Decode step against the HBM floor ({hardware})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        save(fig, path)

    return draw


def by_mode(result: Result, key: str) -> dict[str, tuple[list[float], list[float]]]:
    """Mode -> (rates, values of `key`) of a serving result."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for row in result["rows"]:
        if row.get(key) is not None:
            rates, values = out.setdefault(row["mode"], ([], []))
            rates.append(row["rate_per_s"])
            values.append(row[key])
    return out


def draw_serving(panels: list[tuple[Result, str, str]]) -> Callable[[Path], None]:
    """One panel per (result, key, label): the key against the offered rate, a line a mode."""

    def draw(path: Path) -> None:
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
        for ax, (result, key, label) in zip(axes[0], panels, strict=True):
            lines = by_mode(result, key)
            top = max(max(rates) for rates, _ in lines.values())
            ax.plot([0, top], [0, top], ":", color="gray", label="offered")
            for mode, (rates, values) in sorted(lines.items(), reverse=True):
                ax.plot(rates, values, "o-", label=mode)
            ax.set_xlim(0, top * 1.05)
            ax.set_ylim(0, top * 1.05)
            ax.set_xlabel("offered requests a second")
            ax.set_ylabel(label)
            ax.set_title(result["title"].removeprefix(SERVING_TITLE), fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"Disaggregated against colocated serving ({panels[0][0]['hardware']})")
        save(fig, path)

    return draw


def ttft_tpot_panels(
    path: Path, title: str, fill: Callable[[Any, str], None], log_axis: str
) -> None:
    """A figure of two panels, TTFT then TPOT, each drawn by `fill(ax, metric)` and given a log
    `log_axis` ("x" or "y") with plain tick labels."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.2))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        fill(ax, metric)
        getattr(ax, f"set_{log_axis}scale")("log")
        plain_ticks(getattr(ax, f"{log_axis}axis"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save(fig, path)


def draw_latency(result: Result) -> Callable[[Path], None]:
    """Median and P99 TTFT and TPOT against the offered rate, a line a mode."""

    def fill(ax: Any, metric: str) -> None:
        medians = sorted(by_mode(result, f"median_{metric}_ms").items(), reverse=True)
        for i, (mode, (rates, med)) in enumerate(medians):
            _, p99 = by_mode(result, f"p99_{metric}_ms")[mode]
            ax.plot(rates, med, "o-", color=f"C{i}", label=f"{mode}, median")
            ax.plot(rates, p99, "s--", color=f"C{i}", alpha=0.7, label=f"{mode}, P99")
        ax.set_xlabel("offered requests a second")
        ax.set_ylabel(f"{metric.upper()} ms")

    title = f"{result['title']} ({result['hardware']})"
    return lambda path: ttft_tpot_panels(path, title, fill, "y")


def draw_distributions(result: Result) -> Callable[[Path], None]:
    """Per-request TTFT and TPOT as cumulative distributions, a line per mode and rate."""

    def fill(ax: Any, metric: str) -> None:
        for label, requests in sorted(result["requests"].items()):
            key = f"{metric}_s"
            values = sorted(1e3 * r[key] for r in requests if r["ok"] and r[key])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
        ax.set_xlabel(f"{metric.upper()} ms")
        ax.set_ylabel("share of requests")

    title = f"{result['title']}: per-request distributions"
    return lambda path: ttft_tpot_panels(path, title, fill, "x")


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def newest(results: list[Result], benchmark: str) -> Result | None:
    return next((r for r in results if r["benchmark"] == benchmark), None)


def plan_plots(results: list[Result]) -> list[Plot]:
    """The plots the results have data for (decided from the data alone, so the markdown does
    not depend on whether the PNGs were drawn)."""
    plots = []
    decode = newest(results, "decode")
    if decode and sum(len(p) for p in decode_points(results).values()) >= 3:
        caption = "Decode step time against batch size, with the HBM floor of each context"
        draw = draw_decode(results, decode["hardware"])
        plots.append(Plot("decode_step.png", anchor(decode), caption, draw))
    panels = []
    long = newest(results, "serving-long-prompts")
    if long:
        panels.append((long, "request_per_s", "completed requests a second"))
    short = newest(results, "serving")
    if short and any(r.get("goodput_req_per_s") is not None for r in short["rows"]):
        panels.append((short, "goodput_req_per_s", "goodput (requests a second within the SLOs)"))
    if panels:
        caption = "Throughput and goodput against the offered request rate"
        plots.append(Plot("serving_rate.png", anchor(panels[-1][0]), caption, draw_serving(panels)))
    if long and any("median_tpot_ms" in r for r in long["rows"]):
        caption = "TTFT and TPOT (median and P99) against the offered request rate"
        plots.append(Plot("serving_latency.png", anchor(long), caption, draw_latency(long)))
    for result in results:
        if result.get("requests"):
            name = f"{anchor(result)}_distributions.png"
            caption = "Per-request TTFT and TPOT distributions"
            plots.append(Plot(name, anchor(result), caption, draw_distributions(result)))
    return plots


def section(result: Result, plots: list[Plot], link_root: str) -> list[str]:
    lines = [
        f'<a id="{anchor(result)}"></a>',
        "",
        f"### {result['title']}",
        "",
        f"- Command: `{result['command']}`",
        f"- Hardware: {result['hardware']}; date: {result['date']}",
        f"- Software: {software_text(result.get('software', {}))}",
        f"- Model: {result['model']}",
    ]
    if result.get("measured"):
        lines.append(f"- Measured in the same run: {measured_text(result['measured'])}")
    read_rate = read_rate_floor(result)
    if read_rate:
        lines.append(
            "- Floor: over the `torch.sum` read rate, as recorded before every benchmark took "
            "the copy rate; the read rate is 3-5% lower, so these × floor are 3-5% lower than "
            "a copy-rate file's for the same time"
        )
    if has_baseline(result):
        lines.append(f"- {sustained_text(result)}")
    lines += [f"- Data: [{result['_file']}]({link_root}/{result['_file']})", ""]
    lines += table(serving_rows(result), floor_header if read_rate else header)
    if result.get("notes"):
        lines += ["", result["notes"]]
    for plot in plots:
        if plot.under == anchor(result):
            lines += ["", f"![{plot.caption}]({link_root}/plots/{plot.name})"]
    return lines + [""]


def render_markdown(results: list[Result], link_root: str = "../bench/results") -> str:
    """docs/benchmarks.md: a section per result file, grouped by benchmark."""
    plots = plan_plots(results)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{COMMAND}` from the result files in `bench/results/`; do not edit by "
        "hand. Each benchmark script writes such a file with `--out DIR` "
        "(`bench/results_io.py`), and `bash bench/gpu_suite.sh` runs the GPU ones. Ranges "
        "(low–high) span several runs of the same code. What was tried and dropped on the way "
        "to these figures is in [the engineering notes](notes/README.md).",
        "",
    ]
    current = None
    for result in results:
        if result["benchmark"] != current:
            current = result["benchmark"]
            lines += [f"## {current}", ""]
        lines += section(result, plots, link_root)
    return "\n".join(lines).rstrip("\n") + "\n"


SERVING = {"serving", "serving-long-prompts", "serving-stream-interval", "serving-router-replicas",
           "serving-gpu-share"}  # fmt: skip
SUSTAINED = 0.95  # a rate the baseline sustains: it completed at least this share of it
BASELINE = "colocated"
# A row's completed rate: the steady one (first reply to last send) where the row has it; the
# whole run's (its drain included) in result files from before it was recorded.
COMPLETED_RATE = ("steady_request_per_s", "request_per_s")


def completed_rate(row: dict[str, Any]) -> float | None:
    return next((row[k] for k in COMPLETED_RATE if row.get(k) is not None), None)


def has_baseline(result: Result) -> bool:
    """A serving result with colocated rows at offered rates."""
    rows = result["rows"]
    return (
        result["benchmark"] in SERVING
        and any(r.get("mode") == BASELINE for r in rows)
        and all("rate_per_s" in r for r in rows)
    )


def sustained_rate(result: Result) -> float | None:
    """The highest offered rate that the colocated baseline sustains (completed >= 95% of
    offered), None if it sustains none of a serving result's rates."""
    rates = [
        r["rate_per_s"]
        for r in result["rows"]
        if r.get("mode") == BASELINE
        and (done := completed_rate(r)) is not None
        and done >= SUSTAINED * r["rate_per_s"]
    ]
    return max(rates, default=None)


def sustained_text(result: Result) -> str:
    top = sustained_rate(result)
    steady = any(r.get(COMPLETED_RATE[0]) is not None for r in result["rows"])
    measure = (
        "completed: steady_request_per_s, from the first reply to the last send"
        if steady
        else "completed: request/s over the whole run, its tail of latencies included"
    )
    if top is None:
        return (
            f"Offered rates: {BASELINE} completed < {SUSTAINED:.0%} of every rate here "
            f"({measure}): every row is in overload, or its run too short to show otherwise"
        )
    return (
        f"Offered rates: {BASELINE} sustains up to {number(top)} requests/s (completed "
        f"≥ {SUSTAINED:.0%}; {measure}); the rows of higher rates follow, in overload"
    )


def serving_rows(result: Result) -> list[dict[str, Any]]:
    """A serving result's rows, those at rates the baseline sustains first, overload rows
    below; others as they are."""
    rows = result["rows"]
    top = sustained_rate(result) if has_baseline(result) else None
    if top is None:
        return rows
    return sorted(rows, key=lambda r: r["rate_per_s"] > top)  # stable: order kept within


def find_row(results: list[Result], benchmark: str, **match: Any) -> tuple[Result, dict] | None:
    """The newest row of `benchmark` whose fields equal `match` and that has a ratio."""
    for result in results:
        if result["benchmark"] != benchmark:
            continue
        for row in result["rows"]:
            if all(row.get(k) == v for k, v in match.items()) and row.get("x_floor") is not None:
                return result, row
    return None


def headline_rows(results: list[Result]) -> list[tuple[str, str, Result]]:
    """(what, figure, its result) for README.md's headline table."""
    out = []
    decodes = (
        ("decode", "Decode step, batch 1, context 1024", dict(batch=1, context=1024)),
        ("decode", "Decode step, batch 64, context 2048", dict(batch=64, context=2048)),
        ("decode-tp2", "Decode step at TP=2, batch 1, context 1024", dict(batch=1, context=1024)),
    )
    for benchmark, label, match in decodes:
        found = find_row(results, benchmark, **match)
        if found:
            result, row = found
            ms = with_runs(row["engine_ms"], row.get("engine_ms" + RUNS))
            x = with_runs(row["x_floor"], row.get("x_floor" + RUNS))
            figure = f"{ms} ms, {x}× the HBM floor"
            out.append((label, figure, result))
    serving = newest(results, "serving")
    if serving:
        found = serving_headline(serving)
        if found:
            out.append((*found, serving))
    return out


def serving_headline(result: Result) -> tuple[str, str] | None:
    """(what, figure) of a serving result at the highest offered rate the colocated baseline
    sustains; without one, at the lowest rate, said to be in overload."""
    top = sustained_rate(result)
    rate = top if top is not None else min(r["rate_per_s"] for r in result["rows"])
    at = {r["mode"]: r for r in result["rows"] if r["rate_per_s"] == rate}
    if not {"disaggregated", BASELINE} <= at.keys():
        return None
    d, c = at["disaggregated"], at[BASELINE]
    figure = (
        f"goodput {number(d['goodput_req_per_s'])} against {number(c['goodput_req_per_s'])}"
        f" requests/s; median TPOT {number(d['median_tpot_ms'])} against "
        f"{number(c['median_tpot_ms'])} ms"
    )
    label = f"Serving at {number(rate)} requests/s offered: disaggregated against colocated"
    if top is None:
        completed = (completed_rate(c) or 0.0) / rate
        label += f" (colocated completed {completed:.0%} of it: it sustains no rate measured)"
    return label, figure


def render_headline(results: list[Result], doc_link: str = "docs/benchmarks.md") -> str:
    lines = ["| | figure | hardware | details |", "| --- | --- | --- | --- |"]
    for label, figure, result in headline_rows(results):
        link = f"[{result['date']}]({doc_link}#{anchor(result)})"
        lines.append(f"| {label} | {figure} | {result['hardware']} | {link} |")
    return "\n".join(lines) + "\n"


def replace_headline(readme: str, headline: str) -> str | None:
    """`readme` with the text between the headline markers replaced; None without them."""
    pattern = re.compile(
        rf"^{re.escape(HEADLINE_START)}\n.*?^{re.escape(HEADLINE_END)}$", re.S | re.M
    )
    if not pattern.search(readme):
        return None
    block = f"{HEADLINE_START}\n{headline}{HEADLINE_END}"
    return pattern.sub(lambda _: block, readme, count=1)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--stdout", action="store_true", help="print the markdown, write nothing")
    args = ap.parse_args()
    results = load_results(args.results)
    if args.stdout:
        print(render_markdown(results, link_root=str(args.results)))
        return
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render_markdown(results))
    log.info("wrote %s", DOC.relative_to(ROOT))
    plot_dir = args.results / "plots"
    plot_dir.mkdir(exist_ok=True)
    for plot in plan_plots(results):
        plot.draw(plot_dir / plot.name)
        log.info("wrote %s", plot_dir / plot.name)
    readme = README.read_text() if README.is_file() else ""
    updated = replace_headline(readme, render_headline(results))
    if updated is None:
        log.warning(
            "README.md has no %s ... %s lines: its headline table is not updated",
            HEADLINE_START,
            HEADLINE_END,
        )
    elif updated != readme:
        README.write_text(updated)
        log.info("updated README.md's headline table")


if __name__ == "__main__":
    main()
