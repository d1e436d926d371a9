"""`python -m kvbench analyze`: each paper's observations about attention, measured on a model, with a verdict
and the paper's figure (kvbench/analysis/)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvbench.analysis.runner import claims, run_claim
from kvbench.config.command import check_keys, check_results_dir, is_bare_word
from kvbench.config.paths import compose_command_config
from kvbench.config.validate import check_group_overrides, check_shared_settings
from kvbench.core.checks import is_int
from kvbench.core.errors import KVBenchError

EPILOG = """examples:
  python -m kvbench analyze claim=rocketkv_unique_topk task.seq_len=2048 params.rocketkv_unique_topk.k=32
  python -m kvbench analyze experiment=claims_adakv_cpu        (every Ada-KV claim, CPU-sized)
  python -m kvbench analyze claim=ctkvr_query_similarity model=llama3.1_8b_instruct task=ruler_16k num_samples=20

Each claim writes <results_dir>/<claim>/<model>/<task>-<seq_len>-<hash>/: measurements.jsonl (one record per
sample; a rerun resumes), verdict.json (verdict, effect, 95% bootstrap interval, n, the paper's number) and
the figure as PNG and PDF. `kvbench report experiment=claims_<paper>` collects the verdicts into one table."""


def list_claims() -> str:
    rows = [(c.name, f"{c.paper} {c.source}", c.statement) for c in claims().values()]
    width = max(len(r[0]) for r in rows)
    where = max(len(r[1]) for r in rows)
    return "\n".join(f"{name:<{width}}  {source:<{where}}  {statement}" for name, source, statement in rows)


def compose(overrides: Sequence[str]):
    return compose_command_config(overrides, "analyze")


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvbench analyze", description="Measure a paper's observation about attention on a model: records, "
        "a verdict (holds / does_not_hold / inconclusive, with a bootstrap interval) and the paper's figure.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list the claims and exit")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="claim=NAME or experiment=claims_<paper>, then Hydra overrides (model=, task=, "
                             "num_samples=, params.<claim>.<key>=, results_dir=)")
    args = parser.parse_args(list(argv))
    if args.list:
        print(list_claims())
        return 0
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        bare = next((arg for arg in args.overrides if is_bare_word(arg)), None)
        if bare is not None:
            raise KVBenchError(f"'{bare}' is not KEY=VALUE: name a claim as claim=NAME (kvbench analyze --list "
                               f"shows them)")
        check_group_overrides(args.overrides)
        check_keys(args.overrides, "analyze", sections=("engine", "model", "task"))
        # a claim's parameters are free-form (each claim checks its own): params.NAME.KEY=VALUE adds or sets
        cfg = compose([f"++{arg}" if arg.startswith("params.") else arg for arg in args.overrides])
        names = list(cfg.claims) if cfg.claims else [cfg.claim] if cfg.claim else []
        if not names:
            raise KVBenchError("name a claim (claim=NAME) or a claims preset (experiment=claims_<paper>); "
                               "kvbench analyze --list shows the claims")
        check_settings(cfg)
        if "num_samples" in cfg.task:  # the task builds no more than the claims measure
            cfg.task.num_samples = min(int(cfg.task.num_samples), int(cfg.num_samples))
        results = [run_claim(cfg, name) for name in names]
    except KVBenchError as err:
        print(f"kvbench: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(verdict_lines(results))
    return 0


def check_settings(cfg) -> None:
    """The command's own settings (the model's and the task's are checked where they are built), each refused in
    one line naming it rather than a traceback from the first line that reads it."""
    if not is_int(cfg.num_samples) or cfg.num_samples < 1:
        raise KVBenchError(f"num_samples must be a positive number of samples, got {cfg.num_samples!r}")
    check_shared_settings(cfg)
    check_results_dir(cfg.results_dir)


def verdict_lines(results: Sequence[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"{r['claim']} ({r['paper']} {r['source']}): {r['verdict'].upper()}  {r['effect_name']} = "
                     f"{r['effect']:.3g} [{r['ci_low']:.3g}, {r['ci_high']:.3g}], n={r['n']}; paper: "
                     f"{r['paper_number']}\n  -> {r['run_dir']}")
    return "\n".join(lines)
