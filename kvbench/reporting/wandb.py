"""Weights & Biases: each point as one W&B run (`logger=wandb`), and a preset's report as a W&B report.

The run directories stay the source of truth: a point is logged after its records are written, from them,
so a resumed or re-run point logs the same numbers again (to the same W&B run id, derived from the point
hash), and reports never read W&B back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench.config.command import wandb_online_problem
from kvbench.results.collect import collect

# Summary metrics logged per point (means over its samples), where the summary has them.
SUMMARY_METRICS = ("nll", "kept_tokens_mean", "kv_bytes_after_prefill", "kv_bytes_end", "prefill_s",
                   "decode_ms_per_token", "storage_ratio_bytes", "decode_read_bytes_per_step", "wall_s")


def _group(cfg: DictConfig) -> str:
    if cfg.logger.get("group"):
        return str(cfg.logger.group)
    try:
        from hydra.core.hydra_config import HydraConfig

        experiment = HydraConfig.get().runtime.choices.get("experiment")
    except ValueError:  # not inside a Hydra job
        experiment = None
    return str(experiment) if experiment and experiment != "null" else Path(str(cfg.results_dir)).name


def log_point(cfg: DictConfig, summary: dict[str, Any], run_dir: Path) -> None:
    """Log one finished point: resolved config, per-sample records (a table), summary metrics and profile."""
    import wandb  # optional, and slow to import: only a logger=wandb point needs it

    lcfg = cfg.logger
    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("logger", None)
    records = collect(run_dir)
    run = wandb.init(project=lcfg.project, entity=lcfg.get("entity"), group=_group(cfg), job_type="point",
                     name=os.path.relpath(run_dir, str(cfg.results_dir)),
                     id=f"{summary['point_hash']}", resume="allow", config=config, tags=list(lcfg.get("tags") or []),
                     mode=lcfg.get("mode") or None, dir=str(lcfg.get("dir") or cfg.results_dir), reinit="create_new")
    try:
        table = records.drop(columns=[c for c in ("run_dir",) if c in records.columns])
        run.log({"records": wandb.Table(dataframe=table.astype(object).where(table.notna(), None))})
        ci = summary.get("score_ci") or (None, None)
        values: dict[str, Any] = {"score": summary.get("score"), "score_ci_low": ci[0], "score_ci_high": ci[1],
                                  "n_samples": summary.get("n_samples"), **summary.get("point", {})}
        values.update({k: v for k, v in summary.get("metrics", {}).items() if k in SUMMARY_METRICS})
        for column in records.columns:  # profile fields are nested in records: medians over samples
            if column.startswith(("profile.", "roofline.")) and records[column].dtype.kind in "if":
                values[column] = float(records[column].median())
        values.update({f"task/{name}": t["score"] for name, t in summary.get("tasks", {}).items()})
        run.summary.update({k: v for k, v in values.items() if v is not None})
    finally:
        run.finish()


def publish_report(result: dict[str, Any], project: str, entity: str | None = None) -> str:
    """Build a W&B report with the static report's panels (score vs budget per method from the runs' summaries,
    the main table as markdown, NIAH and efficiency panels where the static report has them); one line back."""
    out_dir = result["out_dir"]
    try:
        reason = wandb_online_problem(mode="online")
    except Exception as err:  # noqa: BLE001 - any failure here means: not published
        reason = f"W&B unavailable ({err})"
    if reason is not None:
        return f"W&B report not published: {reason}; the static report is {out_dir / 'index.html'}"
    try:
        import wandb_workspaces.reports.v2 as wr
    except ImportError:
        return f"W&B report not published: pip install wandb-workspaces; the static report is {out_dir / 'index.html'}"
    source, spec = result["source"], result["source"].spec
    runset = wr.Runset(project=project, entity=entity or "", name=source.name,
                       filters=f"Config('results_dir') == '{source.root}'")
    panels = [wr.LinePlot(title=f"score vs {spec.x}", x=f"config.{spec.x}", y=["summary.score"],
                          groupby=f"config.{spec.series}.name")]
    if "efficiency" in result["figures"]:
        panels += [wr.BarPlot(title="decode ms/token", metrics=["profile.decode_ms_median"],
                              groupby=f"config.{spec.series}.name")]
    blocks = [wr.H1(text=spec.title),
              wr.P(text=f"From kvbench records under {source.root}; missing points: {len(result['missing'])}."),
              wr.PanelGrid(runsets=[runset], panels=panels),
              wr.MarkdownBlock(text=(out_dir / "table.md").read_text())]
    report = wr.Report(project=project, entity=entity or "", title=spec.title, blocks=blocks)
    try:
        report.save()
    except Exception as err:  # noqa: BLE001 - network or permission problems: the static report stands
        return f"W&B report not published: {err}; the static report is {out_dir / 'index.html'}"
    return f"W&B report: {report.url}"
