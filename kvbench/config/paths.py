"""Where the Hydra config tree lives and what it offers: config groups and their choices, presets, composition.

The one place that lists kvbench/conf/<group>/*.yaml, reads a choice's file (its settings, its `defaults:` parent) and
composes configs outside a Hydra job; everything else asks here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import kvbench.conf
from kvbench.core.errors import KVBenchError

CONF_DIR = str(Path(kvbench.conf.__file__).parent)


GROUPS = ("model", "method", "task", "experiment", "logger")


# The groups a point is composed from: their options can be set one by one (`method.window=64`), and the
# choice a sweep named is what a report shows.
POINT_GROUPS = ("model", "method", "task")


def choices(group: str) -> list[str]:
    """The configs of `group` (kvbench/conf/<group>/*.yaml), by name."""
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


def choice_file(group: str, name: str) -> Path:
    return Path(CONF_DIR) / group / f"{name}.yaml"


def _load(group: str, name: str) -> Any:
    return OmegaConf.load(choice_file(group, name))


def settings(group: str, name: str) -> list[str]:
    """The settings a choice sets, those it inherits from its `defaults:` parents included."""
    cfg = _load(group, name)
    own = [k for k in cfg if k not in ("name", "defaults")]
    parent = _parent(cfg)
    return own + [k for k in settings(group, parent) if k not in own] if parent else own


def _parent(cfg: Any) -> str | None:
    """The config a variant builds on: the first plain entry of its `defaults:` list (`snapkv_head` -> snapkv)."""
    bases = [d for d in cfg.get("defaults", []) if isinstance(d, str) and d != "_self_"]
    return bases[0] if bases else None


def choice_name(group: str, name: str) -> str:
    """The `name` a choice's config gives, through its `defaults:` parents (`method=snapkv_head` is snapkv);
    `name` itself where there is no such file or none of them names one."""
    if not choice_file(group, name).exists():
        return name
    cfg = _load(group, name)
    if "name" in cfg:
        return str(cfg.name)
    parent = _parent(cfg)
    return choice_name(group, parent) if parent else name


def config_groups(name: str = "config") -> list[str]:
    """The groups config `name` (`config`, `analyze`, `calibrate`) is composed from: its `defaults:` list."""
    entries = OmegaConf.load(Path(CONF_DIR) / f"{name}.yaml").defaults
    return [group for entry in entries if isinstance(entry, DictConfig) for group in entry if "/" not in group]


def default_choice(group: str) -> str:
    """The choice of `group` that config.yaml composes by default."""
    for entry in OmegaConf.load(Path(CONF_DIR) / "config.yaml").defaults:
        if isinstance(entry, DictConfig) and group in entry:
            return entry[group]
    raise KeyError(group)


def experiments() -> list[str]:
    """The experiment presets (kvbench/conf/experiment/*.yaml)."""
    return choices("experiment")


def compose_config(overrides: Sequence[str] = (), return_hydra_config: bool = False, name: str = "config") -> Any:
    """The main config (or `name`: `analyze` for `kvbench analyze`) composed with `overrides`, as a run (or, with
    Hydra's own config, a sweep) composes it."""
    from hydra import compose, initialize_config_dir  # only to compose: listing and reading need omegaconf alone

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(name, overrides=list(overrides), return_hydra_config=return_hydra_config)


def compose_command_config(overrides: Sequence[str], name: str) -> Any:
    """`compose_config` for a command of its own (`analyze`, `calibrate`): Hydra's error as one KVBenchError line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose_config(overrides, name=name)
    except (HydraException, OmegaConfBaseException) as err:
        raise KVBenchError(str(err).splitlines()[0]) from None


def experiment_config(name: str, overrides: Sequence[str] = ()) -> Any:
    """Experiment preset `name` composed as a sweep would compose it, Hydra's own config (the sweep grid in
    ``hydra.sweeper.params``) included."""
    if name not in experiments():
        raise KVBenchError(f"unknown experiment {name!r}; available: {', '.join(experiments())}")
    return compose_config([f"experiment={name}", *overrides], return_hydra_config=True)
