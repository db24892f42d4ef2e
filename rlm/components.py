"""Build what a run needs from its config: data, retriever, reader, corrector and the fixed buffer B.

Order matters for the buffer: B is built (or verified) with the *initial* passage tower, before any
checkpoint is loaded, so a resumed run checks its buffer against the same encoder fingerprint it was built with.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from rlm.config import STRATEGY_FACTS, ReaderConfig, TrainConfig
from rlm.data.buffer_edition import check_one_edition, corpus_of_buffer, grown_buffer
from rlm.data.corpus import Corpus, load_corpus
from rlm.data.corpus_edition import CorpusEdition
from rlm.data.qa import QAExample, QASplit, dataset_name, load_qa_split
from rlm.data.splits import check_training_splits
from rlm.errors import UserError
from rlm.reader.fid import FiDConfig, FiDReader
from rlm.reader.formatting import FiDCollator
from rlm.reader.small_t5 import SmallT5Config
from rlm.reader.tokenizer import load_tokenizer, train_tokenizer
from rlm.retriever.buffer import PassageBuffer, build_passage_buffer
from rlm.retriever.corrector import CorrectorNetwork
from rlm.retriever.distributed import Processes
from rlm.retriever.encoder import DualEncoder, default_retriever_path


@dataclass
class Components:
    corpus: Corpus
    train_examples: list[QAExample]
    dev_examples: list[QAExample]
    retriever: DualEncoder
    reader: FiDReader | None
    collator: FiDCollator | None
    corrector: CorrectorNetwork | None
    buffer: PassageBuffer
    # What each split is (`QASplit.record`: dataset, split, questions, source), for summary.json and the card.
    data_splits: dict = field(default_factory=dict)


def resolve_data(cfg: TrainConfig) -> tuple[str, str | None, str | None]:
    """(corpus path, train dataset path, dev dataset path); generates the toy world when it is the source."""
    data = cfg.data
    uses_toy = data.corpus is None or "toy" in (data.train, data.dev)
    toy_dir = None
    if uses_toy:
        from rlm.data.toy_world import build_toy_world

        toy_dir = Path(data.toy_world.dir)
        if not (toy_dir / "world.json").exists():  # written last: a half-built world is rebuilt
            build_toy_world(
                toy_dir,
                num_passages=data.toy_world.num_passages,
                seed=data.toy_world.seed,
                **data.toy_world.options,
            )
    corpus = data.corpus or str(toy_dir / "corpus.jsonl")

    def dataset_path(name: str | None, local: str | None) -> str | None:
        return local if local is not None else str(toy_dir) if name == "toy" else None

    return corpus, dataset_path(data.train, data.train_path), dataset_path(data.dev, data.dev_path)


def load_split(name: str, split: str, path: str | None, limit: int | None) -> QASplit:
    """A run's questions: `name` a registry name (a local layout at `path`, else the hub) or a JSONL file."""
    if Path(name).suffix == ".jsonl" or Path(name).is_file():
        return load_qa_split("jsonl", split, name).limited(limit)
    return load_qa_split(name, split, path).limited(limit)


def load_examples(name: str, split: str, path: str | None, limit: int | None) -> list[QAExample]:
    return load_split(name, split, path, limit).examples


def build_reader(cfg: TrainConfig, corpus: Corpus, examples: list[QAExample], accelerator=None) -> FiDReader:
    """A saved / HF reader when `reader.path` is set; else the small T5 with a tokenizer trained on this data.

    `accelerator`: the run's processes, which all call this (`reader_tokenizer` waits for the main one)."""
    rc = cfg.reader
    lengths = {"max_passage_length": rc.max_passage_length, "max_answer_length": rc.max_answer_length}
    template = {"template": rc.template} if rc.template else {}
    fid_config = FiDConfig(**lengths, **template)
    if rc.path:
        try:
            with main_process_first(accelerator):
                return FiDReader.from_pretrained(rc.path, **lengths, **template)
        except OSError as err:  # transformers' "can't reach the hub / not a folder"
            raise FileNotFoundError(
                f"reader.path={rc.path!r} could not be loaded ({str(err).splitlines()[0]}); offline, point "
                "reader.path at a local model folder, or unset it to train the small T5 built from reader.*"
            ) from err
    if rc.arch == "warm_start":
        with main_process_first(accelerator):
            return build_warm_started_reader(rc, fid_config, seed=cfg.seed)
    tokenizer = reader_tokenizer(cfg, corpus, examples, accelerator)
    model_config = SmallT5Config(
        d_model=rc.d_model,
        d_ff=rc.d_ff,
        num_layers=rc.num_layers,
        num_decoder_layers=rc.num_decoder_layers,
        num_heads=rc.num_heads,
        d_kv=rc.d_kv,
        dropout_rate=rc.dropout_rate,
    )
    return FiDReader.from_config(tokenizer, model_config, fid_config, seed=cfg.seed)


