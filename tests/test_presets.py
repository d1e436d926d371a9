"""Experiment presets (kvbench/conf/experiment/*.yaml), checked without running a model: each composes through Hydra's
compose API, every swept method / task / model config exists and builds with the preset's fixed settings (so a
setting one swept method lacks is caught here, not hours into a sweep), the paper methods listed as missing
from kvbench really are, the `report:` block keeps to the schema the report code reads, and every paper preset
has a `_cpu` twin on the embedded model that sweeps the same methods with the same report layout."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "kvbench" / "conf"
if str(REPO) not in sys.path:  # the grouped launcher's plugin (hydra_plugins/) must be importable for composing
    sys.path.insert(0, str(REPO))

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
PAPER_PRESETS = [name for name in EXPERIMENTS if name != "demo" and not name.endswith("_cpu")]
CPU_MODEL = "smollm2_135m"

REPORT_KEYS = {"title", "kind", "x", "series", "panels", "rows", "columns", "categories", "reference", "delta", "note",
               "not_in_kvbench", "efficiency_layout",  # efficiency_layout: a kvbench.figures layout (profiled presets)
               "compare",  # compare: [series, against] pairs compared like each series with the reference
               "length_statistics"}  # the prompts' lengths against the budgets (KeyDiff Tables 7-8, Fig. 18)
KINDS = {"accuracy", "storage_traffic", "math", "claims"}
COLUMNS = {"budget", "subtask", "category", "turn"}
POINT_FIELDS = {"model", "task", "method", "budget", "compress_question", "seq_len"}


@functools.cache
def composed(name: str, overrides: tuple[str, ...] = ()) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"experiment={name}", *overrides], return_hydra_config=True)


def sweep(cfg: DictConfig) -> dict[str, list[str]]:
    """The preset's grid: every `hydra.sweeper.params` key with its values, as Hydra's override parser reads them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    grid = {}
    for key, value in (cfg.hydra.sweeper.params or {}).items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        override = parser.parse_override(f"{key}={text}")
        grid[key] = ([str(v) for v in override.sweep_string_iterator()] if override.is_sweep_override()
                     else [override.get_value_element_as_str()])
    return grid


def choices(cfg: DictConfig, group: str) -> list[str]:
    """The configs of a group a preset's jobs use: the swept ones, else the one the preset composes with."""
    return sweep(cfg).get(group, [cfg.hydra.runtime.choices[group]])


def job_overrides(cfg: DictConfig, group: str, value: str) -> tuple[str, ...]:
    """One job's overrides for `group=value`, with the first value of every other swept group (their settings
    merge with the preset's own `method:` / `task:` keys the same way)."""
    out = [f"{group}={value}"]
    for other in ("model", "method", "task"):
        if other != group and other in sweep(cfg):
            out.append(f"{other}={sweep(cfg)[other][0]}")
    return tuple(out)


