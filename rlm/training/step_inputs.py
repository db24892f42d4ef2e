"""What a micro-step reads, made on the host by a background thread while the device computes.

As soon as the loop has selected S_x for a whole accumulation window (Algorithm 2, step 2:
`rlm.training.selection.select_window`), each micro-batch's passages are read from the corpus and tokenized,
in the order the step needs them: for the passage tower g (step 3), for the reader's scoring of each passage
alone (step 4) and for the FiD reader (step 6), the last two from one tokenization where the template allows;
its rows of the fixed buffer B (step 7) are read too. The step then waits only for what is not ready yet: the
first micro-batch's passages, and whatever a slow tokenizer has not finished by the time the step reaches it;
the later micro-batches' inputs are made while the earlier ones compute.

The thread tokenizes with its own copies of the tokenizers (a fast tokenizer serves one thread at a time) and,
for a GPU, hands over page-locked tensors, so that copying them to the device does not wait for the device.
It reads nothing the device holds except the selected rows, which it copies to the host itself: the step does
not wait for that copy.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlm.data.corpus import retrieval_text
from rlm.reader.scoring import ScoringInputs, scoring_inputs, scoring_inputs_from_reader
from rlm.retriever.encoder import TokenizedTexts

if TYPE_CHECKING:
    from rlm.data.corpus import Corpus
    from rlm.reader.fid import FiDReader
    from rlm.reader.formatting import FiDCollator
    from rlm.retriever.encoder import DualEncoder
    from rlm.training.batch import Batch


@dataclass
class PassagesRead:
    """One micro-batch's S_x read from the corpus: the rows on the host, (title, text) per question (padding
    slots left out) and the retrieval text of every slot (a padding slot reads row 0; its score is masked)."""

    rows: torch.Tensor  # [B, k] corpus rows on the host, -1 padding
    passages: list[list[tuple[str, str]]]
    texts: list[str]


class PreparedPassages:
    """What steps 3-7 of one micro-batch read of its S_x, each part a future of the background thread."""

    def __init__(self, inputs: StepInputs, parts: dict[str, Future]):
        self.inputs, self.parts = inputs, parts

    def read(self) -> PassagesRead:
        return self.inputs.wait(self.parts["read"])

    def tower(self) -> TokenizedTexts:
        """g(y)'s input: the slots' retrieval texts tokenized for the passage tower."""
        return self.inputs.wait(self.parts["tower"])

    def scoring(self) -> ScoringInputs:
        """Step 4's input: each (question, passage) pair alone, with its question's answer."""
        return self.inputs.wait(self.parts["scoring"])

    def reader(self) -> dict[str, torch.Tensor]:
        """Step 6's input: the FiD reader's input_ids, attention_mask and labels over the passages it reads."""
        return self.inputs.wait(self.parts["reader"])

    def stale(self) -> torch.Tensor:
        """B_y [B, k, D] for every slot (a padding slot reads row 0), in the buffer's dtype, on the host."""
        return self.inputs.wait(self.parts["stale"])


