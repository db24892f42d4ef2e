"""The reader: Fusion-in-Decoder over any HF encoder-decoder, collation, per-passage answer scoring.

Modules: `fid` (FiDReader, FiDConfig), `formatting` (FiDCollator), `scoring` (score_passages), `tokenizer`
(offline BPE / packaged WordPiece), `small_t5` (the offline default architecture), `warm_start`
(pretrained encoder + fresh decoder), `io` (atomic writes).
"""
