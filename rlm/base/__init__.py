"""What every package of the project uses and that imports none of them: atomic writes (`atomicio`) and a model's
mode switches (`evalmode`). `rlm.reader` and `rlm.retriever` import these two and may import nothing else of
ours, neither `rlm`'s own modules nor each other (docs/architecture.md)."""