class StepInputs:
    """The background thread of a model's training steps (one per process, started at first use) and the time
    the steps waited for it (`waited_s`, the log's `seconds_waiting_for_inputs`)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid: int | None = None
        self._copies: dict[int, Any] = {}  # id of a tokenizer (or collator) -> the thread's copy of it
        self.waited_s = 0.0

    def __getstate__(self) -> dict:
        # A copy of the model (deepcopy, pickle) starts its own thread when it needs one.
        return {"_pool": None, "_pid": None, "_copies": {}, "waited_s": self.waited_s}

    def submit(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the thread, after everything submitted before it."""
        if self._pool is None or self._pid != os.getpid():  # a forked process has no thread of its parent's
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlm-step-inputs")
            self._pid, self._copies = os.getpid(), {}
        return self._pool.submit(fn, *args)

    def wait(self, future: Future) -> Any:
        """`future`'s result, adding the time the step waited for it to `waited_s`."""
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            self.waited_s += time.perf_counter() - start

    def own(self, thing: Any, tokenizer_attribute: str | None = None) -> Any:
        """The thread's copy of a tokenizer (or of an object holding one in `tokenizer_attribute`: a collator),
        made once. Call on the thread."""
        key = id(thing)
        if key not in self._copies:
            if tokenizer_attribute is None:
                self._copies[key] = copy.deepcopy(thing)
            else:
                mine = copy.copy(thing)
                setattr(mine, tokenizer_attribute, self.own(getattr(thing, tokenizer_attribute)))
                self._copies[key] = mine
        return self._copies[key]

    def prepare_passages(
        self,
        retriever: DualEncoder,
        reader: FiDReader,
        collator: FiDCollator,
        corpus: Corpus,
        buffer,
        batch: Batch,
        rows: torch.Tensor,
        reader_passages: int | None,
        scored: bool,
    ) -> PreparedPassages:
        """Queue what micro-batch `batch`'s steps read of its S_x `rows` [B, k] (on any device), for the model's
        towers, reader and collator: the passages, the FiD reader's input over the first `reader_passages` of
        each (None: all) and, when `scored` (the retriever trains at this step), the passage tower's and the
        scoring pass's inputs and B_y (from the fixed `buffer`)."""
        questions, answers = batch.questions, batch.answers
        device = retriever.passage_tower.device
        pin = device.type == "cuda" and torch.cuda.is_available()  # nothing to pin for on a CPU
        # With a template that does not name `{rank}`, a pair's text for scoring is its slot's for the FiD
        # reader: one tokenization serves both (a third of the thread's work at the paper's shapes).
        shared = (
            scored
            and reader.collator is collator
            and "{rank}" not in collator.template
            and reader_passages is None
        )
        read = self.submit(_read_passages, corpus, rows)
        parts = {"read": read}

        def tower_inputs() -> TokenizedTexts:
            tower = retriever.passage_tower
            own = self.own(tower.tokenizer)
            return tower.tokenize_for_embedding(read.result().texts, tokenizer=own, pin=pin)

        def reader_inputs() -> dict[str, torch.Tensor]:
            passages = read.result().passages
            read_ = passages if reader_passages is None else [p[:reader_passages] for p in passages]
            inputs = self.own(collator, "tokenizer")(questions, read_, answers)
            inputs = {k: inputs[k] for k in ("input_ids", "attention_mask", "labels")}
            return {k: v.pin_memory() for k, v in inputs.items()} if pin else inputs

        def scoring() -> ScoringInputs:
            passages = read.result().passages
            cut = scoring_inputs_from_reader(parts["reader"].result(), passages) if shared else None
            if cut is None:
                cut = scoring_inputs(self.own(reader.collator, "tokenizer"), questions, passages, answers)
            return cut.pinned(pin)

        def stale() -> torch.Tensor:
            found = buffer.rows(read.result().rows.clamp_min(0))
            return found.pin_memory() if pin else found

        # In the order the step reads them (step 3, 4, 6, 7); scoring after the FiD inputs it is cut from.
        order = ("tower", "reader", "scoring", "stale") if shared else ("tower", "scoring", "reader", "stale")
        jobs = {"tower": tower_inputs, "scoring": scoring, "reader": reader_inputs, "stale": stale}
        for name in order:
            if scored or name == "reader":
                parts[name] = self.submit(jobs[name])
        return PreparedPassages(self, parts)


def _read_passages(corpus: Corpus, rows: torch.Tensor) -> PassagesRead:
    """S_x read from the corpus, each passage once (on the background thread: the copy of `rows` to the host
    waits for the selection to finish here, not in the step)."""
    host = rows.to("cpu")
    passages, texts = [], []
    for row in host.tolist():
        found = [corpus[r] if r >= 0 else None for r in row]
        passages.append([(p.title, p.text) for p in found if p is not None])
        for passage in found:
            # A padding slot reads row 0, as its buffer row does; its scores are masked out.
            passage = passage if passage is not None else corpus[0]
            texts.append(retrieval_text(passage.title, passage.text))
    return PassagesRead(host, passages, texts)
