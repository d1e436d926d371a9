"""`hydra/launcher=grouped` (kvbench's default for local multiruns): the basic local launcher, plus grouped
decoding across sweep points.

Hydra requires launchers to live in the `hydra_plugins` namespace package; the work is `kvbench.cli`'s.
Before running the jobs one by one exactly as Hydra's basic launcher does, the launcher groups the points
that share a model, a task's samples and engine settings (`kvbench.run.group.group_key`) and records their samples
together (`kvbench.run.group.run_grouped`): one dense prefill per prompt, each point's compression, one batched
decode. Each job then finds its samples recorded (the ordinary resume path) and writes its summary, config
and callbacks as usual. `hydra.launcher.max_group` bounds the points decoded together; 1 turns grouping off.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class GroupedLauncherConf:
    _target_: str = "hydra_plugins.kvbench_launcher.grouped_launcher.GroupedLauncher"
    max_group: int = 32  # sweep points decoded together at most (1: every point alone)


ConfigStore.instance().store(group="hydra/launcher", name="grouped", node=GroupedLauncherConf, provider="kvbench")


class GroupedLauncher(Launcher):
    def __init__(self, max_group: int = 32) -> None:
        self.max_group = max_group
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.task_function, self.hydra_context = config, task_function, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from kvbench.results.sweeps import note_point
        from kvbench.run.group import group_key
        from kvbench.run.progress import SweepEstimate

        setup_globals()
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs locally")
        configs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(config):
                config.hydra.job.id = idx
                config.hydra.job.num = idx
            configs.append((idx, overrides, config))
        if self.max_group > 1:
            groups: dict[str, list[tuple[DictConfig, Path]]] = {}
            for _, _, config in configs:
                key = group_key(config)
                if key is not None:
                    groups.setdefault(key, []).append((config, job_dir(config)))
            shared = [members for members in groups.values() if len(members) > 1]
            estimate = SweepEstimate(len(shared))
            if shared:
                console_logging(self.config)
            for members in shared:
                for config, directory in members:  # noted now, so a sweep stopped in its grouped phase (Ctrl-C)
                    note_point(Path(str(config.hydra.sweep.dir)), directory)  # prints what it has recorded
                record_group(members, self.max_group)
                estimate.group_done()
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        runs: list[JobReturn] = []
        for idx, overrides, config in configs:
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            runs.append(run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=config,
                                job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir"))
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs


def console_logging(config: DictConfig) -> None:
    """Log as the jobs do (kvbench's logger and level), not as Hydra's own, on the console only: the grouped phase
    belongs to no one job's directory."""
    configure_log(_console_only(config.hydra.job_logging), config.hydra.verbose)


def record_group(members: list[tuple[DictConfig, Path]], max_group: int) -> None:
    """Record the samples of a group's points (their sweep configs and job directories) together: `run_grouped`
    on the configs their jobs' task function would get."""
    from kvbench.run.group import run_grouped

    run_grouped([(_task_config(config), directory) for config, directory in members], max_group)


def _console_only(job_logging: DictConfig) -> DictConfig:
    """A job's logging config without its file handlers: the grouped phase belongs to no one job's directory."""
    logging_cfg = OmegaConf.create(OmegaConf.to_container(job_logging, resolve=False))
    files = [name for name, handler in (logging_cfg.get("handlers") or {}).items()
             if "File" in str(handler.get("class", ""))]
    for name in files:
        del logging_cfg.handlers[name]
    if logging_cfg.get("root") and logging_cfg.root.get("handlers"):
        logging_cfg.root.handlers = [h for h in logging_cfg.root.handlers if h not in files]
    return logging_cfg


def job_dir(config: DictConfig) -> Path:
    """The directory `run_job` will give the job (sweep dir / subdir, resolved with the job's config)."""
    HydraConfig.instance().set_config(config)
    return Path(str(OmegaConf.select(config, "hydra.sweep.dir"))) / str(OmegaConf.select(config, "hydra.sweep.subdir"))


def _task_config(config: DictConfig) -> Any:
    task = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    with open_dict(task):
        del task["hydra"]
    return task
