"""A paper's table and figures from stored records: `kvbench report experiment=NAME` (or a results directory).

The layout comes from the preset's ``report:`` block (`ReportSpec`); the numbers only from ``records.jsonl``
files (`kvbench.results.load`). The expected grid is the preset's sweep (``hydra.sweeper.params``): a point of
that grid with no records is shown as "missing" in every table and as a gap in every figure, never as zero.
A point stored under the preset's results_dir whose settings are not those of any grid point (another
sequence length, subtask list, sample count, method setting...) is left out, and the report says so
(`select_points`); no cell ever holds two points (two dtypes or models split the row, or the report refuses).

Written into the output directory (default ``<results_dir>/report``):

- ``table.md``, ``table.csv``, ``table.tex``: the paper's main table (scores x100; rows and columns from the
  spec; missing cells say "missing");
- ``points.csv``: one row per point and subtask (every recorded number behind the table);
- figures as PNG and PDF: ``accuracy`` (score vs budget, one line per method, the reference dashed),
  ``niah_heatmap`` (length x depth per point, NIAH records), ``kept_tokens`` (per-head kept-token
  distributions of head-wise methods), ``efficiency`` (decode latency and peak memory vs budget, profiled
  points), ``storage_traffic`` (RocketKV Table 1);
- ``index.html``: one static page holding all of them (figures embedded);
- ``report.md``: the tables and figure list as markdown.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.config.paths import POINT_GROUPS, choice_name, experiment_config, experiments
from kvbench.core.errors import KVBenchError
from kvbench.reporting.preset_points import expected_identities, norm, sweep_axes
from kvbench.reporting.table import method_labels
from kvbench.results.stats import frame_estimate
from kvbench.results.summary import mean_of_subtasks

log = logging.getLogger(__name__)


MISSING = "missing"  # an expected point without records


ABSENT = "n/a"  # a point that ran but has no value for this cell (a subtask without data)


KINDS = ("accuracy", "storage_traffic", "math", "claims")  # claims: `kvbench analyze` verdicts


COLUMN_KINDS = ("budget", "subtask", "category", "turn")  # turn: a conversation's rounds (paper.rounds_as_subtasks)


# point fields a sweep varies (results.collect.POINT_FIELDS) in a paper's row order, not the record's: the mode
# beside model and task, budget (usually the column axis) last; it orders the row fields a spec leaves out.
# dtype and seed: points differing in them get rows of their own rather than one cell.
IDENTITY = ("model", "task", "compress_question", "seq_len", "dtype", "seed", "method", "budget")


@dataclasses.dataclass(frozen=True)
class ReportSpec:
    """How a preset's records are laid out: the ``report:`` block of kvbench/conf/experiment/NAME.yaml."""

    title: str
    kind: str = "accuracy"
    x: str = "budget"
    series: str = "method"
    panels: tuple[str, ...] = ("model", "task")
    rows: tuple[str, ...] = ("model", "task", "compress_question", "method")
    columns: str = "budget"
    categories: Mapping[str, Sequence[str]] | None = None
    reference: str = "full"
    delta: bool = False
    not_in_kvbench: tuple[str, ...] = ()
    efficiency_layout: str | None = None  # a `kvbench.figures` layout drawn from the profiled records
    note: str | None = None  # how to read the table, printed under it (the sweep's table) and in the report
    # paired comparisons besides every series against `reference`: [series, against] (Ada-KV against SnapKV)
    compare: tuple[tuple[str, str], ...] = ()
    # the data set's prompt lengths against the sweep's budgets, from its records (KeyDiff Tables 7-8, Fig. 18)
    length_statistics: bool = False

    @classmethod
    def from_block(cls, block: Mapping[str, Any] | None, default_title: str) -> ReportSpec:
        block = dict(block or {})
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(block) - fields)
        if unknown:
            raise KVBenchError(f"report block: unknown keys {unknown}; keys are {sorted(fields)}")
        block.setdefault("title", default_title)
        for key in ("panels", "rows", "not_in_kvbench"):
            if key in block:
                value = block[key]
                block[key] = tuple([value] if isinstance(value, str) else (value or ()))
        if "compare" in block:
            pairs = block["compare"] or ()
            if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
                raise KVBenchError(f"report.compare: a list of [series, against] pairs, got {pairs!r}")
            block["compare"] = tuple((str(a), str(b)) for a, b in pairs)
        if block.get("categories") is not None:
            block["categories"] = {str(k): list(v) for k, v in dict(block["categories"]).items()}
        spec = cls(**block)
        if spec.kind not in KINDS:
            raise KVBenchError(f"report.kind must be one of {KINDS}, got {spec.kind!r}")
        if spec.columns not in COLUMN_KINDS:
            raise KVBenchError(f"report.columns must be one of {COLUMN_KINDS}, got {spec.columns!r}")
        if spec.columns == "category" and not spec.categories:
            raise KVBenchError("report.columns: category needs report.categories")
        return spec


