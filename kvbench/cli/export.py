"""`python -m kvbench.export task=... out=FILE`: write a task's samples as a portable data file.

The samples are built exactly as `python -m kvbench` builds them for the same overrides: the same Hydra
config (composed from the same config directory), the same seed, and the same model tokenizer and chat
template settings, because synthetic tasks size their haystacks in the evaluated model's tokens. The file
has the `task=custom` layout (see `kvbench.tasks.custom`), so

    python -m kvbench.export model=M task=ruler_niah_single_1 task.seq_len=4096 task.num_samples=50 out=niah.jsonl
    python -m kvbench model=M task=custom task.path=niah.jsonl method=snapkv budget=256

gives the same records as running `task=ruler_niah_single_1` directly, and another harness (kvpress reads the
core columns) can run the identical inputs. The model is loaded only for its tokenizer; exporting for a
different model than the one that will run the file changes the lengths, not the validity.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench.config.command import check_keys, unwritable_folder
from kvbench.config.paths import compose_config
from kvbench.config.validate import check_group_overrides, validate
from kvbench.core.errors import KVBenchError
from kvbench.engine.config import EngineConfig
from kvbench.engine.prompt import PromptBuilder
from kvbench.run.caches import cached_model, seed_everything
from kvbench.tasks.base import DatasetMissingError, build_task
from kvbench.tasks.custom import FORMATS, Custom, write_samples

USAGE = f"""usage: kvbench export [OVERRIDE ...] out=FILE   (or python -m kvbench.export ...)

Write the samples of any task, as `python -m kvbench` would build them with the same overrides, to FILE
({', '.join(FORMATS)}; chosen by extension) in the layout that task=custom and kvpress read.

  OVERRIDE   Hydra overrides of the main config: task=..., task.seq_len=..., task.num_samples=...,
             model=... (its tokenizer measures lengths), seed=..., engine.chat_template=...
  out=FILE   the file to write (replaced atomically)

Example:
  python -m kvbench.export model=llama3.1_8b_instruct task=ruler_niah_single_1 task.seq_len=4096 \\
      task.num_samples=50 out=niah_4k.jsonl
  python -m kvbench model=llama3.1_8b_instruct task=custom task.path=niah_4k.jsonl method=snapkv budget=256
"""


def export(overrides: list[str], out: Path) -> int:
    """Build the samples for `overrides` and write them to `out`; returns the number written."""
    if out.suffix not in FORMATS:
        raise KVBenchError(f"out={out}: unsupported file type {out.suffix!r}; use {', '.join(FORMATS)}")
    _check_writable(out)
    check_group_overrides(overrides)
    check_keys(overrides)
    cfg = compose_config(overrides)
    validate(cfg)  # the settings a run checks (seed, task.num_samples, engine flags, ...), as a run words them
    seed_everything(cfg.seed)
    task = build_task(cfg.task)  # before loading the model: config errors come first
    lm = cached_model(cfg.model)
    engine_cfg = EngineConfig(compress_question=cfg.compress_question, **OmegaConf.to_container(cfg.engine))
    if isinstance(task, Custom) and task.max_positions is None:
        task.max_positions = lm.max_positions
    builder = PromptBuilder(lm.tokenizer, engine_cfg.chat_template, engine_cfg.system_prompt)
    return write_samples(task.samples(builder.measure, seed=cfg.seed), out)


def _check_writable(out: Path) -> None:
    """`out`'s folder (made if missing) takes a file from this process (the write is a temporary file there,
    renamed): checked before the model loads and the samples are built."""
    reason = unwritable_folder(out.parent)
    if reason is not None:
        raise KVBenchError(f"out={out}: cannot write in {out.parent} ({reason}); give a file in a writable folder")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry; returns the exit status (0, or 2 with one `kvbench: error:` line)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE, end="")
        return 0
    outs = [arg.partition("=")[2] for arg in argv if arg.startswith("out=")]
    overrides = [arg for arg in argv if not arg.startswith("out=")]
    try:
        if len(outs) != 1 or not outs[0]:
            raise KVBenchError("give exactly one out=FILE (see --help)")
        flags = [arg for arg in overrides if arg.startswith("-")]
        if flags:
            raise KVBenchError(f"unknown option {flags[0]} (only --help; multirun -m is not supported here)")
        out = Path(outs[0]).expanduser()
        count = export(overrides, out)
    except (KVBenchError, DatasetMissingError) as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (HydraException, OmegaConfBaseException) as exc:
        # A bad override or a task constructor's complaint, in Hydra's multi-line wording: keep it on one line.
        print(f"kvbench: error: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {count} samples to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
