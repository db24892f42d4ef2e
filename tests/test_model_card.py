"""`final/` as a release: its model card (`README.md`, Hugging Face's format) and each part opened by its own
library, with nothing of this project on the loading side: the towers in sentence-transformers, the reader in
transformers, and the card's own code blocks, which a stranger would copy.

One tiny training run (tests/tiny_run.py's, with a dev set) writes the `final/` every test reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from tiny_run import tiny_overrides

QUESTIONS_READ = 3  # dev questions each reading test answers

pytestmark = pytest.mark.usefixtures("fresh_accelerator_state")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 3-step Algorithm 2 run with the corrector and a dev set: its run folder."""
    from accelerate.state import AcceleratorState

    from rlm.config import load_config
    from rlm.training.loop import train

    root = tmp_path_factory.mktemp("model_card")
    extra = ["cpu=true", "save_every=0", "optim.max_steps=3", "data.dev=toy", "data.max_dev_examples=6"]
    AcceleratorState._reset_state(reset_partial_state=True)  # module-scoped: before the per-test reset
    train(load_config(None, tiny_overrides(root, "run", *extra)))
    AcceleratorState._reset_state(reset_partial_state=True)
    return root / "run"


def toy_world(run: Path) -> Path:
    return Path(yaml.safe_load((run / "config.yaml").read_text())["data"]["toy_world"]["dir"])


def dev_questions(run: Path) -> list[dict]:
    lines = (toy_world(run) / "dev.jsonl").read_text().splitlines()[:QUESTIONS_READ]
    return [json.loads(line) for line in lines]


def corpus_passages(run: Path, count: int) -> list[tuple[str, str]]:
    """(title, text) of the toy corpus's first `count` passages, read as a stranger would: plain JSON lines."""
    rows = [json.loads(line) for line in (toy_world(run) / "corpus.jsonl").read_text().splitlines()[:count]]
    return [(row.get("title", ""), row["text"]) for row in rows]


def test_final_carries_a_model_card_with_the_hub_metadata_and_the_runs_figures(run):
    from huggingface_hub import ModelCard

    from rlm.config import load_config
    from rlm.retriever.encoder import SentenceEncoder

    final = run / "final"
    card = ModelCard.load(final / "README.md")
    summary = json.loads((run / "summary.json").read_text())
    data = card.data
    assert data.library_name and data.datasets == ["toy"]
    for tag in ("retrieval-augmented-generation", "fusion-in-decoder", "sentence-transformers"):
        assert tag in data.tags
    assert {"exact_match", "f1", "recall"} <= set(data.metrics)
    results = {(r.metric_type, r.metric_name): r for r in data.eval_results}
    exact_match = results["exact_match", "Exact match"]
    assert exact_match.metric_value == pytest.approx(100 * summary["dev_exact_match"], abs=0.01)
    assert (exact_match.dataset_name, exact_match.dataset_split) == ("toy", "dev")
    recall = results["recall", "Answer recall@20"].metric_value
    assert recall == pytest.approx(100 * summary["dev_recall@20"], abs=0.01)

    body = card.text
    # The figures name the split they are on and its size (the dev set capped at data.max_dev_examples).
    dev = summary["data"]["dev"]
    assert (dev["dataset"], dev["split"], dev["questions"]) == ("toy", "dev", 6) and dev["of_questions"] > 6
    assert f"- dev questions: `toy`, split `dev`, 6 of {dev['of_questions']:,} questions" in body
    assert "on `toy` / `dev` (6 questions)" in body
    assert summary["data"]["train"]["split"] == "train" and summary["data"]["train"]["questions"] > 0
    assert "Algorithm 2" in body and "corrector" in body and "`config.yaml`" in body
    assert f"NLL over the top {load_config(run / 'config.yaml').reader_passages} passages" in body
    assert (final / "config.yaml").read_text() == (run / "config.yaml").read_text()
    buffer_meta = json.loads((run.parent / "buffer" / "meta.json").read_text())
    for fingerprint in (
        SentenceEncoder.from_pretrained(str(final / "retriever" / "passage_tower")).fingerprint(),
        SentenceEncoder.from_pretrained(str(final / "retriever" / "query_tower")).fingerprint(),
        buffer_meta["corpus_fingerprint"],
        buffer_meta["encoder_fingerprint"],  # the initial passage tower, which built B
    ):
        assert f"`{fingerprint}`" in body
    assert f"optimizer steps: {summary['steps']}" in body
    assert f"passages re-embedded during training (the paper's cost axis): {summary['reembedded']:,}" in body
    assert f"{buffer_meta['count']} passages" in body  # the corpus's size, beside its path


