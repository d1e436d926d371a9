"""Every method's decode step on the static layout: how many graphs it compiles, whether it recompiles or breaks
the graph, and whether its tokens equal the eager path's.

    python scripts/check_static_decode.py                              # tiny Llama + Qwen3, dynamo's eager backend
    python scripts/check_static_decode.py --backend inductor --methods full,quest,adakv
    python scripts/check_static_decode.py --backend inductor --device cuda --models tiny_llama   # Triton's code
    python scripts/check_static_decode.py --lint                       # and what Triton would refuse (CPU)
    TORCH_LOGS=recompiles,graph_breaks python scripts/check_static_decode.py --methods rocketkv

For each model and method: one sample prefilled and compressed as a run does, then `--steps` greedy decode steps
through `Session.step`, eagerly and compiled (`engine.compile`, `torch.compile(fullgraph=True, dynamic=False)`
with `--backend`), from the same compressed cache. Then a second sample of another length in the same capacity
bucket, compiled: it must reuse the graph. Reported per method:

- graphs: graphs compiled over the first sample (1: the whole step is one graph);
- recompiles: graphs compiled after the first compiled step of that sample (must be 0), and over the second
  sample (`2nd`, must be 0: samples of similar length share the graph);
- breaks: a graph break under `fullgraph=True` is an error, named here;
- tokens: whether the greedy tokens equal the eager path's; max |logit| difference over the steps;
- replayed / guarded: the compiled steps that replayed their graph without dynamo (`kvbench.engine.replay`; a
  CUDA graph on CUDA) and those that went through dynamo's guards (at most `GUARDED_CALLS`, three, per graph key,
  so at most 6). Replays are expected only when the sample has more compiled steps than that (`--steps 4` and
  up; 5 for a method whose first step runs eagerly); with fewer, `replayed` reads `-` and a line under the table
  says why;
- stats: whether the decode statistics (layer steps, elements and rows read, recall) and the bytes held equal
  the eager path's;
- path: `compiled`, or `eager` and the reason the method gives (host work at every step).

`--backend eager` (the default; dynamo's tracing only) and `aot_eager` decide graphs, breaks and recompiles as
inductor does, in seconds; inductor also generates the kernels (a minute or more per graph on two cores).
`--lint` compiles with `kvbench.devtools.graph_lint`'s backend instead: each graph after inductor's
decompositions, checked for what Triton's code generation refuses although the CPU's accepts (a method with such
a construct runs compiled on the CPU and falls back to eager on every GPU), then run eagerly; a finding is the
method's error. The exit status is 1 when a method that should run compiled does not (a lint finding
included), recompiles, is not replayed (with steps enough for a replay), or changes a token or a statistic.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

import kvbench.conf
from kvbench.devtools.graph_lint import lint_backend
from kvbench.engine import compiled as compiled_step
from kvbench.engine.replay import GUARDED_CALLS
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.models import load_model

CONF = Path(kvbench.conf.__file__).parent

# (label, method, settings, budget): the list of static methods, then the methods that stay eager
STATIC = [
    ("full", "full", {}, 64),
    ("full_repeated_kv", "full", {"repeat_kv": True}, 64),
    ("streamingllm", "streamingllm", {}, 64),
    ("streamingllm_rolling", "streamingllm", {"decode_every": 1}, 64),
    ("snapkv", "snapkv", {"window": 8}, 64),
    ("snapkv_head", "snapkv", {"window": 8, "granularity": "head"}, 64),
    ("pyramidkv", "pyramidkv", {"window": 8}, 64),
    ("adakv", "adakv", {"window": 8}, 64),
    ("ada_pyramid", "ada_pyramid", {"window": 8}, 64),
    ("h2o", "h2o", {}, 64),
    ("h2o_block", "h2o", {"block_size": 64}, 64),
    ("tova", "tova", {}, 64),
    ("tova_block", "tova", {"block_size": 64}, 64),
    ("keydiff", "keydiff", {}, 64),
    ("keyl2norm", "keyl2norm", {}, 64),
    ("exact_topk", "exact_topk", {}, 64),
    ("quest", "quest", {}, 64),
    ("sparq", "sparq", {}, 64),
    ("hsa", "hsa", {}, 64),
    ("rocketkv", "rocketkv", {"window": 8}, 64),
    # t > 640: RocketKV's rule lets about half the heads retrieve (ragged layers, streaming heads sliding)
    ("duoattention", "duoattention", {"pattern": "{model}"}, 690),
]
EAGER = [
    ("ctkvr", "ctkvr", {}, 64),
    ("magicpig", "magicpig", {}, 64),
    ("shadowkv", "shadowkv", {}, 64),
    ("infllm", "infllm", {}, 64),
    ("retrieval_attention", "retrieval_attention", {}, 64),
    ("omnikv_offload", "omnikv", {"filter_layers": [0], "offload": True}, 64),
]


HEADER = (f"{'method':22} {'path':10} {'graphs':>6} {'recompiles':>10} {'2nd':>4} {'tokens':>7} {'max dlogit':>10} "
          f"{'replayed':>8} {'guarded':>7} {'stats':>6}")


@dataclass
class Outcome:
    label: str
    path: str
    graphs: int = 0
    recompiles: int = 0
    second_sample: int = 0
    tokens_equal: bool = True
    max_logit_diff: float = 0.0
    replayed: int = 0  # steps that replayed their graph without dynamo (kvbench.engine.replay)
    guarded: int = 0  # compiled steps that went through dynamo's guards (the first ones of each loop and key)
    compiled_steps: int = 0  # the first sample's compiled decode steps (a method may run its first step eagerly)
    stats_equal: bool = True  # the decode statistics (rows and elements read, recall) are the eager path's
    error: str = ""

    @property
    def replays_expected(self) -> bool:
        """Whether the sample had steps enough for a replay: a loop replays a graph key's steps after at most
        `GUARDED_CALLS` guarded calls of it (compile, note, compare), so a loop of no more steps replays none."""
        return self.compiled_steps > GUARDED_CALLS

    @property
    def ok(self) -> bool:
        if self.error:
            return False
        # at most GUARDED_CALLS guarded calls per graph key (the evicting and the plain step are two keys), then
        # replays, where the sample has steps enough for them
        replays = (self.replayed > 0 or not self.replays_expected) and self.guarded <= 2 * GUARDED_CALLS
        return self.path.startswith("eager (") or (self.graphs == 1 and self.recompiles == 0 and replays
                                                    and self.second_sample == 0 and self.tokens_equal
                                                    and self.stats_equal)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(10, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode(lm, method, budget: int, ids: list[int], steps: int, decoder) -> tuple[Session, list[int], list[torch.Tensor]]:
    """Prefill and compress `ids`, then `steps` greedy decode steps (with `decoder`: compiled). The session, the
    tokens and the logits of every step."""
    session = Session(lm, method, budget, sequence_length=len(ids) + steps + 1)
    session.measure_recall = method.selects
    logits, _ = session.prefill(ids, compress=True)
    session.decoder = decoder
    tokens, all_logits = [], []
    session.begin_decode(steps)
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = session.step(tokens[-1])
        all_logits.append(logits)
    session.end_decode()
    return session, tokens, all_logits


def decode_statistics(session: Session) -> tuple:
    """What the decode steps read and recalled by the method's own accounting, rounded where the static layout
    sums floats in another order, and the bytes the cache holds."""
    stats = session.cache.stats
    recall = stats.recall_sum / stats.recall_steps if stats.recall_steps else None
    return (stats.layer_steps, stats.read_elements, round(stats.attended_tokens, 3),
            None if recall is None else round(recall, 4), stats.recall_steps, session.cache.kv_bytes())


def method_for(lm, name: str, settings: dict):
    """The method of a table row for model `lm` (a setting may name the model: DuoAttention's pattern)."""
    settings = {k: (v.format(model=lm.name) if isinstance(v, str) else v) for k, v in settings.items()}
    return build_method(name, **settings)


def check(lm, label: str, name: str, settings: dict, budget: int, steps: int, decoder, length: int,
          expect_static: bool) -> Outcome:
    method = method_for(lm, name, settings)
    blocker = method.static_decode_blocker()
    if blocker is not None:
        return Outcome(label, f"eager ({blocker})", error="expected to run compiled" if expect_static else "")
    if not expect_static:
        return Outcome(label, "compiled?", error="expected to name the host work that keeps it eager")
    ids = prompt(length, seed=1)
    eager, eager_tokens, eager_logits = decode(lm, method_for(lm, name, settings), budget, ids, steps, None)
    try:
        session, tokens, logits = decode(lm, method, budget, ids, steps, decoder)
    except Exception as exc:  # noqa: BLE001 - a graph break under fullgraph, reported by name
        return Outcome(label, "compiled", error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}")
    if session.decode_path != "compiled":
        return Outcome(label, "eager?", error=session.decode_path_reason or "did not run compiled")
    outcome = Outcome(label, "compiled", graphs=session.compiles, recompiles=session.compiles - 1,
                      tokens_equal=tokens == eager_tokens,
                      max_logit_diff=max(float((a - b).abs().max()) for a, b in zip(logits, eager_logits)),
                      replayed=session.replayed_steps, guarded=session.static_steps - session.replayed_steps,
                      compiled_steps=session.static_steps,
                      stats_equal=decode_statistics(session) == decode_statistics(eager))
    # another sample, a few tokens shorter: the same capacity bucket, so the same graph
    second, _, _ = decode(lm, method_for(lm, name, settings), budget, prompt(length - 9, seed=2), steps, decoder)
    outcome.second_sample = second.compiles
    return outcome


def not_replayed_note(outcomes: list[Outcome]) -> str:
    """The line under a table whose methods had too few compiled steps for a replay."""
    steps = sorted({o.compiled_steps for o in outcomes})
    return (f"replays not expected for {', '.join(o.label for o in outcomes)}: {' or '.join(map(str, steps))} "
            f"compiled step{'s' if steps != [1] else ''}, and a decode loop replays a graph only after its first "
            f"{GUARDED_CALLS} guarded steps (kvbench.engine.replay.GUARDED_CALLS); --steps {GUARDED_CALLS + 2} or "
            f"more checks the replays")


def main(argv: list[str] | None = None) -> list[Outcome]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny_llama,tiny_qwen3")
    parser.add_argument("--methods", default="all", help="labels from the table (all: every one)")
    parser.add_argument("--backend", default="eager", help="torch.compile backend: eager, aot_eager or inductor")
    parser.add_argument("--lint", action="store_true",
                        help="compile with the graph lint's backend (kvbench.devtools.graph_lint) instead of --backend")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--length", type=int, default=700, help="prompt tokens (DuoAttention's rule needs > 640)")
    parser.add_argument("--dtype", default=None, help="the model's dtype (default: its config's; float32 for tiny ones)")
    parser.add_argument("--device", default=None, help="the model's device (default: its config's; cpu for tiny ones)")
    args = parser.parse_args(argv)
    wanted = None if args.methods == "all" else set(args.methods.split(","))
    outcomes = []
    for model in args.models.split(","):
        cfg = OmegaConf.load(CONF / "model" / f"{model}.yaml")
        if args.dtype is not None:
            cfg.dtype = args.dtype
        if args.device is not None:
            cfg.device = args.device
        lm = load_model(cfg)
        decoder = compiled_step.CompiledDecoder(lm, lint_backend() if args.lint else args.backend)
        backend = "graph lint" if args.lint else args.backend
        print(f"\n{model} ({lm.dtype}, backend {backend}, {args.steps} steps)")
        print(HEADER)
        unreplayed = []  # compiled methods with too few steps for a replay
        for label, name, settings, budget in STATIC + EAGER:
            if wanted is not None and label not in wanted:
                continue
            outcome = check(lm, label, name, settings, budget, args.steps, decoder, args.length,
                            expect_static=(label, name, settings, budget) in STATIC)
            outcomes.append(outcome)
            if outcome.path.startswith("eager ("):
                print(f"{label:22} {outcome.path}" + (f"  ERROR {outcome.error}" if outcome.error else ""))
                continue
            replayed = str(outcome.replayed)
            if not outcome.replays_expected and not outcome.error and outcome.path == "compiled":
                unreplayed.append(outcome)
                replayed = "-" if outcome.replayed == 0 else replayed
            print(f"{label:22} {outcome.path:10} {outcome.graphs:6d} {outcome.recompiles:10d} {outcome.second_sample:4d} "
                  f"{'equal' if outcome.tokens_equal else 'DIFFER':>7} {outcome.max_logit_diff:10.2e} "
                  f"{replayed:>8} {outcome.guarded:7d} {'equal' if outcome.stats_equal else 'DIFFER':>6}"
                  + (f"  ERROR {outcome.error}" if outcome.error else ""))
        if unreplayed:
            print(not_replayed_note(unreplayed))
    failed = [o.label for o in outcomes if not o.ok]
    print("\nall methods as expected" if not failed else f"\nNOT as expected: {', '.join(failed)}")
    return outcomes
