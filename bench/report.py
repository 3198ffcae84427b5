"""Markdown table + PNG plot + raw JSON for one benchmark run, written to bench/results/; the pieces
other reports share (the result files, matplotlib, per-round ratio summaries)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import RESULTS, ROOT, Settings, git_describe, loadavg, log, machine
from bench.measure import Point, fmt_ms, fmt_rate, median_point


@dataclass
class Group:
    """One table: rows are (x, server); `data[(server, x)]` holds one Point per round."""

    title: str
    x_name: str  # e.g. "concurrency"
    unit: str  # e.g. "infer/s"
    servers: list[str]
    xs: list[int]
    data: dict[tuple[str, int], list[Point]] = field(default_factory=dict)
    subject: str = "Pier"  # ratios are computed for rows of servers starting with this name
    refs: list[str] = field(default_factory=list)  # servers to compare against (one ratio column each)
    x_labels: dict[str, str] = field(default_factory=dict)  # server -> how its x reads ("batch", ...)
    notes: list[str] = field(default_factory=list)

    def add(self, server: str, x: int, point: Point | None) -> None:
        if point is not None:
            self.data.setdefault((server, x), []).append(point)

    def point(self, server: str, x: int) -> Point | None:
        return median_point(self.data.get((server, x), []))

    def tput(self, server: str, x: int) -> float | None:
        p = self.point(server, x)
        return p.throughput if p else None

    def round_ratios(self, a: str, x: int, b: str, y: int | None = None) -> list[float]:
        """Row `a` at `x` over row `b` at `y` (default `x`) within each round, when both rows have
        every round (each round measures the rows back to back: a paired comparison)."""
        pa, pb = self.data.get((a, x), []), self.data.get((b, x if y is None else y), [])
        if len(pa) < 2 or len(pa) != len(pb) or not all(q.throughput for q in pb):
            return []
        return [p.throughput / q.throughput for p, q in zip(pa, pb)]

    def ratio(self, a: str, x: int, b: str, y: int | None = None) -> float | None:
        """The median of the per-round ratios when there are several paired rounds (on this noisy
        machine the rows of one round share its load), else the ratio of the median rounds."""
        paired = self.round_ratios(a, x, b, y)
        if paired:
            return statistics.median(paired)
        p, q = self.tput(a, x), self.tput(b, x if y is None else y)
        return p / q if p and q else None

    def target(self, text: str, a: str, x: int, b: str, threshold: float, y: int | None = None) -> Target:
        return Target(text, self.ratio(a, x, b, y), threshold, self.round_ratios(a, x, b, y))


@dataclass
class Target:
    text: str  # what the target says
    value: float | None  # measured ratio
    threshold: float
    rounds: list[float] = field(default_factory=list)  # the ratio within each round, when paired

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "n/a (not measured)"
        return "MET" if self.value >= self.threshold else "MISSED"


def _table(g: Group) -> list[str]:
    ratio_heads = [f"vs {r}" for r in g.refs]
    head = [g.x_name, "server", g.unit, "p50 ms", "p90 ms", "p99 ms", *ratio_heads]
    any_rounds = any(len(v) > 1 for v in g.data.values())
    any_cpu = any(p.server_cpu_us is not None for v in g.data.values() for p in v)
    if any_cpu:
        head.append("server CPU µs/req")
    if any_rounds:
        head.append("rounds")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in g.xs:
        for s in g.servers:
            p = g.point(s, x)
            xl = f"{g.x_labels.get(s, '')} {x}".strip()
            if p is None:
                continue
            mark = "" if p.stable else " ~"
            if p.errors:
                mark += f" ({p.errors} errors)"
            cells = [xl, s, fmt_rate(p.throughput) + mark, fmt_ms(p.p50_us), fmt_ms(p.p90_us), fmt_ms(p.p99_us)]
            for r in g.refs:
                ratio = g.ratio(s, x, r) if s != r and s.startswith(g.subject) else None
                cells.append(f"{ratio:.2f}×" if ratio else "")
            if any_cpu:
                cells.append(_cpu_cell(g.data.get((s, x), [])))
            if any_rounds:
                rounds = p.extra.get("rounds", [])
                cells.append(" / ".join(fmt_rate(v) for v in rounds) if len(rounds) > 1 else "")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cpu_cell(points: list[Point]) -> str:
    """The server's CPU µs per request: the rounds' median, with their min–max when several
    (`*`: counted from the throughput, the server keeping no statistics)."""
    vals = sorted(p.server_cpu_us for p in points if p.server_cpu_us is not None)
    if not vals:
        return ""
    mark = "*" if any(p.server_cpu_counted == "throughput" for p in points) else ""
    cell = f"{statistics.median(vals):,.0f}{mark}"
    return cell + (f" ({vals[0]:,.0f}–{vals[-1]:,.0f})" if len(vals) > 1 else "")


def ratio_cells(ratios: list[float]) -> tuple[str, str]:
    """Per-round ratios as two table cells: the median ("1.023×") and the min–max ("0.981–1.047";
    "(1 round)"; "—" for both when there is none)."""
    if not ratios:
        return "—", "—"
    med = f"{statistics.median(ratios):.3f}×"
    return med, (f"{min(ratios):.3f}–{max(ratios):.3f}" if len(ratios) > 1 else "(1 round)")


def ratio_reading(ratios: list[float], subject: str = "new") -> str:
    """What per-round ratios `subject`/other say: a change only when 1.0 is outside their spread."""
    if not ratios:
        return "not measured"
    if len(ratios) == 1:
        return "one round: no spread"
    if min(ratios) <= 1.0 <= max(ratios):
        return "no change (1.0 within spread)"
    return f"{subject} lower in every round" if max(ratios) < 1.0 else f"{subject} higher in every round"


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said in the log) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no PNG (pip install matplotlib)")
        return None
    return plt


def result_files(name: str, quick: bool) -> tuple[Path, Path, Path]:
    """bench/results/<name>[-quick].md, .png and .json (the folder is created)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = name + ("-quick" if quick else "")
    return RESULTS / f"{stem}.md", RESULTS / f"{stem}.png", RESULTS / f"{stem}.json"