def normalised(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_preset_composes_with_its_results_dir(name):
    cfg = composed(name)
    assert cfg.hydra.runtime.choices.experiment == name
    if name == "demo":  # the README's `make demo` writes under results/
        return
    assert cfg.results_dir and str(cfg.results_dir).startswith("results/"), cfg.results_dir
    if name.endswith("_cpu"):
        assert cfg.results_dir == f"results/{name}", "a twin writes into results/<its name>"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_swept_configs_exist_and_build_with_the_presets_settings(name):
    from hydra.utils import instantiate

    from kvbench.methods import build_method

    cfg = composed(name)
    for group in ("model", "method", "task"):
        for value in choices(cfg, group):
            assert (CONF / group / f"{value}.yaml").is_file(), f"{name} sweeps {group}={value}, not in kvbench/conf/{group}"
    for value in choices(cfg, "method"):
        job = composed(name, job_overrides(cfg, "method", value))
        params = {k: v for k, v in OmegaConf.to_container(job.method, resolve=True).items() if k != "name"}
        build_method(job.method.name, **params)  # KVBenchError names a setting this method lacks
    for value in choices(cfg, "task"):
        job = composed(name, job_overrides(cfg, "task", value))
        instantiate(job.task)  # TypeError names a task setting this task lacks (no data is read here)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_methods_named_missing_from_kvbench_are_missing(name):
    from kvbench.methods import METHODS

    report = composed(name).get("report") or {}
    known = {normalised(p.stem) for p in (CONF / "method").glob("*.yaml")} | {normalised(m) for m in METHODS}
    for missing in report.get("not_in_kvbench") or []:
        assert isinstance(missing, str) and missing.strip()
        assert normalised(missing) not in known, f"{missing} is in kvbench: sweep it instead"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_report_block_keeps_to_the_schema(name):
    cfg = composed(name)
    if name == "demo":
        return
    assert cfg.get("report") is not None, f"{name} has no report block"
    report: dict[str, Any] = OmegaConf.to_container(cfg.report, resolve=True)
    assert set(report) <= REPORT_KEYS, f"keys outside the schema: {set(report) - REPORT_KEYS}"
    if report.get("efficiency_layout") is not None:
        from kvbench.reporting.efficiency import LAYOUTS

        assert cfg.get("profile") and report["efficiency_layout"] in LAYOUTS
    assert isinstance(report.get("title"), str) and report["title"].strip(), "report.title is required"
    if report.get("kind") == "claims":  # `kvbench analyze` verdicts: no point layout (tests/test_analysis.py)
        assert set(report) == {"title", "kind"} and cfg.get("claims")
        return
    swept_params = {k for k in sweep(cfg) if k.startswith(("method.", "task."))}
    fields = POINT_FIELDS | swept_params
    assert report.get("kind", "accuracy") in KINDS
    assert report.get("columns", "budget") in COLUMNS
    for key in ("x", "series"):
        assert report.get(key, "budget" if key == "x" else "method") in fields, f"report.{key}"
    for key in ("panels", "rows"):
        value = report.get(key) or []
        assert isinstance(value, list) and set(value) <= fields, f"report.{key}: {value} (point fields: {fields})"
    assert isinstance(report.get("delta", False), bool)
    categories = report.get("categories")
    if report.get("columns") == "category":
        assert isinstance(categories, dict) and categories, "columns: category needs report.categories"
        for subtasks in categories.values():
            assert isinstance(subtasks, list) and all(isinstance(s, str) and s for s in subtasks)
    else:
        assert categories is None, "report.categories is read only with columns: category"
    swept = {OmegaConf.load(CONF / "method" / f"{m}.yaml").get("name", m) for m in choices(cfg, "method")}
    reference = report.get("reference")
    if reference is not None:
        assert reference in swept, f"the reference {reference} is not swept"
    for pair in report.get("compare", []):
        assert isinstance(pair, list) and len(pair) == 2 and set(pair) <= swept, f"report.compare: {pair} not swept"
    assert isinstance(report.get("not_in_kvbench", []), list)


def test_the_schema_is_the_report_codes():
    import dataclasses

    from kvbench.reporting import paper_tables as paper_report

    assert REPORT_KEYS <= {f.name for f in dataclasses.fields(paper_report.ReportSpec)}


def test_longbench_categories_name_the_subtasks_records_carry():
    from kvbench.tasks import infinitebench
    from kvbench.tasks.longbench_metrics import ALL_SUBSETS

    records_name = {f"longbench_{subset}" for subset in ALL_SUBSETS}
    records_name |= {f"infinitebench_{subset}" for subset in infinitebench.ALL_SUBSETS}
    for name in PAPER_PRESETS:
        report = composed(name).get("report") or {}
        for subtasks in (report.get("categories") or {}).values():
            assert set(subtasks) <= records_name, f"{name}: {set(subtasks) - records_name}"


@pytest.mark.parametrize("name", PAPER_PRESETS)
def test_every_paper_preset_has_a_cpu_twin(name):
    twin = f"{name}_cpu"
    assert twin in EXPERIMENTS, f"{name} has no {twin}"
    cfg, twin_cfg = composed(name), composed(twin)
    assert twin_cfg.model.name == CPU_MODEL and choices(twin_cfg, "model") == [CPU_MODEL]
    if cfg.get("profile"):  # efficiency twins may leave a method out (omnikv_fig4_cpu: no host offload on CPU)
        assert set(choices(twin_cfg, "method")) <= set(choices(cfg, "method"))
    else:
        assert sorted(choices(twin_cfg, "method")) == sorted(choices(cfg, "method"))
    assert twin_cfg.get("profile", False) == cfg.get("profile", False)
    main_report, twin_report = cfg.get("report"), twin_cfg.get("report")
    assert (main_report is None) == (twin_report is None)
    if main_report is not None:
        main_report, twin_report = (OmegaConf.to_container(r, resolve=True) for r in (main_report, twin_report))
        assert "CPU twin" in twin_report["title"], "the twin's title says what stands in for the paper's data"
        # the layout is the paper's; only the title, the categories of a substituted benchmark and the note on
        # what the twin's own records show may differ
        for key in REPORT_KEYS - {"title", "categories", "note"}:
            assert twin_report.get(key) == main_report.get(key), f"report.{key} differs in {twin}"
        assert ("categories" in twin_report) == ("categories" in main_report)


@pytest.mark.parametrize("variant", sorted(p.stem for p in (CONF / "method").glob("*.yaml")))
def test_method_configs_build_under_their_methods_name(variant):
    """A variant (snapkv_head, h2o_block, ...) is its base method with settings, so records and reports group it
    under the method it runs."""
    from hydra import compose, initialize_config_dir

    from kvbench.methods import METHODS, build_method

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"method={variant}"])
    assert cfg.method.name in METHODS and (variant == cfg.method.name or variant.startswith(cfg.method.name + "_"))
    build_method(cfg.method.name, **{k: v for k, v in OmegaConf.to_container(cfg.method, resolve=True).items() if k != "name"})
