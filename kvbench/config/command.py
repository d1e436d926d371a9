"""The whole command checked before Hydra creates anything: every job of a sweep composed and validated, so a
bad value, an unknown key or an unreachable cluster is one line and no point directory is left behind."""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import inspect
import io
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig

from kvbench.config.paths import GROUPS, compose_config, config_groups
from kvbench.config.validate import check_group_overrides, check_length, check_settings, validate
from kvbench.core.errors import KVBenchError, one_line

# Hydra's flags that print something or point at another config tree: the command is Hydra's to answer.
_HYDRA_INFO_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve", "--package", "-p",
                     "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--shell-completion",
                     "-sc", "--version", "--experimental-rerun")
_MULTIRUN_FLAGS = ("-m", "--multirun")
_SLURM_LAUNCHERS = ("slurm", "slurm_local", "submitit_slurm")
# Hydra's output directories are kvbench's point directories (results_dir/<task>/<model>/<method>/b<budget>-...):
# elsewhere a point is not found again to resume, and a directory reused by another point mixes their records
_POINT_DIRS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")


def is_bare_word(arg: str) -> bool:
    """Whether a command-line argument is neither a flag nor an override (KEY=VALUE, Hydra's ~KEY deletion)."""
    return not arg.startswith(("-", "~")) and "=" not in arg


def check_command(argv: Sequence[str]) -> list[str]:
    """The arguments to hand to Hydra (method settings a sweep shares written as `++method.KEY`), after checking
    every job the command would run; a KVBenchError names the first problem."""
    argv = list(argv)
    check_group_overrides(argv)
    argv = check_settings(argv)
    if any(arg.split("=", 1)[0] in _HYDRA_INFO_FLAGS for arg in argv):
        return argv
    bare = next((arg for arg in argv if is_bare_word(arg)), None)
    if bare is not None:
        raise KVBenchError(f"'{bare}' is not an override: write KEY=VALUE (kvbench --help lists the keys and values)")
    multirun = any(arg in _MULTIRUN_FLAGS for arg in argv)
    if multirun:  # first, as Hydra's parser wants it: `model=x -m method=a,b` split its overrides in two
        argv = ["-m"] + [arg for arg in argv if arg not in _MULTIRUN_FLAGS]
    overrides = [arg for arg in argv if not arg.startswith("-")]
    keys = {_key(arg) for arg in overrides}
    if "budget" in keys and "compression_ratio" in keys:
        raise KVBenchError("budget and compression_ratio both given: they set the same thing (tokens kept); "
                           "give one of them")
    launcher = next((arg.split("=", 1)[1] for arg in overrides if _key(arg) == "hydra/launcher"), None)
    if launcher in _SLURM_LAUNCHERS and not multirun:
        raise KVBenchError(f"hydra/launcher={launcher} submits sweeps: add -m (a single point runs here, "
                           f"without a launcher)")
    if launcher in _SLURM_LAUNCHERS and importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        raise KVBenchError(f"hydra/launcher={launcher} needs hydra-submitit-launcher: pip install 'kvbench[slurm]'")
    moved = next((key for key in map(_key, overrides) if key in _POINT_DIRS), None)
    if moved is not None:
        raise KVBenchError(f"{moved} is kvbench's point directory (results_dir/<task>/<model>/<method>/b<budget>-"
                           "<hash>, by which a point resumes and is never mixed with another): set results_dir=DIR "
                           "instead")
    check_keys(overrides)
    base = _compose(overrides, multirun)
    _check_launcher(base)
    if multirun:
        argv = narrowed_preset_sweeps(argv, base)
        overrides = [arg for arg in argv if not arg.startswith("-")]
    jobs = _jobs(overrides, base) if multirun else [overrides]
    loggers: list[Any] = []
    for job in jobs:
        cfg = _compose(job, multirun=False)
        check_job(cfg, runs_here=launcher not in _SLURM_LAUNCHERS)
        if cfg.logger not in loggers:
            loggers.append(cfg.logger)
    if launcher in _SLURM_LAUNCHERS:
        check_slurm_reachable()
    for logger in loggers:
        check_logger(logger, runs_here=launcher not in _SLURM_LAUNCHERS)
    return argv


def check_job(cfg: DictConfig, runs_here: bool = True) -> None:
    """One composed point: its settings, its method's parameters, its results directory and, when it runs on
    this machine (not on a cluster's node), its device."""
    validate(cfg)
    check_length(cfg)  # against the model config's declared limit: a long model's load is minutes
    from kvbench.methods import build_method, method_parameters

    build_method(cfg.method.name, **method_parameters(cfg.method))
    if runs_here:
        from kvbench.models import resolved_precision
        from kvbench.tasks.base import build_task

        resolved_precision(cfg.model)  # an absent device or unknown dtype, named before its directory exists
        build_task(cfg.task).check()  # e.g. a custom data file that is not there (on this machine)
    check_results_dir(cfg.results_dir)


