"""Turn questions, retrieved passages and answers into the padded tensors a FiD reader consumes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from rlm.reader.errors import InputError

DEFAULT_TEMPLATE = "question: {question} title: {title} context: {text}"
# A template may also name `{rank}`: the passage's 1-based place in the list it came in (the retriever's
# order). Scoring a passage alone (`rlm.reader.scoring.score_passages`, step 4 of Algorithm 2) reads every passage
# as rank 1, so the relevance labels that train the retriever never depend on its own ranking.
RANKED_TEMPLATE = "question: {question} rank: {rank} title: {title} context: {text}"
# What the encoder reads for a question with no passage (closed book, or fewer passages than the batch's K).
DEFAULT_QUESTION_TEMPLATE = "question: {question}"

Passages = Sequence[Sequence[tuple[str, str]]]


class FiDCollator:
    """Tokenize (question, passage) pairs into `[B, K, L]` tensors with per-passage truncation.

    Slots: K = the largest number of passages of any question in the batch, at least 1. A question with fewer
    passages has its missing slots fully masked (all-zero attention rows: they influence nothing). A question
    with no passage at all (and every question when K would be 0, i.e. closed book) has its question alone,
    formatted with `question_template`, in slot 0, so the decoder always has something to attend to.
    `passage_mask [B, K]` marks the slots that hold a real passage.

    Labels are the answer followed by the tokenizer's eos token, right-padded with -100 and truncated to
    `max_answer_length` tokens (the eos is kept).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_passage_length: int = 192,
        max_answer_length: int = 32,
        template: str = DEFAULT_TEMPLATE,
        question_template: str = DEFAULT_QUESTION_TEMPLATE,
    ):
        for name, tpl, fields in (
            ("template", template, ("{question}", "{text}")),
            ("question_template", question_template, ("{question}",)),
        ):
            missing = [f for f in fields if f not in tpl]
            if missing:
                raise InputError(f"{name} {tpl!r} lacks the field(s) {', '.join(missing)}")
            try:
                tpl.format(question="", title="", text="", rank=1)
            except (KeyError, IndexError, ValueError) as err:
                raise InputError(
                    f"{name} {tpl!r} does not format ({type(err).__name__}: {err}); its fields are "
                    "{question}, {title}, {text} and {rank}"
                ) from None
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer needs pad and eos tokens; load it with rlm.reader.tokenizer.load_tokenizer"
            )
        if max_passage_length < 2 or max_answer_length < 1:
            raise InputError(
                f"max_passage_length={max_passage_length} and max_answer_length={max_answer_length} are too small"
            )
        self.tokenizer = tokenizer
        self.max_passage_length = max_passage_length
        self.max_answer_length = max_answer_length
        self.template = template
        self.question_template = question_template

    def format_passage(self, question: str, title: str, text: str, rank: int = 1) -> str:
        """The string the encoder reads for one (question, passage) pair; `rank` fills `{rank}`, if named."""
        return self.template.format(question=question, title=title, text=text, rank=rank)

    def format_question(self, question: str) -> str:
        """The string the encoder reads for a question without passages."""
        return self.question_template.format(question=question)

    def __call__(
        self,
        questions: Sequence[str],
        passages: Passages,
        answers: Sequence[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Return `input_ids`, `attention_mask` `[B, K, L]`, `passage_mask [B, K]` and `labels [B, T]`.

        `passages[b]` is a list of (title, text) for question b (lists may differ in length); `labels` is
        present only when `answers` is given.
        """
        if not questions:
            raise ValueError("empty batch: FiDCollator needs at least one question")
        if len(passages) != len(questions):
            raise ValueError(f"{len(questions)} questions but {len(passages)} passage lists")
        if answers is not None and len(answers) != len(questions):
            raise ValueError(f"{len(questions)} questions but {len(answers)} answers")
        num_slots = max([len(p) for p in passages] + [1])
        texts: list[str] = []
        slots: list[tuple[int, int]] = []
        for b, (question, plist) in enumerate(zip(questions, passages)):
            if not plist:
                texts.append(self.format_question(question))
                slots.append((b, 0))
            for k, (title, text) in enumerate(plist):
                texts.append(self.format_passage(question, title, text, rank=k + 1))
                slots.append((b, k))

        enc = self.tokenizer(
            texts, truncation=True, max_length=self.max_passage_length, padding="longest", return_tensors="pt"
        )
        length = enc["input_ids"].shape[1]
        batch = len(questions)
        input_ids = torch.full((batch, num_slots, length), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, num_slots, length), dtype=torch.long)
        passage_mask = torch.zeros((batch, num_slots), dtype=torch.bool)
        rows = torch.tensor([b for b, _ in slots], dtype=torch.long)
        cols = torch.tensor([k for _, k in slots], dtype=torch.long)
        input_ids[rows, cols] = enc["input_ids"]
        attention_mask[rows, cols] = enc["attention_mask"]
        for b, plist in enumerate(passages):
            passage_mask[b, : len(plist)] = True

        out = {"input_ids": input_ids, "attention_mask": attention_mask, "passage_mask": passage_mask}
        if answers is not None:
            out["labels"] = self.encode_answers(answers)
        return out

    def encode_answers(self, answers: Sequence[str]) -> torch.Tensor:
        """Answer token ids + eos, `[B, T]`, padded with -100 (ignored by the loss)."""
        eos = self.tokenizer.eos_token_id
        ids = self.tokenizer(list(answers), add_special_tokens=False)["input_ids"]
        seqs = [s[: self.max_answer_length - 1] + [eos] for s in ids]
        length = max(len(s) for s in seqs) if seqs else 1
        labels = torch.full((len(seqs), length), -100, dtype=torch.long)
        for i, s in enumerate(seqs):
            labels[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return labels
