"""Config-group discovery: a variant config (`defaults: [snapkv]`) offers every setting of the config it
builds on, so `method=snapkv_head method.window=64` or `task=longbench_hotpotqa task.data_dir=...` is accepted."""

import re

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


@pytest.mark.parametrize("task,setting,message", [
    ("ruler_4k", "task.subtasks=[]", "subtasks is empty"),
    ("scbench", "task.tasks=[]", "tasks is empty"),
    ("longbench", "task.subsets=[]", "subsets is empty"),
    ("infinitebench", "task.subsets=[]", "subsets is empty"),
    ("niah", "task.depths=[]", "depths are percentages in [0, 100], at least one"),
    ("niah", "task.lengths=[]", "lengths are positive numbers of tokens, at least one"),
    ("niah", "task.lengths=[-5]", "lengths are positive numbers of tokens"),
    ("niah", "task.digits=0", "digits (of the needle's number) must be at least 1"),
    ("twostage_retr", "task.sizes=[]", "sizes are the dictionaries' entry counts, each at least 1"),
    ("twostage_retr", "task.sizes=[0]", "sizes are the dictionaries' entry counts, each at least 1"),
])
def test_a_task_setting_that_leaves_nothing_to_generate_is_refused(task, setting, message):
    """Each of these ran: an empty list gave a point of 0 samples (reported as a score over none), the others a
    needle of no digits, a traceback (`sizes=[]`) or a randrange error (`sizes=[0]`)."""
    from kvbench.config.paths import compose_config
    from kvbench.core.errors import KVBenchError
    from kvbench.tasks.base import build_task

    with pytest.raises(KVBenchError, match=f"^task {task}: " + re.escape(message)):
        build_task(compose_config([f"task={task}", setting]).task)


def test_a_point_whose_task_gives_no_sample_is_refused_before_its_directory_exists(tmp_path, monkeypatch):
    """What no setting above reaches (a task of the future, data of no row): one error, no point stored."""
    from kvbench.config.paths import compose_config
    from kvbench.core.errors import KVBenchError
    from kvbench.run import prepare

    monkeypatch.setattr(prepare, "cached_samples", lambda *args: [])
    cfg = compose_config(["model=tiny_llama", "task=niah", "task.num_samples=1", f"results_dir={tmp_path}"])
    with pytest.raises(KVBenchError, match="^task niah gives no sample with these settings"):
        prepare.prepare_point(cfg, tmp_path / "point")
    assert not (tmp_path / "point").exists()
