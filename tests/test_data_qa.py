import json

import pytest

from rlm.data.qa import DATASETS, load_qa_dataset, read_qa_jsonl
from rlm.errors import UserError


def test_registry_names():
    assert set(DATASETS) >= {"nq_open", "trivia_qa", "hotpot_qa", "jsonl", "multihop200", "toy"}


def test_nq_open_local_layout(shared_data):
    dev = load_qa_dataset("nq_open", "test", shared_data / "nq_open")  # Google's NQ-open.dev.jsonl
    assert len(dev) == 3610
    assert dev[0].question == "when was the last time anyone was on the moon"
    assert dev[0].answers == ["14 December 1972 UTC", "December 1972"]
    assert dev[0].gold_passage_ids == [] and len({e.id for e in dev}) == 3610
    eqa = load_qa_dataset("nq_open", "efficientqa.test.1.1", shared_data / "nq_open")
    assert len(eqa) == 1769 and "def_correct_predictions" in eqa[0].meta


def test_multihop200_and_hotpot_local(shared_data):
    qa = load_qa_dataset("multihop200", "dev", shared_data / "multihop200")
    assert len(qa) == 200
    assert qa[0].gold_passage_ids == ["hotpotqa_5", "hotpotqa_9"] and qa[0].meta["type"] == "bridge"
    hotpot = load_qa_dataset("hotpot_qa", "validation", shared_data / "multihop200")
    assert len(hotpot) == 100 and all(e.meta["dataset"] == "hotpotqa" for e in hotpot)


@pytest.mark.parametrize(
    "name, split", [("nq_open", "validation"), ("trivia_qa", "dev"), ("hotpot_qa", "dev")]
)
def test_hub_datasets_offline_point_to_local_layout(name, split):
    with pytest.raises(ValueError, match=rf"could not load the hub dataset '{name}'.*pass path="):
        load_qa_dataset(name, split)


def test_jsonl_dataset_and_errors(tmp_path):
    good = tmp_path / "q.jsonl"
    good.write_text(json.dumps({"question": "q?", "answers": "a", "extra": 1}) + "\n\n")
    [ex] = load_qa_dataset("jsonl", "test", good)
    assert ex.answers == ["a"] and ex.meta == {"extra": 1} and ex.id.startswith("q1-")
    cases = {
        '{"question": "q"}': r"q\.jsonl:1: no 'answers'",
        '{"question": "q", "answers": [1]}': r"q\.jsonl:1: answers must be",
        "{oops": r"q\.jsonl:1: malformed JSON",
        '{"answers": ["a"]}': r"q\.jsonl:1: expected a JSON object with a 'question'",
    }
    for line, message in cases.items():
        good.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            read_qa_jsonl(good)
    good.write_text('{"id": "x", "question": "q", "answers": ["a"]}\n' * 2)
    with pytest.raises(ValueError, match="duplicate question id 'x' on lines 1 and 2"):
        read_qa_jsonl(good)
    with pytest.raises(ValueError, match="unknown QA dataset"):
        load_qa_dataset("squad", "dev")
    with pytest.raises(ValueError, match="rlm toy-world"):
        load_qa_dataset("toy", "dev")


def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_bytes(b'{"question": "q?", "answers": ["a"]}\n\n{"question": "caf\xe9?", "answers": ["b"]}\n')
    with pytest.raises(UserError, match=r"q\.jsonl:3: not UTF-8 \(byte 0xe9 at offset 17 of the line\)"):
        load_qa_dataset("jsonl", "train", path)


@pytest.mark.parametrize("answers", [[], "", ["", " "]])
def test_a_question_without_an_answer_is_refused_at_load(tmp_path, answers):
    path = tmp_path / "train.jsonl"
    lines = [{"question": "q1?", "answers": ["a"]}, {"question": "q2?", "answers": answers}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(UserError, match=r"train\.jsonl:2: the question has no answer"):
        load_qa_dataset("jsonl", "train", tmp_path)
    # A file of unanswerable questions says so: there an empty list is the label.
    assert [q.question for q in read_qa_jsonl(path, allow_empty_answers=True)] == ["q1?", "q2?"]


def test_toy_unanswerable_splits_still_load_with_empty_answers(tmp_path):
    from rlm.data.toy_world import build_toy_world

    world = build_toy_world(tmp_path / "toy", num_passages=150, seed=0)
    unanswerable = load_qa_dataset("toy", "dev_unanswerable", world.root)
    assert unanswerable and all(q.answers == [] for q in unanswerable)
    assert all(q.answers for q in load_qa_dataset("toy", "dev", world.root))
