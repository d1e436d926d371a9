"""`python -m kvbench` / `kvbench`: argument checks, then one Hydra job per experiment point (`-m` sweeps)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from kvbench.config.paths import CONF_DIR
from kvbench.config.validate import check_group_overrides, check_settings
from kvbench.core.errors import KVBenchError
from kvbench.run.point import run_point


def _expose_launcher_plugin() -> None:
    """Make `hydra/launcher=grouped` discoverable from an editable checkout too.

    Hydra lists the modules of the `hydra_plugins` namespace package; setuptools' editable finder maps
    `hydra_plugins.kvbench_launcher` for imports but leaves the namespace's listing empty, so the checkout's
    folder is added to it (an installed wheel already puts the plugin there)."""
    import hydra_plugins

    folder = Path(__file__).resolve().parents[2] / "hydra_plugins"
    if (folder / "kvbench_launcher").is_dir() and str(folder) not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(str(folder))


_expose_launcher_plugin()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_entry(cfg: DictConfig) -> None:
    try:
        summary = run_point(cfg)
        if cfg.get("logger") and cfg.logger.name == "wandb":  # one W&B run per point, from its records
            from kvbench.reporting.wandb import log_point  # kvbench.reporting loads matplotlib: only here

            log_point(cfg, summary, Path(summary["run_dir"]))
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def main() -> None:
    if sys.argv[1:2] == ["report"]:  # `kvbench report ...`: tables, figures and HTML from stored records
        from kvbench.cli.report import main as report_main  # pandas, matplotlib: a run does without them

        sys.exit(report_main(sys.argv[2:]))
    try:
        check_group_overrides(sys.argv[1:])
        sys.argv[1:] = check_settings(sys.argv[1:])
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    _hydra_entry()


if __name__ == "__main__":
    main()
