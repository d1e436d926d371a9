"""Where the Hydra config tree lives and what it offers: config groups and their choices, presets, composition."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import kvbench.conf

CONF_DIR = str(Path(kvbench.conf.__file__).parent)


GROUPS = ("model", "method", "task", "experiment", "logger")


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


def _settings(group: str, name: str) -> list[str]:
    return [k for k in OmegaConf.load(Path(CONF_DIR) / group / f"{name}.yaml") if k not in ("name", "defaults")]


def _default_choice(group: str) -> str:
    for entry in OmegaConf.load(Path(CONF_DIR) / "config.yaml").defaults:
        if isinstance(entry, DictConfig) and group in entry:
            return entry[group]
    raise KeyError(group)


def experiments() -> list[str]:
    """The experiment presets (conf/experiment/*.yaml)."""
    from kvbench.config.paths import CONF_DIR

    return sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))


def experiment_config(name: str, overrides: Sequence[str] = ()) -> Any:
    """Experiment preset `name` composed as a sweep would compose it, Hydra's own config (the sweep grid in
    ``hydra.sweeper.params``) included."""
    from hydra import compose, initialize_config_dir

    from kvbench.config.paths import CONF_DIR
    from kvbench.core.errors import KVBenchError

    if name not in experiments():
        raise KVBenchError(f"unknown experiment {name!r}; available: {', '.join(experiments())}")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[f"experiment={name}", *overrides], return_hydra_config=True)
