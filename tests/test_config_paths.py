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
