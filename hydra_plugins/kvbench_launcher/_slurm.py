"""`hydra/launcher=slurm` (kvbench/conf/hydra/launcher/slurm.yaml): hydra-submitit-launcher's SLURM launcher, whose
array tasks may each run several points of the sweep decoded together. (A module Hydra's plugin scan skips, by
its leading underscore: it needs hydra-submitit-launcher, which `slurm_launcher` looks for first.)

With `hydra.launcher.max_group=1` (the default) an array task runs one point, as submitit's launcher does: the
most points at once, each reading the weights and prefilling each prompt for itself. With `max_group=N` the
points that share a model, a task's samples and engine settings (`kvbench.run.group.group_key`, as the local
`grouped` launcher groups them) go N to an array task, which records their samples together
(`kvbench.run.group.run_grouped`: the model loaded once, one dense prefill per prompt, the decode batched where
the decode path allows it) and then runs each point's job, which finds its samples recorded and writes its
summary. Fewer tasks at once, each doing a group's shared work once: which is faster depends on the cluster's
free GPUs; a task's `timeout_min` must then cover its group. A requeued task (time limit, preemption) runs the
same group again and resumes each point at the samples it lacks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides, run_job, setup_globals
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

from hydra_plugins.kvbench_launcher.grouped_launcher import console_logging, job_dir, record_group

log = logging.getLogger(__name__)


@dataclass
class KVBenchSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.kvbench_launcher._slurm.GroupedSlurmLauncher"
    max_group: int = 1  # points of the sweep one array task runs, decoded together (1: a task per point)


# An array task's points: (job index, the job's overrides) each
Members = list[tuple[int, list[str]]]


class GroupedSlurmLauncher(SlurmLauncher):
    """submitit's SLURM launcher whose array tasks are lists of points: `launch` is submitit's, except that it maps
    one call per array task (`_tasks`) where submitit's maps one per job, and `__call__` runs a task's points."""

    def __init__(self, max_group: int = 1, **params: Any) -> None:
        super().__init__(**params)  # the rest are submitit's executor parameters
        self.max_group = max(1, int(max_group))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit  # as submitit's launcher does: plugin discovery stays fast

        assert self.config is not None and self.hydra_context is not None
        executor_params = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            executor_params["slurm_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **executor_params)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{key if key in shared else f"{self._EXECUTOR}_{key}": value
                                      for key, value in self.params.items()
                                      if key not in ("submitit_folder", "max_num_timeout")})
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {self.config.hydra.sweep.dir}")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        tasks = self._tasks(job_overrides, initial_job_idx)
        for members in tasks:
            for idx, overrides in members:
                together = f" (array task of {len(members)} points, decoded together)" if len(members) > 1 else ""
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}{together}")
        state = Singleton.get_state()
        jobs = executor.map_array(self, tasks, ["hydra.sweep.dir"] * len(tasks), [state] * len(tasks))
        returns = {idx: ret for members, job in zip(tasks, jobs)
                   for (idx, _), ret in zip(members, job.results()[0])}
        return [returns[initial_job_idx + n] for n in range(len(job_overrides))]

    def _tasks(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Members]:
        """The sweep's jobs as array tasks: groups of at most `max_group` points with one `group_key`, each
        other point alone, in the order of their first job."""
        from kvbench.run.group import group_key

        jobs = [(initial_job_idx + n, list(overrides)) for n, overrides in enumerate(job_overrides)]
        if self.max_group == 1:
            return [[job] for job in jobs]
        assert self.config is not None and self.hydra_context is not None
        groups: dict[Any, Members] = {}
        for idx, overrides in jobs:
            key = group_key(self.hydra_context.config_loader.load_sweep_config(self.config, overrides))
            groups.setdefault(key if key is not None else ("alone", idx), []).append((idx, overrides))
        return [members[start:start + self.max_group] for members in groups.values()
                for start in range(0, len(members), self.max_group)]

    def __call__(self, members: Members, job_dir_key: str, singleton_state: dict[type, Singleton]) -> list[JobReturn]:
        """One array task, on its node: its points' samples recorded together (more than one point), then each
        point's job as submitit's launcher runs it (which finds them recorded, or runs the point alone)."""
        import submitit

        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        Singleton.set_state(singleton_state)
        setup_globals()
        configs = []
        for idx, overrides in members:
            config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(config.hydra.job):
                config.hydra.job.id = submitit.JobEnvironment().job_id
                config.hydra.job.num = idx
            configs.append(config)
        if len(configs) > 1:
            console_logging(self.config)
            record_group([(config, job_dir(config)) for config in configs], self.max_group)
        return [run_job(hydra_context=self.hydra_context, task_function=self.task_function, config=config,
                        job_dir_key=job_dir_key, job_subdir_key="hydra.sweep.subdir") for config in configs]
