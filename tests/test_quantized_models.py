"""Quantised weights (issue 47): a tiny Llama in 4-bit NF4 through bitsandbytes' CPU backend runs points end to end
for full, SnapKV, Ada-KV, Quest and OmniKV; its records and manifest name the quantisation, its point is not the
bfloat16 point, its K/V stays in the compute dtype and its weights are counted at their real size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import model_cfg

from kvbench.core.errors import KVBenchError
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.models import load_model

pytest.importorskip("bitsandbytes")

QUANT = ["model=tiny_llama", "model.dtype=bfloat16", "task=twostage_retr", "task.num_samples=1",
         "task.max_new_tokens=6", "budget=32", "show_progress=false"]


@pytest.fixture(scope="module")
def nf4():
    return load_model(model_cfg("tiny_llama", quantization="bnb_4bit", dtype="bfloat16"))


def test_nf4_linear_layers_are_4bit_and_the_rest_stays_in_the_compute_dtype(nf4):
    from bitsandbytes.nn import Linear4bit

    attention = nf4.model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, Linear4bit) and attention.q_proj.weight.quant_state.quant_type == "nf4"
    assert attention.q_proj.compute_dtype == torch.bfloat16
    assert not isinstance(nf4.model.lm_head, Linear4bit) and nf4.dtype == torch.bfloat16
    assert nf4.record_fields() == {"quantization": "bnb_4bit"}


def test_the_reloaded_quantised_model_keeps_transformers_own_modules(nf4):
    """The quantised tiny model is saved and loaded back through `from_pretrained`, which in transformers 5.25
    swaps in the Hub's kernels unless told not to (`kvbench.models._from_pretrained`)."""
    assert nf4.model.use_kernels is False


def test_kv_stays_in_the_compute_dtype(nf4):
    session = Session(nf4, build_method("full"), None)
    session.prefill(list(range(10, 40)), compress=False)
    layer = session.cache.layers[0]
    assert layer.buffers["keys"].dtype == torch.bfloat16 == layer.buffers["values"].dtype


def test_quantised_weights_are_counted_at_their_real_size(nf4):
    plain = load_model(model_cfg("tiny_llama", dtype="bfloat16"))
    linear = sum(m.in_features * m.out_features for m in plain.model.model.layers.modules()
                 if isinstance(m, torch.nn.Linear))  # packed projections (fast bfloat16 CPUs) hold no weight of their own
    saved = sum(plain.weight_bytes_by_device().values()) - sum(nf4.weight_bytes_by_device().values())
    # each linear weight: 2 bytes in bfloat16 against half a byte plus a float32 absmax per 64 in NF4
    assert saved == pytest.approx(linear * (2 - 0.5 - 4 / 64), rel=0.02)


def test_the_roofline_reads_quantised_weights_at_their_real_size(nf4):
    """A profiled NF4 record's decode bytes per step count the packed weights a step reads (the config's count at
    bfloat16 would make its bandwidth use look four times better than it is); a plain model's stay the config's."""
    from omegaconf import OmegaConf

    from kvbench.engine.config import EngineConfig
    from kvbench.profiling.roofline import decode_weight_bytes, phase_costs
    from kvbench.run.policy import run_or_oom
    from tests.test_engine import kv_sample

    plain = load_model(model_cfg("tiny_llama", dtype="bfloat16"))
    by_config = phase_costs(plain.model.config, 0, 0.0, 2)["decode_bytes_per_step"]
    assert decode_weight_bytes(plain) == pytest.approx(by_config, rel=0.01)  # the norms' weights differ
    saved = sum(plain.weight_bytes_by_device().values()) - sum(nf4.weight_bytes_by_device().values())
    assert decode_weight_bytes(plain) - decode_weight_bytes(nf4) == saved
    cfg = OmegaConf.create({"profile": True, "profiler": {"warmup_steps": 0, "repeats": 1}})
    record = run_or_oom(cfg, nf4, build_method("full"), 32, kv_sample(1), EngineConfig())
    assert record["roofline"]["decode_bytes_per_step"] == pytest.approx(
        decode_weight_bytes(nf4) + record["decode_read_bytes_per_step"])


def test_a_missing_bitsandbytes_is_one_line_naming_what_to_install(tmp_path, monkeypatch):
    blocked = tmp_path / "blocked" / "bitsandbytes"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('bitsandbytes blocked for this test')\n")
    env = {**os.environ, "PYTHONPATH": f"{blocked.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "results"
    result = subprocess.run([sys.executable, "-m", "kvbench", *QUANT, "model.quantization=bnb_4bit",
                             f"results_dir={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvbench: error: model.quantization=bnb_4bit needs bitsandbytes")
    assert "pip install 'kvbench[quant]'" in lines[0]
    assert not [p for p in out.rglob("*") if p.is_file()]
    monkeypatch.syspath_prepend(str(blocked.parent))
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    with pytest.raises(KVBenchError, match="needs bitsandbytes"):
        load_model(model_cfg("tiny_llama", quantization="bnb_8bit"))


def test_bitsandbytes_is_imported_without_the_hubs_kernels():
    """bitsandbytes' CPU backend fetches an NF4 product from the Hugging Face Hub at import where `kernels` is
    importable (transformers 5.25 installs it); kvbench imports it with `kernels` hidden, so a CPU NF4 run's
    numbers do not depend on whether the Hub answered, and `kernels` is as it was afterwards."""
    from kvbench.models.placement import _hub_kernels_hidden

    before = sys.modules.get("kernels")
    with _hub_kernels_hidden():
        with pytest.raises(ImportError):
            from kernels import get_kernel  # noqa: F401
    assert sys.modules.get("kernels") is before


def _records(root: Path) -> dict[Path, dict]:
    return {p.parent: json.loads(p.read_text().splitlines()[0]) for p in root.rglob("records.jsonl")}


def test_nf4_points_run_end_to_end_and_are_their_own_points(tmp_path):
    out = tmp_path / "results"
    sweeps = [["-m", *QUANT, "model.quantization=none,bnb_4bit", "method=full,snapkv,adakv,quest"],
              ["-m", *QUANT, "model.quantization=none,bnb_4bit", "method=omnikv", "method.filter_layers=[0]"]]
    for sweep in sweeps:
        result = subprocess.run([sys.executable, "-m", "kvbench", *sweep, f"results_dir={out}"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    records = _records(out)
    assert len(records) == 10  # five methods, each plain and NF4, each its own directory
    by_method: dict[str, dict[str, dict]] = {}
    for run_dir, record in records.items():
        manifest = json.loads((run_dir / "manifest.json").read_text())
        quantization = record["point"].get("quantization", "none")
        assert manifest["point"]["model"].get("quantization", "none") == quantization
        assert record["point"]["dtype"] == "bfloat16" and record["turns"][0]["prediction"] is not None
        assert record["nll"] is not None and record["kv_bytes_end"] > 0
        by_method.setdefault(record["point"]["method"], {})[quantization] = record | {"dir": run_dir}
    assert set(by_method) == {"full", "snapkv", "adakv", "quest", "omnikv"}
    for method, pair in by_method.items():
        assert set(pair) == {"none", "bnb_4bit"}, method
        assert pair["none"]["point_hash"] != pair["bnb_4bit"]["point_hash"]
        assert "quantization" not in pair["none"]["point"]  # a plain point's record is what it always was
        # the same K/V layout: the cache holds what it held in bfloat16, only the weights changed
        assert pair["none"]["kv_bytes_end"] == pair["bnb_4bit"]["kv_bytes_end"], method
