import json

import pytest

from flexmarl_jax.workflows.dataset import DatasetError, JsonlTask, read_jsonl_records
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
    with pytest.raises(ValueError, match="unknown verifier 'regex'"):
        JsonlTask(write(tmp_path, GOOD), verifier="regex")