@dataclasses.dataclass
class Source:
    """What a report is built from: the records' directory, the layout and the expected grid (None: unknown)."""

    name: str
    root: Path
    spec: ReportSpec
    grid: list[dict[str, str]] | None
    identities: list[dict[str, Any]] | None = None  # the grid's points' identities, flattened; None: take any


def _one_line(err: Exception) -> str:
    """A Hydra or OmegaConf error in one line: its first, plus the options Hydra lists for a missing choice."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    if "Could not override" in text:
        text += " (not a setting of the preset's config)"
    start = next((i for i, line in enumerate(lines) if line.startswith("Available options")), None)
    if start is not None:
        options = [line for line in lines[start + 1:] if not line.startswith(("Config search path", "provider="))]
        text += f" (available: {', '.join(options)})"
    return text


def resolve(source: str | Path, overrides: Sequence[str] = ()) -> Source:
    """`experiment=NAME` / `NAME` (a preset) or a results directory."""
    text = str(source)
    preset = text.startswith("experiment=")
    name = text.split("=", 1)[1] if preset else text
    if not preset and Path(text).is_dir():
        if overrides:
            raise KVBenchError(f"{' '.join(overrides)}: KEY=VALUE overrides apply to experiment=NAME, not to a "
                               f"results directory")
        root = Path(text)
        return Source(root.name, root, ReportSpec(title=f"results in {root.resolve().name}"), None)  # no path in titles
    if not preset and name not in experiments():
        raise KVBenchError(f"results directory {text} does not exist" + (
            "" if "/" in text or text.startswith(".") else f" (nor is {text!r} an experiment; experiments: "
                                                           f"{', '.join(experiments())})"))
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        # the sweep's own overrides: sweeps (budget=64,128) and single values of a swept key replace the
        # preset's axes; every override but a sweep also composes
        parsed = list(zip(overrides, OverridesParser.create().parse_overrides(list(overrides))))
        # a method setting composes in its `++` form, as a run's does (`config.validate.check_settings`): the
        # preset's base method need not have it
        fixed = [f"++{arg}" if arg.startswith("method.") else arg for arg, o in parsed if not o.is_sweep_override()]
        cfg = experiment_config(name, fixed)
        block = OmegaConf.to_container(cfg.report, resolve=True) if "report" in cfg else None
        params = (OmegaConf.to_container(cfg.hydra.sweeper.params, resolve=True) if cfg.hydra.sweeper.get("params")
                  else {})
        for arg, o in parsed:
            key = o.get_key_element().lstrip("+~")
            if o.is_sweep_override() or key in params:
                params[key] = arg.split("=", 1)[1]
        # every grid point's fields: POINT_FIELDS less seq_len (a grid has it only as a swept task.seq_len)
        base = {"model": cfg.model.name, "task": cfg.task.name, "method": cfg.method.name, "budget": cfg.budget,
                "compress_question": cfg.compress_question}
        if block and block.get("kind") == "claims":  # verdicts, not points: no grid of points to expect
            return Source(name, Path(cfg.results_dir), ReportSpec.from_block(block, name), None)
        axes = sweep_axes(params)
        return Source(name, Path(cfg.results_dir), ReportSpec.from_block(block, name), expected_grid(params, base),
                      expected_identities(name, fixed, axes))
    except (HydraException, OmegaConfBaseException) as err:  # a bad override: one line, not a traceback
        raise KVBenchError(f"experiment {name}: {_one_line(err)}") from None


def expected_grid(params: Mapping[str, Any], base: Mapping[str, Any]) -> list[dict[str, str]]:
    """Every point a sweep of `params` makes, as {key: normalised value} over the swept keys plus the base
    identity. A method that takes no budget is one point whatever the budget (its budget is "-")."""
    from kvbench.methods import METHODS  # torch and the kernels: reports otherwise read records without them

    axes = sweep_axes(params)
    grid: dict[tuple, dict[str, str]] = {}
    for combo in itertools.product(*axes.values()):
        point = {k: norm(v) for k, v in base.items()}
        point.update({k: norm(v) for k, v in zip(axes, combo)})
        method = METHODS.get(choice_name("method", point["method"]))
        if method is not None and not method.uses_budget:
            point["budget"] = "-"
        grid[tuple(sorted(point.items()))] = point
    return list(grid.values())


def _point_key(df: pd.DataFrame) -> str:
    """The column naming a point: its hash, or its run directory for records that predate hashes."""
    return "point_hash" if "point_hash" in df.columns and df["point_hash"].notna().all() else "run_dir"


def point_scores(df: pd.DataFrame, shown: Sequence[str] = ()) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(points, subtasks): one row per point with its score (the unweighted mean of its subtask means, x100,
    the RULER/LongBench rule: `mean_of_subtasks`), sample count and the score's 95% interval (``ci_low``,
    ``ci_high``, NaN: none; `kvbench.results.stats`), and one row per point and subtask. Every other column keeps
    the point's first value (identity and config columns are constant within a point). A method's variants
    get names of their own (`method_labels`), but for the settings in `shown` (the grid's swept keys, shown as
    fields of their own: `method.window`, `profile`)."""
    key = _point_key(df)
    numeric = df.assign(score=pd.to_numeric(df["score"], errors="coerce") * 100.0)
    subtasks = numeric.groupby([key, "subtask"], sort=False, dropna=False).agg(
        score=("score", "mean"), n=("sample_id", "size")).reset_index()
    first = numeric.drop(columns=["score", "subtask", "sample_id"]).groupby(key, sort=False).first()
    points = subtasks.groupby(key, sort=False).agg(score=("score", _mean_of_subtasks), n=("n", "sum"))
    points = points.join(first).reset_index()
    estimates = {p: frame_estimate(rows) for p, rows in numeric.groupby(key, sort=False)}  # score's interval
    for bound in ("low", "high"):
        points[f"ci_{bound}"] = [getattr(e, bound) if e is not None and e.has_interval else math.nan
                                 for e in map(estimates.get, points[key])]
    if "decode_read_tokens_per_group" in numeric.columns:  # the equal-traffic axis: the point's mean reads
        reads = pd.to_numeric(numeric["decode_read_tokens_per_group"], errors="coerce").groupby(numeric[key]).mean()
        points["read_tokens"] = points[key].map(reads)
    from kvbench.methods import METHODS  # lazily, as in expected_grid

    points["family"] = points["method"].map(lambda m: METHODS[m].family if m in METHODS else "none")
    for field in POINT_GROUPS:  # the config name a sweep used (a method variant's own name)
        if f"choice.{field}" in points.columns:
            points[field] = points[f"choice.{field}"].fillna(points[field])
    if len(points):
        settings = [k.split(".", 1)[1] for k in shown if k.startswith("method.")]
        points["method"] = method_labels(points, [*settings, *(["profile"] if "profile" in shown else [])])
    return points, subtasks


