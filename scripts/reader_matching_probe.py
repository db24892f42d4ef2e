"""Probe (issue 27): can the quickstart's small FiD reader learn to pick the gold passage among distractors?

A reader-only loop outside `rlm train`; docs/results/reader_name_matching.md has the runs and what they say.
Worlds are generated under --work (the quickstart world, and a larger reader-only world).
"""

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from reader.fid import FiDConfig, FiDReader
from reader.small_t5 import SmallT5Config
from reader.tokenizer import train_tokenizer
from rlm.data.corpus import load_corpus
from rlm.data.qa import read_qa_jsonl
from rlm.data.toy_world import build_toy_world
from rlm.inference.metrics import exact_match

MARK = False
WORK = "runs/reader_probe"
OPTS = dict(
    num_cities=24,
    question_types=["born_in", "occupation", "located_in"],
    filler_rate=0.0,
    twin_rate=0.0,
    kin_facts=5,
    mentions_per_person=0,
    split_fractions=[0.7, 0.2, 0.1],
)


def world(d, n, seed, **over):
    d = Path(d)
    if not (d / "world.json").exists():
        build_toy_world(d, num_passages=n, seed=seed, **{**OPTS, **over})
    return d


class Sets:
    def __init__(self, d, split):
        self.corpus = load_corpus(d / "corpus.jsonl")
        self.qs = read_qa_jsonl(d / f"{split}.jsonl")
        allq = []
        for s in ("train", "dev", "test"):
            if (d / f"{s}.jsonl").exists():
                allq += read_qa_jsonl(d / f"{s}.jsonl")
        self.by_title = defaultdict(list)
        for i in range(len(self.corpus)):
            self.by_title[self.corpus[i].title].append(i)
        self.by_type = defaultdict(list)
        for q in allq:
            self.by_type[q.meta["type"]].append(self.corpus.index_of(q.gold_passage_ids[0]))

    def passages(self, q, k, rng, p_title=0.5):
        g = self.corpus.index_of(q.gold_passage_ids[0])
        same = [r for r in self.by_title[q.meta["subject"]] if r != g]
        chosen = {g}
        rows = [g]
        while len(rows) < k:
            pool = same if rng.random() < p_title else self.by_type[q.meta["type"]]
            r = rng.choice(pool)
            if r not in chosen:
                chosen.add(r)
                rows.append(r)
        rng.shuffle(rows)
        self.last_gold = rows.index(g)
        if MARK:
            return [(("MATCH " if r == g else "") + self.corpus[r].title, self.corpus[r].text) for r in rows]
        return [(self.corpus[r].title, self.corpus[r].text) for r in rows]


def remap_cities(rw, main_w):
    import re

    out = Path(str(rw) + "_samecities")
    if (out / "world.json").exists():
        return out
    out.mkdir(exist_ok=True)
    a = json.loads((rw / "world.json").read_text())["answer_vocab"]["cities"]
    b = json.loads((main_w / "world.json").read_text())["answer_vocab"]["cities"]
    m = dict(zip(a, b))
    pat = re.compile(r"\b(" + "|".join(map(re.escape, a)) + r")\b")
    for f in ("corpus.jsonl", "train.jsonl", "world.json"):
        (out / f).write_text(pat.sub(lambda mm: m[mm.group(1)], (rw / f).read_text()))
    return out


