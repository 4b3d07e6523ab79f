import json

import pytest

from flexmarl_jax.workflows.dataset import DatasetError, JsonlTask, read_jsonl_dataset, read_jsonl_records
from flexmarl_jax.workflows.tasks import build_task


def write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = [json.dumps({"prompt": "2+2=", "answer": 4}), "", json.dumps({"prompt": "cap:fr=", "answer": "Paris"})]


def test_loads_lines_with_line_numbers(tmp_path):
    assert read_jsonl_records(write(tmp_path, GOOD)) == [(1, "2+2=", "4"), (3, "cap:fr=", "Paris")]


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"prompt": "x"}), r"missing key\(s\) \['answer'\]"),
        (json.dumps({"prompt": ["x"], "answer": "1"}), "'prompt' must be a string or number"),
        (json.dumps({"prompt": "", "answer": "1"}), "'prompt' is empty"),
    ],
)
def test_malformed_line_names_its_line_number(tmp_path, bad, problem):
    path = write(tmp_path, GOOD[:2] + [bad] + GOOD[2:])
    with pytest.raises(DatasetError, match=rf"data.jsonl:3: {problem}"):
        read_jsonl_records(path)
    # Skipped only when asked: the good lines keep their own numbers.
    assert [r[0] for r in read_jsonl_records(path, skip_malformed=True)] == [1, 4]


def test_empty_dataset_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="no usable lines"):
        read_jsonl_records(write(tmp_path, ["", "{bad"]), skip_malformed=True)


def test_jsonl_task_generates_deterministically_and_verifies(tmp_path):
    lines = [json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) for i in range(5)]
    task = build_task("jsonl", path=write(tmp_path, lines), verifier="numeric")
    assert isinstance(task, JsonlTask)
    first = task.generate(12, seed=7)
    assert first == task.generate(12, seed=7)
    assert [p.prompt for p in first[:5]] != [p.prompt for p in task.generate(5, seed=8)]
    # 12 > 5 lines: every line appears in each epoch of 5.
    assert sorted(p.meta["line"] for p in first[:5]) == [1, 2, 3, 4, 5]
    problem = first[0]
    assert task.verify(problem, f" {problem.answer}.") and not task.verify(problem, "x")
    assert not task.verify(problem, None)
    exact = JsonlTask(write(tmp_path, GOOD), verifier="exact")
    paris = next(p for p in exact.generate(2, seed=0) if p.answer == "Paris")
    assert exact.verify(paris, "Paris\n") and not exact.verify(paris, "paris")
    with pytest.raises(ValueError, match=r"unknown verifier 'regex'; allowed: \['auto', 'exact', 'math', 'numeric'\]"):
        JsonlTask(write(tmp_path, GOOD), verifier="regex")


def gsm8k(question, reasoning, final):
    return json.dumps({"question": question, "answer": f"{reasoning}\n#### {final}"})


GSM8K = [
    gsm8k("Ann has 3 apples and buys 4. How many?", "3 + 4 = <<3+4=7>>7", "7"),
    gsm8k("A car costs 1,000 and a boat 234 more. The boat?", "1,000 + 234 = <<1000+234=1234>>1,234", "1,234"),
]


def test_gsm8k_lines_give_the_final_answer_and_keep_the_reasoning(tmp_path):
    dataset = read_jsonl_dataset(write(tmp_path, GSM8K))
    assert dataset.line_format == "gsm8k"
    assert [(r.line, r.answer) for r in dataset.records] == [(1, "7"), (2, "1234")]
    assert dataset.records[1].prompt == "A car costs 1,000 and a boat 234 more. The boat?"
    assert dataset.records[1].meta == {"reasoning": "1,000 + 234 = <<1000+234=1234>>1,234"}
    task = JsonlTask(write(tmp_path, GSM8K))
    assert task.verifier_name == "math"  # the default for GSM8K files; {prompt, answer} files keep "exact"
    assert JsonlTask(write(tmp_path, GOOD)).verifier_name == "exact"
    problem = next(p for p in task.generate(2, seed=0) if p.meta["line"] == 1)
    assert problem.answer == "7" and problem.meta["reasoning"] == "3 + 4 = <<3+4=7>>7"


@pytest.mark.parametrize(
    "bad, problem",
    [
        (json.dumps({"question": "How many?"}), r"missing key\(s\) \['answer'\]"),
        (json.dumps({"question": "How many?", "answer": "3 + 4 = 7"}), "GSM8K 'answer' needs '#### <final answer>'"),
        (json.dumps({"question": "How many?", "answer": "3 + 4 = 7\n####  "}), "GSM8K 'answer' needs '####"),
        (json.dumps({"question": "", "answer": "#### 7"}), "'question' is empty"),
        (json.dumps({"question": "How many?", "answer": " "}), "'answer' is empty"),
        (json.dumps({"question": "x", "prompt": "x", "answer": "#### 7"}), "has both 'prompt' and 'question'"),
    ],
)
def test_malformed_gsm8k_line_names_its_line_number(tmp_path, bad, problem):
    path = write(tmp_path, [GSM8K[0], bad, GSM8K[1]])
    with pytest.raises(DatasetError, match=rf"data.jsonl:2: {problem}") as raised:
        read_jsonl_dataset(path)
    assert "\n" not in str(raised.value)
    assert [r.line for r in read_jsonl_dataset(path, skip_malformed=True).records] == [1, 3]


def test_a_file_mixing_line_formats_is_an_error(tmp_path):
    path = write(tmp_path, [GSM8K[0], "", GOOD[0]])
    message = (
        r"data.jsonl:3: a \{prompt, answer\} line, but line 1 is GSM8K \{question, answer\}; "
        "all lines of a file must have one format"
    )
    for skip_malformed in (False, True):  # a line of the other format is not a malformed line to skip
        with pytest.raises(DatasetError, match=message):
            read_jsonl_dataset(path, skip_malformed=skip_malformed)