def check_results_dir(setting: Any) -> None:
    """`results_dir` must be a directory this process can create and write files in (empty or null, a file there,
    a read-only place or /proc are refused before the model loads)."""
    if setting is None or not str(setting).strip():  # a run's `${results_dir}/<point>` would be the root
        raise KVBenchError(f"results_dir must name a directory, got {setting!r}")
    path = Path(str(setting))
    reason = unwritable_folder(path)
    if reason is not None:
        raise KVBenchError(f"results_dir={str(path)!r} cannot hold results: {reason}; give a writable directory "
                           f"(results_dir=PATH)")


def unwritable_folder(path: Path) -> str | None:
    """Why this process cannot write files in the folder `path` (made if missing), or None where it can."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def check_slurm_reachable(timeout: float = 20) -> None:
    """A SLURM controller answers from here, before any job is submitted (not a CalledProcessError later)."""
    advice = ("run the sweep locally (leave out hydra/launcher=slurm), or from a login node of your cluster "
              "(SLURM_CONF pointing at its slurm.conf)")
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        raise KVBenchError(f"SLURM is not reachable from here (no sbatch/sinfo on PATH): {advice}")
    try:
        probe = subprocess.run(["sinfo", "--noheader", "--summarize"], capture_output=True, text=True,
                               timeout=timeout)
    except subprocess.TimeoutExpired:
        raise KVBenchError(f"SLURM is not reachable from here (sinfo gave no answer in {timeout:.0f} s): "
                           f"{advice}") from None
    if probe.returncode != 0:
        said = next((line.strip() for line in probe.stderr.splitlines() if line.strip()), f"exit {probe.returncode}")
        raise KVBenchError(f"SLURM is not reachable from here (sinfo: {said}): {advice}")


WANDB_MODES = ("online", "offline", "disabled")


def check_logger(logger: DictConfig, runs_here: bool = True) -> None:
    """`logger=wandb`: W&B can take the command's points before the first one runs. A point logs after its records
    are written, and a failure there is one warning (the records are safe), but a sweep would meet it at every
    point, each online point first waiting out W&B's init timeout (90 s): so the wandb package must be there, and
    for an online run an API key and, where the points run on this machine, the server answering."""
    if logger.get("name") != "wandb":
        return
    if logger.get("mode") not in (None, *WANDB_MODES):  # W&B would take another word for online
        raise KVBenchError(f"logger.mode must be {', '.join(WANDB_MODES)} (or null: $WANDB_MODE, else online), got "
                           f"{logger.mode!r}")
    if importlib.util.find_spec("wandb") is None:
        raise KVBenchError("logger=wandb needs the wandb package: pip install 'kvbench[wandb]' (or logger=none)")
    try:
        problem = wandb_online_problem(check_server=runs_here, mode=logger.get("mode"))
    except Exception as exc:  # noqa: BLE001 - W&B failing to set up here would fail every point's logging
        problem = f"W&B could not be set up ({one_line(exc)})"
    if problem is not None:
        raise KVBenchError(f"logger=wandb cannot log online from here: {problem}; log to files with "
                           f"logger.mode=offline (then `wandb sync`), or run without W&B (logger=none)")


def wandb_online_problem(check_server: bool = True, mode: str | None = None) -> str | None:
    """Why W&B cannot take an online run from here (no API key, its server not answering), or None: also None when
    the mode (`mode`, else W&B's own setting, $WANDB_MODE) is not online. The server and the key are looked up
    as wandb itself does (its settings: $WANDB_BASE_URL, settings files; `wandb.login` without a prompt)."""
    import wandb  # optional; imported only for logger=wandb or a published report

    settings = wandb.setup().settings
    if (mode or settings.mode) in ("offline", "dryrun", "disabled"):
        return None
    if check_server:
        host = urlparse(settings.base_url)
        try:
            socket.create_connection((host.hostname, host.port or (443 if host.scheme == "https" else 80)),
                                     timeout=5).close()
        except OSError as exc:
            return f"its server {settings.base_url} does not answer ({type(exc).__name__})"
    if not _wandb_has_key(wandb):
        return "no W&B API key (run `wandb login`, or set WANDB_API_KEY)"
    return None


def _wandb_has_key(wandb: Any) -> bool:
    """Whether wandb finds an API key (environment, settings, .netrc), without prompting for one or asking its
    server. `wandb.login(prompt=False)` where wandb has it (it prints what it found: kept quiet), `wandb.api`
    on older releases."""
    if "prompt" not in inspect.signature(wandb.login).parameters:
        return bool(wandb.api.api_key)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return bool(wandb.login(prompt=False, verify=False))


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+~")


def _compose(overrides: Sequence[str], multirun: bool, name: str = "config") -> DictConfig:
    """The config Hydra would compose (`name`: `analyze`, `calibrate` for those commands); a multirun's base
    without its swept values (as Hydra composes it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    # hydra/launcher=grouped composes without importing its module here (kvbench sits below hydra_plugins):
    # Hydra's plugin discovery imports every hydra_plugins module when it initializes, which registers it
    if multirun:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        overrides = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        return compose_config(overrides, return_hydra_config=name == "config", name=name)
    except (HydraException, OmegaConfBaseException) as exc:
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise KVBenchError(first) from None


def check_keys(overrides: Sequence[str], name: str = "config", sections: Sequence[str] = ("engine", "profiler")) -> None:
    """Every key of the command is a setting, `+` or not, or one line names the setting meant: `+budgt=64` would
    otherwise run with the default budget, `engine.batchrows=2` stop at Hydra's bare "Could not override". The
    keys known are those of config `name` (`config`, `analyze`, `calibrate`) as the command's groups compose it
    (a preset may add some, e.g. report); under `sections`, whose settings are fixed, their keys too (a group's
    settings are checked against the chosen config, a preset's report block against its schema)."""
    base = _compose([o for o in overrides if _key(o) in GROUPS and "," not in o], multirun=False, name=name)
    known = sorted({k for k in base if k != "hydra"} | set(config_groups(name)))
    for arg in overrides:
        key = _key(arg)
        top, _, rest = key.partition(".")
        if "=" not in arg or top == "hydra" or key.startswith("hydra/"):
            continue
        if top not in known:
            raise KVBenchError(_unknown(top, known, "top-level settings"))
        setting = rest.split(".")[0]
        if top in sections and setting and isinstance(base.get(top), DictConfig) and setting not in base[top]:
            raise KVBenchError(_unknown(f"{top}.{setting}", [f"{top}.{k}" for k in base[top]], f"{top} settings"))


def _unknown(key: str, known: Sequence[str], what: str) -> str:
    """`unknown setting 'budgt' (did you mean budget?); top-level settings: ...`"""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown setting {key!r}{hint}; {what}: {', '.join(sorted(k.rpartition('.')[2] for k in known))}"


def _check_launcher(base: DictConfig) -> None:
    launcher = base.hydra.launcher
    for key in ("max_group", "array_parallelism", "timeout_min"):
        value = launcher.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise KVBenchError(f"hydra.launcher.{key} must be a positive integer, got {value!r}")


def narrowed_preset_sweeps(argv: Sequence[str], base: DictConfig) -> list[str]:
    """A setting that the preset sweeps, given on the command line, replaces the preset's values, so that each
    point runs once. Hydra's sweeper tells keys apart by their spelling, prefix included: `check_settings` writes
    `method.block_size=64` as `++method.block_size=64` (so that the sweep's base config, composed with the default
    method, takes it), and to the sweeper that is a key of its own beside the preset's `method.block_size:
    64,256`: every job would run twice, the second resuming the first. So a command-line key that a swept key
    spells with another prefix (none, `+` or `++`) takes the preset's spelling, as a sweep: its values as given,
    one value as `choice(V)`. Like the preset's own sweep it stays out of the base config (which has the default
    method, lacking the setting) and sets each job's value (every method the preset sweeps it with has it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    swept = {_key(str(key)): str(key) for key in (base.hydra.sweeper.get("params") or {})}  # bare -> preset's key
    parser = OverridesParser.create()
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        preset_key = swept.get(_key(key)) if sep and not key.startswith(("-", "~")) else None
        if preset_key is not None and preset_key != key:
            sweep = parser.parse_override(f"{key}={value}").is_sweep_override()
            arg = f"{preset_key}={value}" if sweep else f"{preset_key}=choice({value})"
        out.append(arg)
    return out


def _jobs(overrides: Sequence[str], base: DictConfig) -> list[list[str]]:
    """Every job of a multirun, as Hydra's basic sweeper forms them: the preset's `hydra.sweeper.params`, then
    the command line's overrides (swept or not), one job per combination."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params: dict[str, Any] = dict(base.hydra.sweeper.get("params") or {})
    lines = [f"{k}={v}" for k, v in params.items()] + [o for o in overrides if not _key(o).startswith("hydra")]
    parsed = OverridesParser.create().parse_overrides(lines)
    hydra_overrides = [o for o in overrides if _key(o).startswith("hydra")]
    return [job + hydra_overrides for job in BasicSweeper.split_arguments(parsed, None)[0]]
