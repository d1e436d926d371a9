"""InfiniteBench (kvbench.tasks.infinitebench) and OmniKV's Table 7 ablations.

Scorer examples are predictions and labels of the benchmark's own result files (OpenBMB/InfiniteBench
`results/*/preds_<task>.jsonl`) and inputs that walk each branch of its `compute_scores.py`; each expected value is
what that code returns, worked out by hand in the comment beside it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import random_ids
from reference import reference_chunks

from kvbench.core.errors import KVBenchError
from kvbench.methods import build_method
from kvbench.tasks import infinitebench as ib
from kvbench.tasks.base import DatasetMissingError, whitespace_meter
from kvbench.tasks.scoring import score

DATA = Path(__file__).parent / "data" / "infinitebench"


# --- scorers --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("prediction,label,expected", [
    (" 71432.", ["71432"], 1.0),              # first digit run "71432"
    ("The key is 71432, I think", ["71432"], 1.0),
    (" 7143 2", ["71432"], 0.0),              # first run "7143"
    ("no digits", ["71432"], 0.0),            # first_int_match gives ""
])
def test_passkey_first_digit_run(prediction, label, expected):
    assert score("infinitebench_passkey", prediction, label, label=label) == expected


@pytest.mark.parametrize("prediction,expected", [(" 3000077442.", 1.0), ("300 0077442", 0.0), ("x3000077442y", 1.0)])
def test_number_string_first_digit_run(prediction, expected):
    assert score("infinitebench_number_string", prediction, ["3000077442"], label=["3000077442"]) == expected


@pytest.mark.parametrize("prediction,label,expected", [
    ('\n\n"5e6b7b90-710d', "5e6b7b90-710d-4953-9b18-3e96b2cadbf2", 0.0),  # cut short: not a whole word
    ('The value is "5e6b7b90-710d-4953-9b18-3e96b2cadbf2".', "5e6b7b90-710d-4953-9b18-3e96b2cadbf2", 1.0),
    ("{5e6b7b90-710d-4953-9b18-3e96b2cadbf2}", ["5e6b7b90-710d-4953-9b18-3e96b2cadbf2"], 1.0),  # braces are spaces
    ("x5e6b7b90-710d-4953-9b18-3e96b2cadbf2", "5e6b7b90-710d-4953-9b18-3e96b2cadbf2", 0.0),     # word, not substring
])
def test_kv_retrieval_value_is_a_word_of_the_prediction(prediction, label, expected):
    assert score("infinitebench_kv_retrieval", prediction, [str(label)], label=label) == expected


@pytest.mark.parametrize("prediction,label,expected", [
    (" 10.", [4], 0.0),                 # results/yi-34b-200k: last word "10"
    ("The value is 4.", [4], 1.0),      # "." becomes a space; last word "4"
    (" -5.", [-5], 1.0),                # int("-5")
    ("4 apples", [4], 0.0),             # the last word is not a number
    ("", [4], 0.0),
])
def test_code_run_reads_the_last_word_as_an_int(prediction, label, expected):
    assert score("infinitebench_code_run", prediction, [str(label[0])], label=label) == expected
    assert score("infinitebench_code_run", prediction, [str(label[0])]) == expected  # label from the string answer


@pytest.mark.parametrize("prediction,expected", [
    ("B. repack_carchive", 1.0),                    # starts with "B."
    ("The correct option is: B", 1.0),              # "is:" is the first prefix found; the rest starts with B
    ("answer: repack_carchive is wrong", 1.0),       # the rest starts with the function name
    ("The answer is: C", 0.0),                      # "answer is:" found, the rest starts with C
    ("The answer is B", 0.0),                       # no prefix with a colon
    ("\n", 0.0),                                    # results/yi-34b-200k's empty answer
    ("It is:", 0.0),                                # the prediction ends with the prefix
])
def test_code_debug_letter_or_function_after_the_prefix(prediction, expected):
    label = ["repack_carchive", "B"]
    assert score("infinitebench_code_debug", prediction, label, label=label) == expected


@pytest.mark.parametrize("prediction,label,expected", [
    ("9999999999999999", [88], 0.0),     # results/yi-34b-200k
    ("94.", [94], 1.0),
    ("The answer is 2.5", [2.5], 1.0),   # a float label compares as a float
    ("2", [2.0], 1.0),
    ("12.5", [12], 0.0),                 # int("12.5") raises in the reference; never equal to an int label
    ("none", [12], 0.0),
])
def test_math_find_first_number(prediction, label, expected):
    assert score("infinitebench_math_find", prediction, [str(label[0])], label=label) == expected


@pytest.mark.parametrize("prediction,expected", [
    ("[79, 59, 70, 11]", 2 / 4),    # two values right, then a miss: the count stops
    ("79 59 73 11", 1.0),
    (" [1, 4, 8,", 0.0),             # results/yi-34b-200k: the in-context example's values
    ("79, 59", 2 / 4),               # fewer numbers than values
    ("-79, 59, 73, 11", 1.0),        # signs are not read
])
def test_math_calc_prefix_of_intermediate_values(prediction, expected):
    label = [[79, 59, 73, 11]]
    assert score("infinitebench_math_calc", prediction, [json.dumps(label[0])], label=label) == expected


@pytest.mark.parametrize("prediction,label,expected", [
    (" Nicky Santoro.", ["ACE", "ACE ROTHSTEIN"], 0.0),  # results/yi-34b-200k
    ("Ace.", ["ACE", "ACE ROTHSTEIN"], 1.0),             # upper-cased words
    (" GINGER.", ["GAGGI", "Remo", "remo Gaggi"], 0.0),
    ("remo", ["remo Gaggi"], 0.0),                       # the first gold as stored: lower case never matches
])
def test_longdialogue_first_gold_among_upper_cased_words(prediction, label, expected):
    assert score("infinitebench_longdialogue_qa_eng", prediction, label, label=label) == expected


@pytest.mark.parametrize("prediction,expected", [
    (" A", 1.0),                        # results/yi-34b-200k: first character
    (" C", 0.0),
    ("Walking Georgie", 1.0),           # the whole prediction is a label string
    ("The answer is: A", 1.0),          # "answer is:" then the rest starts with A
    ("I think the option is B", 0.0),   # "option is" then B
    ("Maybe C or A", 0.0),              # the first word inside "ABCD" is C
    ("", 0.0),
])
def test_longbook_choice(prediction, expected):
    label = ["Walking Georgie", "A"]
    assert score("infinitebench_longbook_choice_eng", prediction, label, label=label) == expected


def test_longbook_qa_eng_word_f1():
    # results/yi-34b-200k: "peyton is not mrs bronwyns child" (6 words) against "peyton": P 1/6, R 1 -> F1 2/7
    assert score("infinitebench_longbook_qa_eng", " Peyton is not Mrs. Bronwyn's child.", ['"Peyton"']) == pytest.approx(2 / 7)
    # articles removed, the best gold counts
    assert score("infinitebench_longbook_qa_eng", "The Snowfield", ["a snowfield", "x"]) == 1.0


def test_longbook_qa_chn_character_f1():
    # results/yi-34b-200k: gold 14 characters once ", " is gone; 2 shared -> P 1, R 1/7 -> F1 1/4
    gold = ["胡一刀, 马行空, 商老太, 徐峥, 程紫洁"]
    assert score("infinitebench_longbook_qa_chn", "商老", gold) == pytest.approx(0.25)
    assert score("infinitebench_longbook_qa_chn", "商老太。", ["商老太"]) == 1.0   # Chinese punctuation dropped
    assert score("infinitebench_longbook_qa_chn", "福", gold) == 0.0


def test_longbook_sum_rouge_lsum():
    # LCS "the cat sat" of 3 against 6 reference words: P 1, R 1/2 -> F 2/3; the better reference counts
    assert score("infinitebench_longbook_sum_eng", "the cat sat", ["the cat sat on the mat"]) == pytest.approx(2 / 3)
    assert score("infinitebench_longbook_sum_eng", "the cat sat", ["dogs run", "the cat sat"]) == pytest.approx(1.0)
    assert score("infinitebench_longbook_sum_eng", "\n", ["the cat sat"]) == 0.0


# --- prompts, loader, generation -----------------------------------------------------------------------------------

def official_prompt(row: dict, subset: str) -> str:
    """`create_prompt` of the benchmark for the open-model templates, written out per task."""
    template = ib.TEMPLATES[subset]
    if subset == "code_run":
        call = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", row["input"])[0]
        return template.format(func=call.split("(")[0], func_call=call, context=row["context"])
    if subset in ("code_debug", "longbook_choice_eng"):
        options = dict(zip(("OPTION_A", "OPTION_B", "OPTION_C", "OPTION_D"), row["options"]))
        return template.format(context=row["context"], question=row["input"], **options)
    if subset == "math_find":
        target = re.findall(r"The .+ of", row["input"])[0].lower()[:-3]
        return template.format(prefix=f"What is {target} in the following list?", context=row["context"], input=row["input"])
    return template.format(context=row["context"], question=row.get("input", ""), input=row.get("input", ""))


def test_loader_reads_every_task_into_the_official_prompt_label_and_length():
    task = ib.InfiniteBench(subsets=list(ib.ALL_SUBSETS), data_dir=str(DATA))
    samples = task.samples(whitespace_meter, seed=0)
    assert [s.task for s in samples] == [f"infinitebench_{s}" for s in ib.ALL_SUBSETS]
    for sample in samples:
        subset = sample.meta["subset"]
        row = json.loads((DATA / f"{subset}.jsonl").read_text(encoding="utf-8").splitlines()[0])
        turn = sample.turns[0]
        assert sample.context + turn.question + turn.answer_prefix == official_prompt(row, subset)
        assert sample.context.endswith(row["context"])  # the context part ends at the haystack
        assert turn.max_new_tokens == ib.MAX_NEW_TOKENS[subset] and turn.metric == f"infinitebench_{subset}"
        assert sample.truncation == "middle" and sample.meta["prompt_token_limit"] == 128 * 1024
        assert not sample.chat_template
        assert ("sampling" in sample.meta) == (subset == "longbook_sum_eng")
    by_subset = {s.meta["subset"]: s for s in samples}
    assert by_subset["longbook_choice_eng"].turns[0].metric_args["label"] == ["Walking Georgie", "A"]
    assert by_subset["code_debug"].turns[0].metric_args["label"] == ["repack_carchive", "B"]
    assert by_subset["code_run"].turns[0].metric_args["label"] == 4  # numbers stay numbers
    assert by_subset["math_find"].turns[0].question.startswith("\n\nYou should answer")
    assert by_subset["math_find"].context.startswith("What is the largest number in the following list?")
    # the official label scores the gold answer as correct in every task
    golds = {"passkey": "71432", "number_string": "3000077442", "kv_retrieval": "5e6b7b90-710d-4953-9b18-3e96b2cadbf2",
             "longbook_choice_eng": "A", "longbook_qa_eng": "Peyton", "longbook_qa_chn": "商老太",
             "longdialogue_qa_eng": "Ace", "math_find": "88", "math_calc": "59, 73", "code_run": "4",
             "code_debug": "B. repack_carchive",
             "longbook_sum_eng": "Jennifer makes a serious error in judgment when she marries a scholar."}
    for subset, gold in golds.items():
        turn = by_subset[subset].turns[0]
        assert score(turn.metric, gold, turn.answers, **turn.metric_args) == 1.0, subset


def test_en_sum_samples_with_omnikvs_settings_and_a_per_sample_seed():
    task = ib.InfiniteBench(subsets=["longbook_sum_eng"], data_dir=str(DATA))
    first, again = task.samples(whitespace_meter, seed=0)[0], task.samples(whitespace_meter, seed=0)[0]
    other = task.samples(whitespace_meter, seed=1)[0]
    sampling = first.meta["sampling"]
    assert sampling["temperature"] == 0.8 and sampling["top_p"] == 0.95
    assert sampling == again.meta["sampling"] and sampling["seed"] != other.meta["sampling"]["seed"]


def test_missing_data_is_one_error_that_says_how_to_get_it(tmp_path):
    task = ib.InfiniteBench(subsets=["longbook_qa_eng", "passkey"], data_dir=str(tmp_path))
    with pytest.raises(DatasetMissingError, match=r"longbook_qa_eng.*\n.*huggingface-cli download xinrongzhang2022/InfiniteBench"):
        task.samples(whitespace_meter, seed=0)
    with pytest.raises(ValueError, match="unknown"):
        ib.InfiniteBench(subsets=["longbook_qa"])


@pytest.mark.parametrize("subset", ib.GENERATED_SUBSETS)
def test_generated_retrieval_has_the_benchmarks_format_fits_and_sweeps_the_depth(subset):
    task = ib.InfiniteBench(subsets=[subset], seq_len=600, num_samples=3)
    samples = task.samples(whitespace_meter, seed=3)
    assert samples == ib.InfiniteBench(subsets=[subset], seq_len=600, num_samples=3).samples(whitespace_meter, seed=3)
    for sample in samples:
        turn = sample.turns[0]
        prompt = sample.context + turn.question
        assert whitespace_meter(sample.context, turn.question) + turn.max_new_tokens <= 600
        key = turn.answers[0]
        if subset == "kv_retrieval":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", key)
            pairs = json.loads(sample.context.split("JSON data:\n", 1)[1])  # the context is valid JSON
            asked = re.fullmatch(r'\n\n\nKey: "(.+)"\nThe value associated with the specified key is: ', turn.question)
            assert pairs[asked.group(1)] == key and len(pairs) == sample.meta["pairs"]
            # one more pair would not fit: m is the largest
            assert whitespace_meter(sample.context, turn.question) + 2 + turn.max_new_tokens > 600
        else:
            noun = "pass key" if subset == "passkey" else "sequence of digits"
            needle = f"The {noun} is {key}. Remember it. {key} is the {noun}.\n"
            assert prompt.count(needle) == 1 and prompt.count(ib.NOISE) == sample.meta["noise_lines"]
            assert re.fullmatch(r"\d{5}" if subset == "passkey" else r"\d{10}", key)
            if subset == "number_string":  # five digits doubled in place: at least five adjacent repeats
                assert sum(a == b for a, b in zip(key, key[1:])) >= 5
            assert turn.question.endswith(f"\n\nThe {noun} is")
        assert score(turn.metric, f" {key}.", turn.answers, **turn.metric_args) == 1.0
    depths = [s.meta["depth"] for s in samples]
    assert depths[0] == 0.0 and depths == sorted(depths) and depths[-1] > 0.6


# --- truncation ----------------------------------------------------------------------------------------------------

def test_middle_truncation_keeps_the_head_and_tail_to_the_128k_limit():
    from kvbench.engine.prompt import fit_to_model

    task = ib.InfiniteBench(subsets=["longbook_qa_eng"], data_dir=str(DATA), truncate_to=100)
    sample = task.samples(whitespace_meter, seed=0)[0]
    lm = SimpleNamespace(max_positions=10_000, name="fake")  # the model allows far more: the task's 100 binds
    ctx, question = list(range(1000)), list(range(5000, 5010))
    kept = fit_to_model(lm, sample, ctx, question)
    assert len(kept) + len(question) == 100
    # the benchmark keeps prompt[:50] + prompt[-50:]; kvbench keeps the question whole and cuts the context part
    official = (ctx + question)[:50] + (ctx + question)[-50:]
    head, tail = kept[:45], kept[45:]
    assert head == ctx[:45] and tail == ctx[-45:] and official[:45] == head and official[-50:-10] == tail[-40:]
    short = fit_to_model(lm, sample, ctx[:80], question)
    assert short == ctx[:80]  # within the limit: untouched
    limited = SimpleNamespace(max_positions=60, name="fake")  # a model shorter than the limit binds instead
    assert len(fit_to_model(limited, sample, ctx, question)) + len(question) == 60 - sample.turns[0].max_new_tokens


# --- OmniKV's Table 7 ablations ------------------------------------------------------------------------------------

PROMPT = 300


def decode(session, logits, steps):
    outs = [logits]
    for _ in range(steps):
        outs.append(session.step(int(outs[-1].argmax())))
    return outs


def test_ablation_defaults_to_none_and_rejects_unknown_values():
    assert build_method("omnikv").ablation is None
    with pytest.raises(KVBenchError, match="ablation must be without_selector, without_bank or null"):
        build_method("omnikv", ablation="without_everything")


@pytest.mark.parametrize("offload", [False, True])
def test_without_selector_sparse_layers_attend_to_the_whole_prompt(tiny_llama_deep, offload):
    from kvbench.engine.session import Session

    ids = random_ids(PROMPT, seed=71)
    method = build_method("omnikv", filter_layers=[1, 3], ablation="without_selector", offload=offload)
    session = Session(tiny_llama_deep, method, 24, sequence_length=PROMPT + 24)
    outs = decode(session, session.prefill(ids, compress=True)[0], 5)
    full = Session(tiny_llama_deep, build_method("full"), None)
    dense = decode(full, full.prefill(ids, compress=True)[0], 5)
    for ours, theirs in zip(outs, dense):  # the same rows, merged by log-sum-exp: full attention up to rounding
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    if offload:  # Brutal Offload: the whole prompt of a sparse layer comes back from the bank each step
        assert session.cache.layers[5].derived["bank"].keys.shape[1] == PROMPT


def test_without_bank_every_sparse_layer_attends_to_its_own_top_k(tiny_llama_deep):
    from kvbench.engine.session import Session

    method = build_method("omnikv", filter_layers=[1], wait_layers=1, ablation="without_bank")
    assert [method.role(i) for i in range(6)] == ["dense", "filter", "wait", "sparse", "sparse", "sparse"]
    choices: list[dict[int, torch.Tensor]] = []
    choose = method._choose

    def spy(layer, q, prompt_keys, prompt, step, scaling):
        chosen = choose(layer, q, prompt_keys, prompt, step, scaling)
        choices[-1][layer.layer_idx] = chosen.clone()
        # the layer's own query decides: the top 24 of max-over-heads logits against its own prompt keys
        logits = torch.einsum("hgd,hnd->hgn", q.float(), prompt_keys.float()) * scaling
        expected = logits.flatten(0, 1).amax(dim=0).topk(24).indices.sort().values
        assert torch.equal(chosen, expected)
        return chosen

    method._choose = spy
    ids = random_ids(PROMPT, seed=72)
    session = Session(tiny_llama_deep, method, 24, sequence_length=PROMPT + 24)
    logits, _ = session.prefill(ids, compress=True)
    chunks, past, outs = [ids], [None], [logits]
    for _ in range(4):
        choices.append({})
        before = session.position
        outs.append(session.step(int(outs[-1].argmax())))
        chunks.append([int(outs[-2].argmax())])
        assert sorted(choices[-1]) == [3, 4, 5]  # sparse layers only: the filter layer's choice is never made
        assert not (torch.equal(choices[-1][3], choices[-1][4]) and torch.equal(choices[-1][4], choices[-1][5]))
        visible = {}
        for layer, chosen in choices[-1].items():
            mask = torch.zeros(2, before + 1, dtype=torch.bool)
            mask[:, chosen] = True
            mask[:, PROMPT:] = True
            visible[layer] = mask
        past.append(visible)
    for ours, theirs in zip(outs, reference_chunks(tiny_llama_deep.model, chunks, past)):
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)


def test_without_bank_with_offload_equals_without_offload(tiny_llama_deep):
    from kvbench.engine.session import Session

    ids = random_ids(PROMPT, seed=73)
    outs = {}
    for offload in (False, True):
        method = build_method("omnikv", filter_layers=[1, 3], ablation="without_bank", offload=offload)
        session = Session(tiny_llama_deep, method, 24, sequence_length=PROMPT + 30)
        outs[offload] = decode(session, session.prefill(ids, compress=True)[0], 6)
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))


# --- the presets' CPU twins, end to end ----------------------------------------------------------------------------

# one generated task at 512 tokens, one sample, no NLL pass: the smallest slice of a twin
SLICE = ("task.num_samples=1", "task.seq_len=512", "task.subsets=[passkey]", "engine.nll=false")


def _table(report: Path):
    import pandas as pd

    return pd.read_csv(report / "table.csv", dtype=str, keep_default_na=False)


def _one_sample_scores(table, column: str) -> None:
    assert column in table.columns, list(table.columns)
    assert table[column].map(lambda v: 0.0 <= float(v) <= 100.0).all() and (table[f"{column} n"] == "1").all()


@pytest.mark.integration
def test_omnikv_table2_cpu_slice_reports_a_column_per_task_and_a_row_per_method(tmp_path):
    from preset_slice import run_preset_slice

    table = _table(run_preset_slice("omnikv_table2_cpu", tmp_path, "method=full,omnikv_mem", *SLICE))
    assert sorted(table["method"]) == ["full", "omnikv_mem"]
    _one_sample_scores(table, "Retr.PassKey")
    assert "Retr.KV" not in table.columns  # a task the slice did not run is not a column of zeros


@pytest.mark.integration
def test_omnikv_table3_cpu_slice_reports_accuracy_and_ms_per_token_by_budget(tmp_path):
    from preset_slice import run_preset_slice

    report = run_preset_slice("omnikv_table3_cpu", tmp_path, "budget=32,128", *SLICE)
    table = _table(report)
    assert sorted(table["budget"], key=float) == ["32", "128"]
    _one_sample_scores(table, "Retr.PassKey")
    import pandas as pd

    points = pd.read_csv(report / "points.csv")
    assert (points["decode_ms_per_token"] > 0).all() and (report / "efficiency.png").is_file()


@pytest.mark.integration
def test_omnikv_table7_cpu_slice_reports_the_ablations_beside_omnikv(tmp_path):
    from preset_slice import run_preset_slice

    table = _table(run_preset_slice("omnikv_table7_cpu", tmp_path, *SLICE))
    assert sorted(table["method"]) == ["omnikv_mem_offload", "omnikv_without_bank", "omnikv_without_selector"]
    _one_sample_scores(table, "Retr.PassKey")
