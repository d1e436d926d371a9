"""Which stored points belong to a preset's grid: the identity every grid point would have, compared with the
identity each point directory was stored under; the others are left out of the preset's report, by name."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from kvbench.config.paths import GROUPS, experiment_config
from kvbench.results.collect import _flatten, recorded_identity

# Identity settings compared loosely between a stored point and the preset (`_differences`): the preset may
# leave them to the machine (`auto`), and `run.identity.point_identity` resolves `auto` where it runs, so a
# report composed on a laptop cannot know what a GPU node resolved; each point's dtype is shown instead, and
# points of two dtypes never share a cell.
LOOSE_KEYS = ("model.dtype", "model.device")


# How many settings a left-out point's line names.
SHOWN_DIFFERENCES = 4


def sweep_axes(params: Mapping[str, Any]) -> dict[str, list[str]]:
    """The values each key of a sweep's `params` takes ({"budget": "64,128"} -> {"budget": ["64", "128"]})."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    axes: dict[str, list[str]] = {}
    for key, value in params.items():
        (override,) = parser.parse_overrides([f"{key}={value}"])
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [
            override.get_value_element_as_str()]
        axes[key.lstrip("+~")] = values
    return axes


def expected_identities(name: str, fixed: Sequence[str], axes: Mapping[str, list[str]]) -> list[dict[str, Any]]:
    """The identity of every point a sweep of preset `name` with overrides `fixed` over `axes` runs, with the
    settings as the preset writes them (`run.identity.written_point_identity`: `auto` stays `auto`, see
    `LOOSE_KEYS`), flattened (`method.window`, ...)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from kvbench.run.identity import written_point_identity  # torch: only for a preset's report

    parser = OverridesParser.create()
    groups = [k for k in axes if k in GROUPS]  # a config choice: composed; any other key is set on the result
    others = [k for k in axes if k not in groups]
    out: dict[str, dict[str, Any]] = {}
    for choice in itertools.product(*(axes[k] for k in groups)):
        cfg = experiment_config(name, [*fixed, *(f"{k}={v}" for k, v in zip(groups, choice))])
        cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        for combo in itertools.product(*(axes[k] for k in others)):
            point = copy.deepcopy(cfg)
            for key, value in zip(others, combo):
                (override,) = parser.parse_overrides([f"{key}={value}"])
                OmegaConf.update(point, key, override.value(), force_add=True)
            identity: dict[str, Any] = {}
            _flatten("", written_point_identity(point), identity)
            out[repr(sorted(identity.items()))] = identity
    return list(out.values())


def _precision(value: Any) -> str:
    """A dtype or device as compared: `torch.bfloat16` is bfloat16, `cuda:1` is cuda."""
    return str(value).replace("torch.", "").split(":")[0]


def _match_key(flat: Mapping[str, Any]) -> tuple:
    """The settings that must agree exactly, spelled alike (null and unset are the same setting: a null method
    parameter is the method's default); a data file's digest stands for its path (it may be reached by another)."""
    skip = {*LOOSE_KEYS, *(("task.path",) if "task_file_sha256" in flat else ())}
    return tuple(sorted((k, norm(v)) for k, v in flat.items() if k not in skip and v is not None))


def _differences(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(setting, stored value, expected value) for every setting in which a stored point's identity differs
    from an expected one; `LOOSE_KEYS` differ only where both name a concrete value."""
    mine, want = dict(_match_key(stored)), dict(_match_key(expected))
    out = [(k, stored.get(k), expected.get(k)) for k in sorted(set(mine) | set(want)) if mine.get(k) != want.get(k)]
    for key in LOOSE_KEYS:
        a, b = stored.get(key), expected.get(key)
        if a not in (None, "auto") and b not in (None, "auto") and _precision(a) != _precision(b):
            out.append((key, a, b))
    return out


def _describe(diffs: list[tuple[str, Any, Any]], stored: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """`_differences` as "task.seq_len=1024 vs 2048"; a section only one side has (a profiled point's
    `profile`) is named once, "profile=set vs unset", and another model, task or method by its name alone."""
    def sections(flat: Mapping[str, Any]) -> set[str]:
        return {k.split(".")[0] for k in flat}

    one_sided = sections(stored) ^ sections(expected)
    # another model, task or method: its name says it (its settings differ with it), before anything else
    renamed = [k.split(".")[0] for k, _, _ in diffs if k in ("model.name", "task.name", "method.name")]
    out = {s: f"{s}={_setting(stored.get(f'{s}.name'))} vs {_setting(expected.get(f'{s}.name'))}" for s in renamed}
    for key, mine, want in diffs:
        section = key.split(".")[0]
        if section in renamed:
            continue
        if "." in key and section in one_sided:
            out[section] = f"{section}={'set' if section in sections(stored) else 'unset'} vs " \
                           f"{'set' if section in sections(expected) else 'unset'}"
        else:
            out[key] = f"{key}={_setting(mine)} vs {_setting(want)}"
    return list(out.values())


def _setting(value: Any) -> str:
    return "unset" if value is None else norm(value)


def select_points(source: Any, df: pd.DataFrame) -> tuple[pd.DataFrame, list[tuple[str, list[str]]]]:
    """The records of `df` whose points are among the preset's (`source`, a `paper_tables.Source`: their stored
    identity, `recorded_identity`, is one of `source.identities`), and the points left out: (run directory, how
    its settings differ from the nearest expected point, "task.seq_len=1024 vs 2048"). A results directory's
    report takes every point."""
    if source.identities is None or df.empty:
        return df, []
    expected: dict[tuple, list[dict[str, Any]]] = {}
    for identity in source.identities:
        expected.setdefault(_match_key(identity), []).append(identity)
    kept, left_out = [], []
    for run_dir in df["run_dir"].unique():
        point = recorded_identity(source.root / run_dir)
        if point is None:
            left_out.append((run_dir, ["no manifest.json with its settings"]))
            continue
        stored: dict[str, Any] = {}
        _flatten("", point, stored)
        if any(not _differences(stored, e) for e in expected.get(_match_key(stored), [])):
            kept.append(run_dir)
            continue
        nearest = min(source.identities, key=lambda e: len(_differences(stored, e)))
        text = _describe(_differences(stored, nearest), stored, nearest)
        if len(text) > SHOWN_DIFFERENCES:
            text = [*text[:SHOWN_DIFFERENCES], f"{len(text) - SHOWN_DIFFERENCES} more"]
        left_out.append((run_dir, text))
    selected = df[df["run_dir"].isin(kept)]
    selected.attrs.update(df.attrs)
    return selected, left_out


def left_out_lines(left_out: Sequence[tuple[str, Sequence[str]]], limit: int = 20) -> list[str]:
    """What `select_points` left out, as printed and written into a report: a count, then a point per line."""
    if not left_out:
        return []
    lines = [f"left out {len(left_out)} point{'s' if len(left_out) > 1 else ''} whose settings differ from "
             f"the preset:"]
    lines += [f"  {run_dir} ({', '.join(diffs)})" for run_dir, diffs in left_out[:limit]]
    if len(left_out) > limit:
        lines.append(f"  ... and {len(left_out) - limit} more")
    return lines


def norm(value: Any) -> str:
    """One spelling per value, so sweep strings ("0.2", "true") match recorded values (0.2, True)."""
    if value is None or (isinstance(value, float) and np.isnan(value)) or value is pd.NA:
        return "-"
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value)).lower()
    if isinstance(value, (int, float, np.integer, np.floating)):
        return f"{float(value):g}"
    if isinstance(value, (list, tuple)):  # a list setting (method.filter_layers): as a sweep writes it, "[2,8,18]"
        return "[" + ",".join(norm(v) for v in value) + "]"
    text = str(value)
    if text.startswith("[") and text.endswith("]"):  # a sweep's or a record's spelling of that list, spaces or not
        return text.replace(" ", "")
    try:
        return f"{float(text):g}"
    except ValueError:
        return {"True": "true", "False": "false", "null": "-", "None": "-"}.get(text, text)
