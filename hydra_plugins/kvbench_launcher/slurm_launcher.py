"""Registers `hydra/launcher=kvbench_slurm` (the base of kvbench/conf/hydra/launcher/slurm.yaml: SLURM array tasks that
may each run several points decoded together; `_slurm`) where hydra-submitit-launcher is installed
(`pip install 'kvbench[slurm]'`). Without it nothing is registered and no plugin warning is printed: only a
SLURM sweep needs it, and its command says so."""

from hydra.core.config_store import ConfigStore

try:
    from hydra_plugins.kvbench_launcher._slurm import GroupedSlurmLauncher, KVBenchSlurmConf
except ImportError:  # no hydra-submitit-launcher
    pass
else:
    __all__ = ["GroupedSlurmLauncher"]  # found by Hydra's plugin scan here
    ConfigStore.instance().store(group="hydra/launcher", name="kvbench_slurm", node=KVBenchSlurmConf,
                                 provider="kvbench")
