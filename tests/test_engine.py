"""The engine: prompt parts, question-agnostic mode, multi-turn sessions on one cache, budgets."""

from __future__ import annotations

import pytest
import torch
from reference import kept_masks, reference_logits

from kvbench.core.budget import resolve_budget
from kvbench.core.errors import KVBenchError
from kvbench.engine.config import EngineConfig
from kvbench.engine.prompt import PromptBuilder
from kvbench.engine.sample import run_sample
from kvbench.engine.session import Session
from kvbench.methods import build_method
from kvbench.tasks.base import Sample, Turn


def kv_sample(turns: int = 2, mode: str = "multi_turn") -> Sample:
    pairs = {f"key-{i:03d}": f"value-{i * 7919 % 1000:03d}" for i in range(40)}
    context = "Remember this table.\n" + "\n".join(f"{k} = {v}" for k, v in pairs.items()) + "\n"
    keys = ["key-005", "key-031", "key-017"][:turns]
    return Sample(
        id="kv-0",
        task="synthetic_kv",
        context=context,
        turns=[Turn(f"What is {k}?", [pairs[k]], max_new_tokens=6, metric="string_match_all", answer_prefix="Answer:")
               for k in keys],
        meta={"mode": mode},
    )


def test_question_aware_and_agnostic_see_the_same_tokens(tiny_llama):
    sample = kv_sample(1)
    builder = PromptBuilder(tiny_llama.tokenizer)
    ctx, question = builder.first_turn(sample)
    assert builder.measure(sample.context, sample.turns[0].question, "Answer:") == len(ctx) + len(question)
    text = tiny_llama.tokenizer.decode(ctx + question)
    assert text.endswith("What is key-005?<|eos|><|assistant|>Answer:") and "<|user|>Remember" in text
    aware = run_sample(tiny_llama, build_method("snapkv", window=8), 64, sample, EngineConfig(compress_question=True))
    agnostic = run_sample(tiny_llama, build_method("snapkv", window=8), 64, sample, EngineConfig(compress_question=False))
    assert aware["prompt_tokens"] == agnostic["prompt_tokens"]
    assert aware["compressed_segment_tokens"] == aware["prompt_tokens"]
    assert agnostic["compressed_segment_tokens"] == agnostic["context_tokens"]
    assert agnostic["kv_bytes_after_prefill"] > agnostic["kv_bytes_after_compress"]  # question appended uncompressed


def test_second_turn_prefill_attends_to_the_compressed_first_turn_cache(tiny_llama):
    """Turn 2 is appended on the compressed cache; its logits equal a dense reference that lets each head see
    only what it kept of turn 1's prompt, plus turn 2's tokens."""
    sample = kv_sample(2)
    builder = PromptBuilder(tiny_llama.tokenizer)
    ctx, question = builder.first_turn(sample)
    segment = ctx + question
    session = Session(tiny_llama, build_method("adakv", window=8), 48)
    logits, _ = session.prefill(segment, compress=True)
    visible = kept_masks(session.cache, len(segment))
    generated, _, _ = session.decode(logits, 4, set(), [])
    session.rollback(len(segment))
    turn_two = builder.next_turn(sample, 1)
    assert tiny_llama.tokenizer.decode(turn_two).startswith(" value-")  # the gold answer continues "Answer:"
    logits2, _ = session.prefill(turn_two, compress=False)
    reference = reference_logits(tiny_llama.model, segment, visible, [turn_two])
    torch.testing.assert_close(logits2, reference[1], atol=2e-5, rtol=1e-5)
    lengths = session.cache.layers[0].lengths()
    assert all(n < len(segment) for n in lengths)  # turn 1 stayed compressed
    assert int(session.cache.layers[0].positions.max()) == len(segment) + len(turn_two) - 1


def test_multi_turn_and_multi_request_records(tiny_llama):
    for mode in ("multi_turn", "multi_request"):
        record = run_sample(tiny_llama, build_method("snapkv", window=8), 48, kv_sample(3, mode), EngineConfig())
        assert len(record["turns"]) == 3
        assert record["score"] == pytest.approx(sum(t["score"] for t in record["turns"]) / 3)
        if mode == "multi_request":  # the context alone is compressed; every request is independent
            assert record["compressed_segment_tokens"] == record["context_tokens"]


def test_golden_context_false_is_refused(tiny_llama):
    sample = kv_sample(2)
    sample.meta["golden_context"] = False
    with pytest.raises(KVBenchError, match="golden_context"):
        run_sample(tiny_llama, build_method("full"), 64, sample, EngineConfig())


def test_budget_resolution():
    assert resolve_budget(256, 1000) == 256
    assert resolve_budget(0.2, 1000) == 200
    assert resolve_budget(4096.0, 10) == 4096
    for bad in (0, -3, 0.0, 2.5):
        with pytest.raises(KVBenchError):
            resolve_budget(bad, 100)


def test_prompt_longer_than_model_is_refused_or_middle_truncated(tiny_llama):
    sample = kv_sample(1)
    sample.context = "x" * 9000
    with pytest.raises(KVBenchError, match="exceed the limit of 8192"):
        run_sample(tiny_llama, build_method("full"), 64, sample, EngineConfig(nll=False))
    sample.truncation = "middle"
    sample.meta["prompt_token_limit"] = 1000
    sample.turns[0].max_new_tokens = 1
    record = run_sample(tiny_llama, build_method("full"), 64, sample, EngineConfig(nll=False))
    assert record["prompt_tokens"] == 1000


def test_min_new_tokens_blocks_immediate_stop(tiny_llama):
    sample = kv_sample(1)
    session = Session(tiny_llama, build_method("full"), None)
    ids = sum(PromptBuilder(tiny_llama.tokenizer).first_turn(sample), [])
    logits, _ = session.prefill(ids, compress=False)
    eos = int(logits.argmax())  # pretend the most likely token is EOS
    tokens, _, reason = session.decode(logits.clone(), 3, {eos}, [], min_new_tokens=1)
    assert tokens[0] != eos


def test_compression_ratio_keeps_kvpress_count_on_an_odd_prompt(tiny_llama):
    from kvbench.core.budget import CompressionRatio

    assert resolve_budget(CompressionRatio(0.5), 301) == 150  # int(301 * 0.5), kvpress's rounding
    assert resolve_budget(CompressionRatio(0.25), 301) == 225 and resolve_budget(CompressionRatio(0.0), 301) == 301
    sample = kv_sample(1)
    sample.context += "!"  # 849 byte tokens: an odd prompt
    ctx, question = PromptBuilder(tiny_llama.tokenizer).first_turn(sample)
    length = len(ctx) + len(question)
    assert length % 2 == 1, "the sample should have an odd prompt length"
    record = run_sample(tiny_llama, build_method("streamingllm"), CompressionRatio(0.5), sample, EngineConfig())
    assert record["kept_tokens_mean"] == record["budget_tokens"] == length // 2 and record["compression_ratio"] == 0.5