def _mean_of_subtasks(scores: pd.Series) -> float:
    """`mean_of_subtasks` over one point's rows of a frame (NaN: no value)."""
    return mean_of_subtasks(scores.dropna(), empty=math.nan)


def _norm_frame(points: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    return pd.DataFrame({k: [norm(v) for v in points[k]] if k in points.columns else "-" for k in keys},
                        index=points.index)


def missing_points(points: pd.DataFrame, grid: list[dict[str, str]] | None) -> list[dict[str, str]]:
    """The expected points (`grid`) that have no records."""
    if not grid:
        return []
    keys = list(grid[0])
    have = set(map(tuple, _norm_frame(points, keys).itertuples(index=False))) if len(points) else set()
    return [p for p in grid if tuple(p[k] for k in keys) not in have]


def _varying(points: pd.DataFrame, grid: list[dict[str, str]] | None, candidates: Sequence[str]) -> list[str]:
    """The candidate columns whose values differ between points (recorded or expected)."""
    out = []
    for column in candidates:
        values = {norm(v) for v in points[column]} if column in points.columns else set()
        values |= {p[column] for p in grid or [] if column in p}
        if column == "budget":  # the reference has no budget; that alone does not make budget a row field
            values.discard("-")
        if len(values) > 1:
            out.append(column)
    return out


def _row_fields(spec: ReportSpec, points: pd.DataFrame, grid: list[dict[str, str]] | None) -> list[str]:
    """The table's row fields: the spec's rows that vary, then every other varying identity field, so two
    points never share a cell. The series field (method) is always a row field."""
    swept = list(grid[0]) if grid else []
    candidates = list(dict.fromkeys([*spec.rows, *IDENTITY, *swept]))
    exclude = {spec.x, f"task.{spec.x}"} if spec.columns == "budget" else set()  # a grid sweeps task.seq_len
    fields = [c for c in _varying(points, grid, candidates) if c not in exclude]
    if spec.series not in fields:
        fields.append(spec.series)
    ordered = [c for c in spec.rows if c in fields] + [c for c in fields if c not in spec.rows]
    return ordered


def _categories_of(subtasks: pd.DataFrame, spec: ReportSpec) -> pd.DataFrame:
    """Per point and category: the mean of its subtasks' scores (absent subtasks are left out), and the weight
    of each subtask in it."""
    rows = []
    key = _point_key(subtasks)
    for category, names in (spec.categories or {}).items():
        part = subtasks[subtasks["subtask"].isin(list(names)) & subtasks["score"].notna()]
        means = part.groupby(key, sort=False)["score"].agg(_mean_of_subtasks).reset_index()
        present = part.groupby(key, sort=False)["subtask"].agg(list)
        means["weights"] = [{name: 1 / len(present[p]) for name in present[p]} for p in means[key]]
        means["subtask"] = category
        rows.append(means)
    return pd.concat(rows, ignore_index=True) if rows else subtasks.iloc[0:0]


def main_table(source: Source, points: pd.DataFrame, subtasks: pd.DataFrame) -> pd.DataFrame:
    """The paper's table: one row per combination of row fields, columns from the spec; cells are floats,
    `MISSING` for expected points without records, `ABSENT` for a value a recorded point lacks, "" where
    the grid has no such point. With `delta`, non-reference rows hold differences from the reference row of
    their group. ``attrs["cells"]``: each valued cell's records, {(row, column): (point, subtask weights)}
    (weights None: the point's subtasks alike), for its interval (`kvbench.reporting.uncertainty`)."""
    spec, grid = source.spec, source.grid
    rows = _row_fields(spec, points, grid)
    key = _point_key(points)
    ident = _norm_frame(points, rows)
    _refuse_shared_cells(points, ident, spec)
    # each cell's records: (point, subtask weights), None weighing the point's subtasks alike (its score)
    sources: dict[tuple[tuple, str], tuple[Any, dict[str, float] | None]] = {}
    if spec.columns == "budget":
        columns = sorted({norm(v) for v in points.get(spec.x, [])} | {_grid_x(p, spec.x) for p in grid or []},
                         key=_sort_key)
        values = {(tuple(r), norm(x)): s for r, x, s in zip(ident.itertuples(index=False), points[spec.x],
                                                               points["score"])}
        sources = {(tuple(r), norm(x)): (p, None) for r, x, p in zip(ident.itertuples(index=False), points[spec.x],
                                                                       points[key])}
    else:
        per = (subtasks.assign(weights=[{str(name): 1.0} for name in subtasks["subtask"]])
               if spec.columns in ("subtask", "turn") else _categories_of(subtasks, spec))
        names = list(dict.fromkeys(per["subtask"]))
        columns = [*names, "avg"]
        row_of = dict(zip(points[key], map(tuple, ident.values)))
        values = {(row_of[p], name): s for p, name, s in zip(per[key], per["subtask"], per["score"])}
        sources = {(row_of[p], name): (p, w) for p, name, w in zip(per[key], per["subtask"], per["weights"])}
        if spec.columns == "category":  # CTKVR's AVG: the mean of the category means
            avg = per.groupby(key, sort=False)["score"].agg(_mean_of_subtasks)
            values.update({(row_of[p], "avg"): v for p, v in avg.items()})
            for p, cats in per.groupby(key, sort=False)["weights"]:
                weights: dict[str, float] = {}
                for category in cats:  # each category weighs 1/C, split among its subtasks
                    for name, w in category.items():
                        weights[name] = weights.get(name, 0.0) + w / len(cats)
                sources[(row_of[p], "avg")] = (p, weights)
        else:
            values.update({(tuple(r), "avg"): s for r, s in zip(ident.itertuples(index=False), points["score"])})
            sources.update({(row_of[p], "avg"): (p, None) for p in points[key]})
    row_ids = list(dict.fromkeys([tuple(r) for r in ident.itertuples(index=False)]
                                 + [tuple(p.get(f, "-") for f in rows) for p in grid or []]))
    expected = {tuple(p.get(f, "-") for f in rows): p for p in grid or []}
    missing = {tuple(p.get(f, "-") for f in rows) + ((_grid_x(p, spec.x),) if spec.columns == "budget" else ())
               for p in missing_points(points, grid)}
    recorded_rows = set(map(tuple, ident.values))
    table = []
    for rid in sorted(row_ids, key=lambda r: _row_sort_key(r, rows, spec)):
        cells: dict[str, Any] = dict(zip(rows, rid))
        for column in columns:
            if (rid, column) in values:
                cells[column] = values[(rid, column)]
            elif spec.columns == "budget":
                if (rid, "-") in values:  # a method without a budget: one value for the whole row
                    cells[column] = values[(rid, "-")]
                    sources[(rid, column)] = sources[(rid, "-")]
                elif rid + (column,) in missing or rid + ("-",) in missing:
                    cells[column] = MISSING
                else:
                    cells[column] = ""
            elif rid in recorded_rows:
                cells[column] = ABSENT
            elif rid in expected:
                cells[column] = MISSING
            else:
                cells[column] = ""
        table.append(cells)
    out = pd.DataFrame(table, columns=[*rows, *[c for c in columns if not (spec.columns == "budget" and c == "-")]])
    if spec.delta:
        out = _as_delta(out, rows, spec)
    value_columns = [c for c in out.columns if c not in rows]
    out.attrs.update(row_fields=rows, value_columns=value_columns,
                     cells={cell: src for cell, src in sources.items() if cell[1] in value_columns})
    return out


def _grid_x(point: dict[str, str], x: str) -> str:
    """A grid point's value of the x axis (a grid names the record's `seq_len` by its sweep key, `task.seq_len`)."""
    return point.get(x, point.get(f"task.{x}", "-"))


def _refuse_shared_cells(points: pd.DataFrame, ident: pd.DataFrame, spec: ReportSpec) -> None:
    """Raise where two points would fill one cell of the table: a cell shows one point, never a mix."""
    cells = ident.copy()
    if spec.columns == "budget":
        cells[spec.x] = [norm(v) for v in points[spec.x]]
    shared = cells.duplicated(keep=False)
    if shared.any():
        first = cells[shared].iloc[0]
        names = points.loc[(cells == first).all(axis=1), _point_key(points)]
        raise KVBenchError(f"points {', '.join(map(str, names))} would share one cell of the table "
                           f"({', '.join(f'{k}={v}' for k, v in first.items())}): they differ only in settings "
                           f"the table does not show (seed? engine settings?); report their directories apart")


def _as_delta(table: pd.DataFrame, rows: list[str], spec: ReportSpec) -> pd.DataFrame:
    group = [r for r in rows if r not in (spec.series, "budget")]
    out = table.copy()
    values = [c for c in table.columns if c not in rows]
    for _, part in table.groupby(group, sort=False) if group else [(None, table)]:
        ref = part[part[spec.series] == spec.reference]
        if ref.empty:
            continue
        for index in part.index:
            if out.at[index, spec.series] == spec.reference:
                continue
            for column in values:
                mine, base = table.at[index, column], ref.iloc[0][column]
                if isinstance(mine, float) and isinstance(base, float):
                    out.at[index, column] = mine - base
    return out


def _sort_key(value: str) -> tuple:
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def _row_sort_key(row: tuple, fields: list[str], spec: ReportSpec) -> tuple:
    keys = []
    for field, value in zip(fields, row):
        if field == spec.series:  # the reference first, then methods in name order
            keys.append((0 if value == spec.reference else 1, 0.0, value))
        else:
            keys.append(_sort_key(value))
    return tuple(keys)


def storage_traffic_table(points: pd.DataFrame) -> pd.DataFrame:
    """RocketKV Table 1 from the records: compression, storage (the paper's convention and true bytes) and
    decode traffic, each relative to the full cache of the same prompt."""
    compression = (pd.to_numeric(points.get("compressed_segment_tokens"), errors="coerce")
                   / pd.to_numeric(points.get("budget_tokens"), errors="coerce"))
    if "compressed" in points.columns:  # the full cache, or a budget at or above the prompt: c = 1
        compression = compression.where(points["compressed"].fillna(False).astype(bool), 1.0)
    out = pd.DataFrame({
        "method": points["method"], "budget": points["budget"], "compression": compression,
        "storage_table1": pd.to_numeric(points.get("storage_ratio_table1"), errors="coerce"),
        "storage_bytes": pd.to_numeric(points.get("storage_ratio_bytes"), errors="coerce"),
        "traffic": pd.to_numeric(points.get("decode_read_bytes_per_step"), errors="coerce")
        / pd.to_numeric(points.get("kv_bytes_full_prompt"), errors="coerce"),
    })
    return out.sort_values(["method", "budget"], key=lambda s: s.map(norm).map(_sort_key)).reset_index(drop=True)