def reader_tokenizer(cfg: TrainConfig, corpus: Corpus, examples: list[QAExample], accelerator=None):
    """The small T5's tokenizer: `rlm.reader.tokenizer`, else the run's own in `<output_dir>/tokenizer`.

    The run's own is trained on its passages, questions and answers by the main process alone, which saves it
    as one folder renamed into place; the other processes wait for it and load it, so every process reads
    with the same vocabulary and no two write the same files. A resumed run keeps the one it started with.
    """
    if cfg.reader.tokenizer:
        return load_tokenizer(cfg.reader.tokenizer)
    tok_dir = Path(cfg.output_dir) / "tokenizer"
    trained = None
    if (accelerator is None or accelerator.is_main_process) and not (tok_dir / "tokenizer.json").exists():
        texts = [f"{p.title} {p.text}" for p in corpus]
        texts += [ex.question for ex in examples] + [a for ex in examples for a in ex.answers]
        trained = train_tokenizer(texts, vocab_size=cfg.reader.vocab_size, save_dir=tok_dir)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return trained if trained is not None else load_tokenizer(tok_dir)


def build_warm_started_reader(rc: ReaderConfig, fid_config: FiDConfig, seed: int) -> FiDReader:
    """FiD over the first `rc.warm_start.layers` pretrained encoder layers + a fresh decoder (`reader.arch:
    warm_start`); the encoder's own WordPiece tokenizer, so no tokenizer is trained or saved for the run."""
    from rlm.reader.warm_start import WarmStartConfig, build_warm_started_encoder_decoder

    encoder_path = rc.warm_start.path or default_retriever_path()
    warm = WarmStartConfig(
        encoder_layers=rc.warm_start.layers,
        decoder_layers=rc.num_decoder_layers,
        decoder_heads=rc.num_heads,
        decoder_ff=rc.d_ff,
        decoder_dropout=rc.dropout_rate,
        freeze_embeddings=rc.warm_start.freeze_embeddings,
    )
    model, tokenizer = build_warm_started_encoder_decoder(encoder_path, warm, seed=seed)
    return FiDReader(model, tokenizer, fid_config)


def buffer_folder(cfg: TrainConfig) -> Path:
    """Where the run's buffer B lives: `buffer.dir`, else `<output_dir>/buffer`."""
    return Path(cfg.buffer.dir or Path(cfg.output_dir) / "buffer")


def load_or_build_buffer(
    cfg: TrainConfig, retriever: DualEncoder, corpus: Corpus | CorpusEdition, accelerator=None, check=None
) -> PassageBuffer:
    """B = g(y; Theta_0) for every passage: loaded and verified when it exists, built once otherwise; grown
    by the rows corpus updates appended when `corpus` is the edition they made (`rlm.data.buffer_edition`).

    The corpus fingerprint is the one its scan computed (`Corpus.fingerprint`), so a start costs no pass over
    the passages.
    """
    buffer_dir = buffer_folder(cfg)
    tower = retriever.passage_tower
    base = corpus.base if isinstance(corpus, CorpusEdition) else corpus
    if (buffer_dir / "meta.json").exists():
        buffer = PassageBuffer.load(
            buffer_dir,
            encoder_fingerprint=tower.fingerprint(),
            corpus_fingerprint=base.fingerprint,
        )
    else:
        buffer = build_passage_buffer(
            base.ids,
            base.retrieval_texts(),
            tower,
            buffer_dir,
            batch_size=cfg.buffer.batch_size,
            dtype=cfg.buffer.dtype,
            accelerator=accelerator,
            corpus_fingerprint=base.fingerprint,
            check=check,  # a stop signal ends the build between batches; a rerun resumes it
        )
    if len(buffer) != len(base):
        raise UserError(f"buffer {buffer_dir} has {len(buffer)} rows but the corpus has {len(base)}")
    return grown_buffer(buffer, corpus)


def build_retriever(cfg: TrainConfig) -> DualEncoder:
    """The starting dual encoder with the config's lengths and dropout, as training uses it."""
    retriever = DualEncoder.from_towers(
        cfg.retriever.path or default_retriever_path(),
        query_path=cfg.retriever.query_path,
        shared=cfg.retriever.shared_towers,
    )
    retriever.query_tower.max_length = cfg.retriever.query_max_length
    if not retriever.shared:
        retriever.passage_tower.max_length = cfg.retriever.passage_max_length
    if cfg.retriever.dropout is not None:
        for tower in {id(t): t for t in (retriever.query_tower, retriever.passage_tower)}.values():
            tower.set_dropout(cfg.retriever.dropout)
    if cfg.retriever.gradient_checkpointing:
        # Only train mode with gradient recomputes: building B (eval, no gradient) runs as before.
        retriever.gradient_checkpointing_enable()
    return retriever