def test_the_towers_open_in_sentence_transformers_with_the_projects_embeddings(run):
    from sentence_transformers import SentenceTransformer

    from rlm.retriever.encoder import SentenceEncoder

    texts = [q["question"] for q in dev_questions(run)] + [f"{t}. {x}" for t, x in corpus_passages(run, 3)]
    for tower in ("query_tower", "passage_tower"):
        folder = str(run / "final" / "retriever" / tower)
        theirs = torch.from_numpy(
            SentenceTransformer(folder, device="cpu").encode(texts, normalize_embeddings=True)
        )
        ours = SentenceEncoder.from_pretrained(folder).encode(texts)
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
        torch.testing.assert_close(theirs.norm(dim=-1), torch.ones(len(texts)))


def test_the_reader_opens_in_transformers_and_reads_one_passage_as_the_fid_reader(run):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from rlm.reader.fid import FiDReader

    folder = run / "final" / "reader"
    plain = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    fid = json.loads((folder / "fid_config.json").read_text())
    ours = FiDReader.from_pretrained(folder).eval()
    (title, text), *_ = corpus_passages(run, 1)
    for example in dev_questions(run):
        string = fid["template"].format(question=example["question"], title=title, text=text, rank=1)
        batch = tokenizer(
            [string], truncation=True, max_length=fid["max_passage_length"], return_tensors="pt"
        )
        labels = tokenizer([example["answers"][0]], return_tensors="pt")["input_ids"]
        fid_batch = ours.collator([example["question"]], [[(title, text)]], [example["answers"][0]])
        with torch.no_grad():
            logits = plain(**batch, labels=labels).logits
            expected = ours(**fid_batch).logits
            generated = plain.generate(**batch, max_new_tokens=fid["max_answer_length"])
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        answer = tokenizer.decode(generated[0], skip_special_tokens=True).strip()
        assert answer == ours.answer([example["question"]], [[(title, text)]])[0]


def test_the_cards_code_retrieves_and_reads_k_passages_as_the_project_does(run, monkeypatch):
    """The card's Python blocks, run as written from the run folder, rank passages as the project's towers do
    and answer from K fused passages as FiDReader does (K > 1: Fusion-in-Decoder, not one passage)."""
    from rlm.config import load_config
    from rlm.reader.fid import FiDReader
    from rlm.retriever.encoder import DualEncoder

    blocks = re.findall(r"```python\n(.*?)```", (run / "final" / "README.md").read_text(), flags=re.S)
    assert len(blocks) == 2
    monkeypatch.chdir(run)  # the blocks name final/ from the folder that holds it
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)

    passages = corpus_passages(run, 20)
    retriever = DualEncoder.from_pretrained(str(run / "final" / "retriever"))
    reader = FiDReader.from_pretrained(run / "final" / "reader").eval()
    k = load_config(run / "config.yaml").reader_passages  # the K the reader was trained on
    assert k > 1
    # What the card's reader decodes from: a few steps' reader may answer alike whatever it reads, so the fused
    # encoder states and mask it hands to generate are compared with FiDReader's, beside the answers.
    handed = {}
    plain, generate = namespace["reader"], namespace["reader"].generate
    monkeypatch.setattr(plain, "generate", lambda **kwargs: handed.update(kwargs) or generate(**kwargs))
    for example in dev_questions(run):
        question = example["question"]
        top = namespace["retrieve"](question, passages, k)
        scores = (
            retriever.query_tower.encode([question])
            @ retriever.passage_tower.encode([f"{t}. {x}" if t else x for t, x in passages]).T
        )
        assert top == [passages[i] for i in scores[0].topk(k).indices.tolist()]

        answer = namespace["answer"](question, top)
        batch = reader.collator([question], [top])
        with torch.no_grad():
            states, mask = reader.encode(batch["input_ids"], batch["attention_mask"])
        assert handed["encoder_outputs"].last_hidden_state.shape == states.last_hidden_state.shape
        torch.testing.assert_close(
            handed["encoder_outputs"].last_hidden_state, states.last_hidden_state, atol=1e-5, rtol=0
        )
        assert torch.equal(handed["attention_mask"], mask)
        assert handed["max_new_tokens"] == reader.config.max_answer_length
        assert answer == reader.answer([question], [top])[0]
