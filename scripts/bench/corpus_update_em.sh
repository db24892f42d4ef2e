#!/bin/bash
# Issue 50 items 5-6 on a trained quickstart run (`rlm quickstart --no-serve --no-baselines --output-dir DIR`): EM and
# gold recall@20 on its world's next edition before `rlm corpus update`, after it and after a rebuild, through the
# trained tower and through g0 then h; the unchanged dev questions before and after. Each step is the user's command.
#   bash scripts/bench/corpus_update_em.sh runs/quickstart /tmp/corpus_update_em
set -euo pipefail
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
usage="usage: bash scripts/bench/corpus_update_em.sh QUICKSTART_DIR OUT_DIR (a new folder)"
Q=$(realpath "${1:?$usage}"); O=$(realpath -m "${2:?$usage}")
[ -e "$O" ] && { echo "error: $O exists; give a new folder" >&2; exit 2; }
W=$Q/toy_world; C=$Q/final
cd "$(dirname "$0")/../.."
R=rlm; PY=python3
[ -x .venv/bin/rlm ] && R=.venv/bin/rlm && PY=.venv/bin/python
mkdir -p $O
t() { local s=$(date +%s%N); "$@"; echo "TIME $(( ($(date +%s%N) - s) / 1000000 )) ms: $*" >&2; }
$R toy-world --next-edition-of $W --out $O/ed --per-change 10
ev() { $R evaluate --checkpoint $C --dataset jsonl --data-path "$1" --corpus "$2" --index "$3" --out "$4" --no-progress | tail -3; }
t $R embed --corpus $W/corpus.jsonl --encoder $C/retriever --out $O/emb --no-progress
t $R index --buffer $O/emb --out $O/idx --cpu
ev $O/ed/dev.jsonl $W/corpus.jsonl $O/idx $O/tower_before
ev $O/ed/unchanged_dev.jsonl $W/corpus.jsonl $O/idx $O/tower_unchanged_before
t $R corpus update --index $O/idx --corpus $W/corpus.jsonl --add $O/ed/add.jsonl --delete $O/ed/delete.txt --checkpoint $C
ev $O/ed/dev.jsonl $W/corpus.jsonl $O/idx $O/tower_after
ev $O/ed/unchanged_dev.jsonl $W/corpus.jsonl $O/idx $O/tower_unchanged_after
# the rebuild: the edited corpus written whole, embedded, indexed
$PY - <<PY
import json
from rlm.data.corpus import load_corpus
from rlm.inference.indexing import load_index_for, served_corpus
base = load_corpus("$W/corpus.jsonl")
index = load_index_for("$O/idx", base.ids, use_gpu=False, corpus_fingerprint=base.fingerprint)
ed = served_corpus(index, base, "$O/idx")
with open("$O/edited.jsonl", "w") as f:
    for i in range(len(ed)):
        if not ed.is_removed(i):
            p = ed[i]; f.write(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n")
PY
t $R embed --corpus $O/edited.jsonl --encoder $C/retriever --out $O/emb_rebuilt --no-progress
t $R index --buffer $O/emb_rebuilt --out $O/idx_rebuilt --cpu
ev $O/ed/dev.jsonl $O/edited.jsonl $O/idx_rebuilt $O/tower_rebuilt
ev $O/ed/unchanged_dev.jsonl $O/edited.jsonl $O/idx_rebuilt $O/tower_unchanged_rebuilt
# through g0 then h: the index over h(B), saved, then updated
$R evaluate --checkpoint $C --dataset jsonl --data-path $O/ed/dev.jsonl --corpus $W/corpus.jsonl --index corrected --save-index $O/hb --out $O/hb_before --no-progress | tail -3
t $R corpus update --index $O/hb --corpus $W/corpus.jsonl --add $O/ed/add.jsonl --delete $O/ed/delete.txt --checkpoint $C
ev $O/ed/dev.jsonl $W/corpus.jsonl $O/hb $O/hb_after
ev $O/ed/unchanged_dev.jsonl $W/corpus.jsonl $O/hb $O/hb_unchanged_after
for d in $O/*/metrics.json; do echo "$d $($PY -c "import json,sys; m=json.load(open('$d')); print({k: m.get(k) for k in ('exact_match','gold_recall@20','recall@20','answered','coverage')})")"; done
