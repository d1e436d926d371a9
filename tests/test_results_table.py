"""The table of the five papers' results (docs/papers.md, section "The five papers' results") against the presets in
kvbench/conf/experiment/, both ways: every preset it names exists with its `_cpu` twin and every claim it names is a
`kvbench analyze` claim; every paper preset (not `demo`, not `claims_*`, not a twin) appears in it; every row names a
preset or a claim, or says why there is none; and the rows cover each paper's numbered tables and figures, each
exactly once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = {p.stem for p in (REPO / "kvbench" / "conf" / "experiment").glob("*.yaml")}
PAPER_PRESETS = {n for n in EXPERIMENTS if n != "demo" and not n.startswith("claims_") and not n.endswith("_cpu")}
HEADING = "## The five papers' results"
COLUMNS = ["Paper", "Result", "Preset or claim", "Note, or why there is none"]
# The numbered figures and tables of each paper (its full text, appendices included; docs/papers.md names them), and the
# prefix its presets and claims carry.
PAPERS = {"RocketKV": ("rocketkv", 12, 21), "KeyDiff": ("keydiff", 19, 15), "CTKVR": ("ctkvr", 14, 15),
          "Ada-KV": ("adakv", 12, 15), "OmniKV": ("omnikv", 9, 14)}
NONE = "—"


def rows() -> list[dict[str, str]]:
    """The table's rows as {column: cell}; fails when the section or its header is not where it should be."""
    text = (REPO / "docs" / "papers.md").read_text()
    assert text.count(HEADING) == 1, f"docs/papers.md has no single section {HEADING!r}"
    lines = text.split(HEADING, 1)[1].splitlines()
    table = [line for line in _first_block(lines)]
    header, rule, *body = table
    assert _cells(header) == COLUMNS, _cells(header)
    assert set(rule.replace("|", "").strip()) <= {"-", " "}, rule
    return [dict(zip(COLUMNS, _cells(line), strict=True)) for line in body]


def _first_block(lines: list[str]) -> list[str]:
    """The section's first run of table lines."""
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def _cells(line: str) -> list[str]:
    assert line.startswith("|") and line.endswith("|"), line
    return [cell.strip() for cell in line[1:-1].split("|")]


def named(cell: str) -> list[str]:
    """The presets and claims a cell names (each in backticks)."""
    return re.findall(r"`([^`]+)`", cell)


def numbered(result: str) -> list[tuple[str, int]]:
    """The results a cell names: "Tables 2-3, 6-9" -> [(table, 2), (table, 3), (table, 6), ...]; "Fig. 8, Table 9"
    -> [(figure, 8), (table, 9)]. A bare number or range belongs to the kind last named."""
    out, kind = [], None
    for word, first, last in re.findall(r"(Figs?\.|Tables?)|(\d+)(?:-(\d+))?", result):
        if word:
            kind = "figure" if word.startswith("Fig") else "table"
            continue
        assert kind is not None, f"{result!r}: a number before Fig./Table"
        out += [(kind, n) for n in range(int(first), int(last or first) + 1)]
    assert out, f"{result!r} names no table or figure"
    return out


def claims() -> set[str]:
    from kvbench.analysis.runner import claims as registered

    return set(registered())


def test_every_row_names_a_preset_or_claim_or_says_why_not():
    for row in rows():
        assert row["Paper"] in PAPERS, row
        if row["Preset or claim"] == NONE:
            assert len(row["Note, or why there is none"]) > 10, f"{row['Paper']} {row['Result']}: no reason given"
        else:
            assert named(row["Preset or claim"]), f"{row['Paper']} {row['Result']}: names nothing in backticks"


def test_named_presets_exist_with_twins_and_named_claims_are_claims():
    known_claims = claims()
    for row in rows():
        prefix = PAPERS[row["Paper"]][0]
        for name in named(row["Preset or claim"]):
            assert name.startswith(prefix + "_"), f"{row['Paper']} {row['Result']}: {name} is not a {prefix} preset"
            if name in known_claims:
                continue
            assert name in EXPERIMENTS, f"{row['Paper']} {row['Result']}: no preset {name} in kvbench/conf/experiment"
            assert f"{name}_cpu" in EXPERIMENTS, f"{name} has no {name}_cpu twin"


def test_every_paper_preset_is_in_the_table():
    listed = {name for row in rows() for name in named(row["Preset or claim"])}
    assert PAPER_PRESETS - listed == set(), "presets the results table of docs/papers.md does not name"


@pytest.mark.parametrize("paper", sorted(PAPERS))
def test_each_numbered_result_has_exactly_one_row(paper: str):
    _, figures, tables = PAPERS[paper]
    seen = [result for row in rows() if row["Paper"] == paper for result in numbered(row["Result"])]
    twice = sorted({r for r in seen if seen.count(r) > 1})
    assert not twice, f"{paper}: in more than one row: {twice}"
    expected = {("figure", n) for n in range(1, figures + 1)} | {("table", n) for n in range(1, tables + 1)}
    assert set(seen) == expected, (f"{paper}: missing {sorted(expected - set(seen))}, "
                                   f"beyond the paper {sorted(set(seen) - expected)}")


def test_the_parsers_read_what_the_table_writes():
    assert numbered("Tables 2-3, 6-9") == [("table", n) for n in (2, 3, 6, 7, 8, 9)]
    assert numbered("Fig. 8, Table 9") == [("figure", 8), ("table", 9)]
    assert numbered("Figs. 4-5, 8-11") == [("figure", n) for n in (4, 5, 8, 9, 10, 11)]
    assert named("claim `adakv_toy`, `adakv_fig4` (see `x`)") == ["adakv_toy", "adakv_fig4", "x"]