def log_written(md: Path, png: Path | None, raw: Path) -> None:
    """The log line for a written report (`png`: None when no plot was written)."""
    log(f"wrote {md.relative_to(ROOT)}" + (f", {png.name}" if png else "") + f", {raw.name}")


def _plot(path: Path, title: str, groups: list[Group]) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    n = len(groups)
    fig, axes = plt.subplots(2, n, figsize=(max(6.5, 5.5 * n), 7.5), squeeze=False)
    for col, g in enumerate(groups):
        servers = [s for s in g.servers if any((s, x) in g.data for x in g.xs)]
        width = 0.8 / max(1, len(servers))
        for row, (attr, ylabel) in enumerate(((None, g.unit), ("p99_us", "p99 latency (ms)"))):
            ax = axes[row][col]
            for i, s in enumerate(servers):
                vals = []
                for x in g.xs:
                    p = g.point(s, x)
                    vals.append(0 if p is None else (p.throughput if attr is None else getattr(p, attr) / 1000))
                pos = [j + (i - (len(servers) - 1) / 2) * width for j in range(len(g.xs))]
                bars = ax.bar(pos, vals, width, label=s)
                if attr is None:
                    ax.bar_label(bars, labels=[fmt_rate(v) if v else "" for v in vals], fontsize=7, rotation=90,
                                 padding=2)
            ax.set_xticks(range(len(g.xs)), [str(x) for x in g.xs])
            ax.set_xlabel(g.x_name)
            ax.set_ylabel(ylabel)
            if attr is None:
                ax.set_title(g.title, fontsize=10)
                ax.margins(y=0.25)
                ax.legend(fontsize=7)
            else:
                from matplotlib.ticker import FuncFormatter

                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(name: str, title: str, settings, groups: list[Group], targets: list[Target], intro: list[str],
          notes: list[str], started: dict, extra_raw: dict | None = None) -> Path:
    md, png, raw = result_files(name, settings.quick)
    has_png = _plot(png, title, groups)
    lines = [f"# {title}", ""]
    lines += intro + [""]
    lines += [
        f"- run: {started['date']} – {time.strftime('%H:%M:%S')}, {settings.describe()}",
        f"- git: {git_describe()}; machine: {machine()}; load average at start {started['load']}, "
        f"at end {loadavg()}",
        "- figures are from ONE run, servers measured back to back (interleaved when rounds > 1); "
        "compare only within this file. `~` = perf_analyzer could not stabilise at the configured "
        "threshold and the point was re-measured with a looser one (50 %, then none); `rounds` lists "
        "each round's throughput, the table shows the median round. Ratios (the `vs` columns and the "
        "targets) are the median of the per-round ratios: each round measures the rows back to back, "
        "so a ratio within a round compares like with like.",
        "",
    ]
    if targets:
        lines += ["## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
        for t in targets:
            v = "—" if t.value is None else f"{t.value:.2f}×"
            if t.rounds:
                v += " (rounds: " + " / ".join(f"{r:.2f}" for r in t.rounds) + ")"
            lines.append(f"| {t.text} | {v} | {t.verdict} |")
        lines.append("")
    for g in groups:
        lines += [f"## {g.title}", ""] + _table(g) + [""]
        lines += [f"- {n}" for n in g.notes] + ([""] if g.notes else [])
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    if has_png:
        lines += [f"![{title}]({png.name})", ""]
    md.write_text("\n".join(lines))
    payload = {
        "title": title, "settings": settings.__dict__, "started": started, "git": git_describe(),
        "machine": machine(),
        "groups": [{"title": g.title, "unit": g.unit, "x_name": g.x_name,
                    "points": [{"server": s, "x": x, "rounds": [p.to_dict() for p in ps]}
                               for (s, x), ps in g.data.items()]} for g in groups],
        "targets": [{"text": t.text, "value": t.value, "threshold": t.threshold, "verdict": t.verdict}
                    for t in targets],
        "notes": notes, **(extra_raw or {}),
    }
    raw.write_text(json.dumps(payload, indent=1))
    log_written(md, png if has_png else None, raw)
    return md


def finish(written: list[Path], failed: list[str]) -> int:
    """Print the written reports' tables (not their notes or plots) and the exit status: 1 when a
    benchmark could not run."""
    for md in written:
        print()
        print(md.read_text().split("\n## Notes")[0].split("![")[0].rstrip())
    if failed:
        log(f"failed: {', '.join(failed)}")
        return 1
    return 0


def started_info() -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load": loadavg()}


def settings_main(module: str, doc: str | None, run: Callable[[Settings], Path], argv: list[str] | None = None) -> int:
    """`python -m MODULE [--quick] [--rounds N]` for a benchmark whose `run(settings)` writes one report."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short measurement windows and one round")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 1 quick, 3 full)")
    args = p.parse_args(argv)
    settings = Settings.make(args.quick, args.rounds)
    log(settings.describe())
    try:
        written = run(settings)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    return finish([written], [])