def starting_passage_tower(checkpoint: str | Path):
    """g0: the passage tower the run that wrote `checkpoint` started from, rebuilt from its config (what built
    its fixed buffer B)."""
    from rlm.config import load_config

    return build_retriever(load_config(Path(checkpoint) / "config.yaml")).passage_tower


def check_splits(cfg: TrainConfig) -> None:
    """`check_training_splits` on the run's datasets, by their registry names (a file is its own name)."""
    data = cfg.data

    def registry_name(name: str | None) -> str | None:
        if name is None or Path(name).suffix == ".jsonl" or Path(name).is_file():
            return name
        return dataset_name(name)

    check_training_splits(
        registry_name(data.train), data.train_split, registry_name(data.dev), data.dev_split
    )


def load_train_split(cfg: TrainConfig) -> QASplit:
    """The run's training questions (`data.train`, `data.train_split`, at most `data.max_train_examples`)."""
    _, train_path, _ = resolve_data(cfg)
    data = cfg.data
    check_splits(cfg)
    return load_split(data.train, data.train_split, train_path, data.max_train_examples)


def load_dev_split(cfg: TrainConfig) -> QASplit | None:
    """The run's dev questions (`data.dev`, `data.dev_split`, at most `data.max_dev_examples`); None without
    `data.dev`. Never a test set: training validates on dev only (`check_training_splits`)."""
    _, _, dev_path = resolve_data(cfg)
    data = cfg.data
    if not data.dev:
        return None
    check_splits(cfg)
    return load_split(data.dev, data.dev_split, dev_path, data.max_dev_examples)


def load_train_examples(cfg: TrainConfig) -> list[QAExample]:
    return load_train_split(cfg).examples


def load_dev_examples(cfg: TrainConfig) -> list[QAExample]:
    dev = load_dev_split(cfg)
    return [] if dev is None else dev.examples


def build_components(cfg: TrainConfig, accelerator=None, check=None) -> Components:
    if accelerator is not None:
        with accelerator.main_process_first():  # a toy world is generated once, then read by the others
            resolve_data(cfg)
    # Every process scans the corpus; the main one alone hashes it (`load_corpus`).
    procs = Processes.of(accelerator)
    # The corpus as the updates applied to the buffer left it (`rlm corpus update --buffer`), else as it is.
    corpus = corpus_of_buffer(buffer_folder(cfg), load_corpus(resolve_data(cfg)[0], procs=procs))
    check_one_edition(procs, corpus, buffer_folder(cfg))
    train_split, dev_split = load_train_split(cfg), load_dev_split(cfg)
    train_examples, dev_examples = train_split.examples, [] if dev_split is None else dev_split.examples
    data_splits = {"train": train_split.record(), **({"dev": dev_split.record()} if dev_split else {})}
    if cfg.algorithm == 1:
        # One (question, gold passage) pair per gold passage that is in the corpus. The pair's label goes
        # first and the question's other gold passages follow it: make_batch keeps those out of the
        # question's negatives (a multi-hop question's second passage is relevant, not a negative).
        train_examples = [
            QAExample(ex.id, ex.question, ex.answers, [gid] + [o for o in golds if o != gid], ex.meta)
            for ex in train_examples
            for golds in [[g for g in ex.gold_passage_ids if _in_corpus(corpus, g)]]
            for gid in golds
        ]
        if not train_examples:
            raise UserError(
                "algorithm 1 needs training questions with gold passage ids that are in the corpus"
            )

    with main_process_first(accelerator):
        retriever = build_retriever(cfg)
    buffer = load_or_build_buffer(cfg, retriever, corpus, accelerator, check)

    reader = collator = None
    if cfg.algorithm == 2:
        reader = build_reader(cfg, corpus, train_examples, accelerator)
        collator = reader.collator  # carries the reader's own template and lengths (fid_config.json)
    corrector = None
    if STRATEGY_FACTS[cfg.strategy.name].uses_corrector:
        dim = buffer.dim
        corrector = CorrectorNetwork(
            dim,
            cfg.corrector.hidden_dim or cfg.corrector.hidden_mult * dim,
            cfg.corrector.num_hidden_layers,
            linear=cfg.corrector.linear,
        )
    return Components(
        corpus, train_examples, dev_examples, retriever, reader, collator, corrector, buffer, data_splits
    )


def main_process_first(accelerator):
    """The main process runs the block before the others: a model it downloads from the hub lands in the cache
    the others then read, instead of every process downloading into it at once. No accelerator: the block."""
    return contextlib.nullcontext() if accelerator is None else accelerator.main_process_first()


def _in_corpus(corpus: Corpus, passage_id: str) -> bool:
    try:
        corpus.index_of(passage_id)
    except KeyError:
        return False
    return True
