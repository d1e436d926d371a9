"""`python -m kvbench` / `kvbench`: argument checks, then one Hydra job per experiment point (`-m` sweeps)."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kvbench.config.command import check_command, is_bare_word
from kvbench.config.paths import CONF_DIR
from kvbench.core.errors import KVBenchError
from kvbench.run.point import run_point

log = logging.getLogger("kvbench")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _hydra_entry(cfg: DictConfig) -> None:
    try:
        summary = run_point(cfg)
        if cfg.get("logger") and cfg.logger.name == "wandb":  # one W&B run per point, from its records
            _log_to_wandb(cfg, summary)
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr, flush=True)
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # this point only: the sweep's other jobs still run
            raise PointFailed(str(exc)) from None
        sys.exit(2)


class PointFailed(RuntimeError):
    """A sweep's point stopped by an error kvbench names in one line (printed when it happened): Hydra marks its
    job failed, runs the others, and ends the sweep with this error and a non-zero exit status, as for any
    job's exception (an exit here would end the whole sweep at this point, its later jobs never run)."""


def _log_to_wandb(cfg: DictConfig, summary: dict) -> None:
    """Log a finished point to W&B; where W&B cannot be reached, say so in one line and let the sweep go on:
    the records are on disk and a later run of the same command logs them (same W&B run id)."""
    from kvbench.reporting.wandb import log_point  # kvbench.reporting loads matplotlib: only here

    try:
        log_point(cfg, summary, Path(summary["run_dir"]))
    except Exception as exc:  # noqa: BLE001 - W&B's errors are many (network, auth, service); the point is done
        said = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        log.warning("W&B logging failed (%s); the records are safe in %s. Log offline with logger.mode=offline "
                    "(then `wandb sync`), or rerun the command once W&B is reachable", said, summary["run_dir"])


# `kvbench NAME ...`: the commands beside a run, each a module of kvbench.cli with `main(argv) -> exit status`
# (imported when named: pandas and matplotlib stay out of a run). `profile` is a run with profile=true.
COMMANDS = {
    "report": "tables, figures and an HTML page from stored records",
    "analyze": "the papers' observations about attention, measured with a verdict",
    "calibrate": "what a method needs before it runs (DuoAttention's gates)",
    "export": "a task's samples as a JSONL file (bring-your-own data's layout)",
    "figures": "a paper's efficiency figure and table from profiled points",
    "profile": "a run with profile=true (latency and memory of each stage)",
}


def with_profile(argv: list[str]) -> list[str]:
    """A run's arguments with profile=true (`kvbench profile ...`), unless they set profile themselves."""
    if any(arg.startswith(("profile=", "+profile=", "++profile=")) for arg in argv):
        return list(argv)
    return [*argv, "profile=true"]


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "profile":
        sys.argv[1:] = with_profile(sys.argv[2:])
    elif command in COMMANDS:
        module = importlib.import_module(f"kvbench.cli.{command}")
        sys.exit(module.main(sys.argv[2:]))
    elif command and is_bare_word(command):
        commands = ", ".join(COMMANDS)
        print(f"kvbench: error: unknown command '{command}' (commands: {commands}; a run takes overrides "
              f"KEY=VALUE: kvbench --help)", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        sys.argv[1:] = check_command(sys.argv[1:])
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        _hydra_entry()
    except KeyboardInterrupt:  # the records written so far are complete; a rerun resumes after them
        print(f"\n{INTERRUPTED}", file=sys.stderr, flush=True)
        sys.exit(130)


INTERRUPTED = "kvbench: interrupted: rerun the same command to resume (recorded samples are kept, none is run twice)"


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C: KeyboardInterrupt, as Python's own handler raises it, except inside a finaliser (`__del__`),
    where Python would only print it ("Exception ignored in ...") and go on: there the signal is sent again a
    moment later. A timer ends the process in any case; records are appended whole or repaired on resume, so
    stopping at any point loses nothing."""
    caller = frame
    while caller is not None:
        if caller.f_code.co_name == "__del__":
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            return
        caller = caller.f_back

    def stop() -> None:
        print(f"\n{INTERRUPTED}", file=sys.stderr, flush=True)
        os._exit(130)

    timer = threading.Timer(20, stop)
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
