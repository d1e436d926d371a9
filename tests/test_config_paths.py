"""Config-group discovery: a variant config (`defaults: [snapkv]`) offers every setting of the config it
builds on, so `method=snapkv_head method.window=64` or `task=longbench_hotpotqa task.data_dir=...` is accepted."""

import pytest
from omegaconf import OmegaConf

from kvbench.config.paths import choice_file, choices, settings


def _variants(group: str) -> list[tuple[str, str]]:
    out = []
    for name in choices(group):
        parents = [d for d in OmegaConf.load(choice_file(group, name)).get("defaults", [])
                   if isinstance(d, str) and d != "_self_"]
        out += [(name, parents[0])] if parents else []
    return out


@pytest.mark.parametrize("group", ["method", "task"])
def test_a_variant_offers_its_parents_settings(group):
    variants = _variants(group)
    assert variants, f"no variant configs in {group}"
    for name, parent in variants:
        missing = set(settings(group, parent)) - set(settings(group, name))
        assert not missing, f"{group}={name} refuses {sorted(missing)}, settings of its parent {parent}"


def test_snapkv_head_takes_snapkvs_window():
    assert "window" in settings("method", "snapkv_head")


def _override_value(value) -> str:
    """A composed value written back as a Hydra override value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_value(v)}" for k, v in value.items()) + "}"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


@pytest.mark.parametrize("group", ["model", "method", "task"])
def test_every_config_accepts_every_key_it_has_after_composition(group):
    """`group=NAME group.KEY=VALUE` with the value NAME composes to: accepted by the command check and composed
    back to the same value, for every config of the group (derived ones inherit their parents' keys)."""
    import hydra_plugins.kvbench_launcher.grouped_launcher  # noqa: F401 - registers hydra/launcher=grouped
    from kvbench.config.paths import compose_config
    from kvbench.config.validate import check_settings

    for name in choices(group):
        composed = OmegaConf.to_container(compose_config([f"{group}={name}"])[group], resolve=False)
        keys = [k for k in composed if k not in ("name", "_target_")]
        args = [f"{group}={name}", *(f"{group}.{k}={_override_value(composed[k])}" for k in keys)]
        again = OmegaConf.to_container(compose_config(check_settings(args))[group], resolve=False)  # raises on a key
        assert {k: again[k] for k in keys} == {k: composed[k] for k in keys}, name


def test_every_task_refuses_a_flag_that_is_not_true_or_false():
    """A task's settings are built as its constructor's annotations say: `task.chat_template=maybe` (or any flag
    of any task config) is one error line naming the task and the setting, not a truthy string read as true."""
    from kvbench.config.paths import compose_config
    from kvbench.core.errors import KVBenchError
    from kvbench.tasks.base import build_task

    flags = 0
    for name in choices("task"):
        task = compose_config([f"task={name}"]).task
        build_task(task)  # every shipped config is of the kinds its task annotates
        for key in [k for k, v in task.items() if isinstance(v, bool)]:
            wrong = task.copy()
            wrong[key] = "maybe"
            with pytest.raises(KVBenchError, match=f"^task {task.name}: {key} must be true or false, got 'maybe'$"):
                build_task(wrong)
            flags += 1
    assert flags >= len(choices("task"))  # chat_template at least, in every task