def evaluate(reader, sets, k, seed=123, limit=400, p_title=0.5):
    rng = random.Random(seed)
    qs = sets.qs[:limit]
    ps = [sets.passages(q, k, rng, p_title) for q in qs]
    reader.eval()
    preds = reader.answer([q.question for q in qs], ps, batch_size=64)
    reader.train()
    return sum(exact_match(p, q.answers) for p, q in zip(preds, qs)) / len(qs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reader-passages", type=int, default=30000)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--gold-steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dec-layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--same-cities", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--p-title", type=float, default=0.5)
    ap.add_argument("--d-kv", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--tok-reading", type=int, default=1)
    ap.add_argument("--mark", type=int, default=0)
    ap.add_argument("--arch", default="t5")
    ap.add_argument("--aux", type=float, default=0.0)
    ap.add_argument("--mimetic", type=float, default=0.0)
    ap.add_argument("--work", default="runs/reader_probe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--main-train", action="store_true", help="train on the main world's train split only")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    global MARK, WORK
    MARK, WORK = a.mark, a.work
    torch.set_num_threads(a.threads)
    main_w = world(f"{WORK}/main", 4000, 0)
    rw = (
        main_w
        if a.main_train
        else world(f"{WORK}/rw{a.reader_passages}", a.reader_passages, 1000, split_fractions=[1.0, 0.0, 0.0])
    )
    if not a.main_train and a.same_cities:
        rw = remap_cities(rw, main_w)
    train = Sets(rw, "train")
    dev = Sets(main_w, "dev")
    print("train questions", len(train.qs), "dev", len(dev.qs), flush=True)
    texts = [f"{p.title} {p.text}" for p in load_corpus(main_w / "corpus.jsonl")]
    mq = read_qa_jsonl(main_w / "train.jsonl")
    texts += [q.question for q in mq] + [q.answers[0] for q in mq]
    if a.tok_reading:
        rc = load_corpus(rw / "corpus.jsonl")
        texts += (
            [f"{p.title} {p.text}" for p in rc]
            + [q.question for q in train.qs]
            + [q.answers[0] for q in train.qs]
        )
    tok = train_tokenizer(texts, vocab_size=a.vocab)
    print("vocab", len(tok), flush=True)
    if a.arch == "bart":
        from transformers import BartConfig, BartForConditionalGeneration, GenerationConfig

        torch.manual_seed(a.seed)
        bc = BartConfig(
            vocab_size=len(tok),
            d_model=a.d_model,
            encoder_layers=a.layers,
            decoder_layers=a.dec_layers,
            encoder_attention_heads=a.heads,
            decoder_attention_heads=a.heads,
            encoder_ffn_dim=a.d_ff,
            decoder_ffn_dim=a.d_ff,
            max_position_embeddings=128,
            dropout=a.dropout,
            attention_dropout=0.0,
            activation_dropout=0.0,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.eos_token_id,
            decoder_start_token_id=tok.pad_token_id,
            forced_bos_token_id=None,
            forced_eos_token_id=None,
            scale_embedding=True,
        )
        m = BartForConditionalGeneration(bc)
        m.generation_config = GenerationConfig(
            decoder_start_token_id=tok.pad_token_id,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        reader = FiDReader(m, tok, FiDConfig(max_passage_length=48, max_answer_length=12))
    elif a.arch == "warm":
        from reader.warm_start import WarmStartConfig, build_warm_started_encoder_decoder
        from retriever.encoder import default_retriever_path

        m, wtok = build_warm_started_encoder_decoder(
            default_retriever_path(),
            WarmStartConfig(
                encoder_layers=a.layers,
                decoder_layers=a.dec_layers,
                decoder_heads=a.heads,
                decoder_ff=a.d_ff,
                decoder_dropout=a.dropout,
                freeze_embeddings=True,
            ),
            seed=a.seed,
        )
        reader = FiDReader(m, wtok, FiDConfig(max_passage_length=64, max_answer_length=12))
    else:
        reader = FiDReader.from_config(
            tok,
            SmallT5Config(
                d_model=a.d_model,
                d_ff=a.d_ff,
                num_layers=a.layers,
                num_decoder_layers=a.dec_layers,
                num_heads=a.heads,
                d_kv=a.d_kv,
                dropout_rate=a.dropout,
            ),
            FiDConfig(max_passage_length=48, max_answer_length=12),
            seed=a.seed,
        )
    if a.mimetic > 0:
        import math

        g = torch.Generator().manual_seed(a.seed + 7)
        dkv = a.d_kv
        for li, block in enumerate(reader.model.encoder.block):
            att = block.layer[0].SelfAttention
            nh = att.n_heads
            heads = range(nh) if li == 0 else range(nh // 2)
            std = math.sqrt(a.mimetic / (dkv * a.d_model))
            with torch.no_grad():
                for h in heads:
                    w = torch.randn(dkv, a.d_model, generator=g) * std
                    att.q.weight[h * dkv : (h + 1) * dkv] = w
                    att.k.weight[h * dkv : (h + 1) * dkv] = w
    head = torch.nn.Linear(
        reader.model.get_encoder().config.hidden_size if a.arch == "warm" else a.d_model, 1
    )
    opt = torch.optim.AdamW(
        [p for p in reader.parameters() if p.requires_grad] + list(head.parameters()),
        lr=a.lr,
        weight_decay=0.0,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 30) * max(0.0, 1 - s / a.steps))
    rng = random.Random(a.seed)
    order = list(range(len(train.qs)))
    pos = len(order)
    t0 = time.time()
    for step in range(a.steps):
        if pos + a.batch > len(order):
            rng.shuffle(order)
            pos = 0
        qs = [train.qs[i] for i in order[pos : pos + a.batch]]
        pos += a.batch
        k = 1 if step < a.gold_steps else a.k
        ps, golds = [], []
        for q in qs:
            ps.append(train.passages(q, k, rng, a.p_title))
            golds.append(train.last_gold)
        batch = reader.collator([q.question for q in qs], ps, [q.answers[0] for q in qs])
        if a.aux > 0 and k > 1:
            ids, am = batch["input_ids"], batch["attention_mask"]
            Bn, Kn, Ln = ids.shape
            enc = reader.model.get_encoder()(
                input_ids=ids.view(-1, Ln), attention_mask=am.view(-1, Ln)
            ).last_hidden_state
            m = am.view(-1, Ln, 1).float()
            pooled = (enc * m).sum(1) / m.sum(1).clamp_min(1)
            logits = head(pooled).view(Bn, Kn)
            from transformers.modeling_outputs import BaseModelOutput

            out = reader.model(
                encoder_outputs=BaseModelOutput(last_hidden_state=enc.view(Bn, Kn * Ln, -1)),
                attention_mask=am.view(Bn, Kn * Ln),
                labels=batch["labels"],
                use_cache=False,
            )
            aux = torch.nn.functional.cross_entropy(logits, torch.tensor(golds))
            loss = out.loss + a.aux * aux
        else:
            loss = reader(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reader.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            el = time.time() - t0
            em4 = evaluate(reader, dev, 4)
            em1 = evaluate(reader, dev, 1)
            em2 = evaluate(reader, dev, 2, p_title=0.0)
            em4t = evaluate(reader, dev, 4, p_title=1.0)
            em4o = evaluate(reader, dev, 4, p_title=0.0)
            print(
                f"step {step + 1} loss {loss.item():.3f} train_s {el:.0f} dev EM gold+3 {em4:.3f} (kin/own {em4t:.3f}, other ents {em4o:.3f}) gold alone {em1:.3f} k2-other {em2:.3f}",
                flush=True,
            )
            t0 = time.time() - el


if __name__ == "__main__":
    main()
