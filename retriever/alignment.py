"""How aligned the two towers are, and whether the query tower has collapsed (DAFT, Wang et al. 2023, Sections
3-4): the measurements a heterogeneous dual encoder (a light query tower against a full passage tower) is
watched with.

* `knn_kl_divergence`: the k-nearest-neighbour estimate of KL(P || Q) between two samples of vectors
  (Perez-Cruz 2008, the paper's Eq. 9), with P the passage tower's and Q the query tower's embeddings of the
  *same* questions: low when the query tower's outputs lie where the passage tower's do.
* `mean_pairwise_cosine`: the mean cosine between the query embeddings of different questions. A collapsed
  tower maps every question to nearly the same vector (the paper's Fig. 1-2), and this goes to 1.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def knn_kl_divergence(p_samples: Tensor, q_samples: Tensor, k: int = 1, paired: bool = False) -> float:
    """KL(P || Q) ~ (a / n) sum_i log(s_k(x_i) / r_k(x_i)) + log(m / (n - 1)).

    `p_samples` [n, a] from P, `q_samples` [m, a] from Q; r_k(x_i) is the distance from x_i to its k-th
    nearest neighbour among the other P samples, s_k(x_i) to its k-th nearest among the Q samples.

    `paired`: row i of both comes from the same input (both towers on the same question, as DAFT measures).
    Then q_i is left out of x_i's Q neighbours (and m counts one less), so the samples act as independent
    draws: two identical towers give 0, not the -infinity that s = |x_i - q_i| = 0 would. Other exact
    duplicates would make a distance 0: distances are floored at 1e-12.
    """
    if p_samples.ndim != 2 or q_samples.ndim != 2 or p_samples.shape[1] != q_samples.shape[1]:
        raise ValueError(
            f"need [n, a] and [m, a] samples, got {tuple(p_samples.shape)}, {tuple(q_samples.shape)}"
        )
    n, dim = p_samples.shape
    m = q_samples.shape[0]
    if n <= k or m < k + paired or k < 1:
        raise ValueError(f"need more than k={k} samples from P and at least k from Q, got {n} and {m}")
    p, q = p_samples.double(), q_samples.double()
    within = torch.cdist(p, p)
    within.fill_diagonal_(math.inf)  # x_i is not its own neighbour
    r = within.kthvalue(k, dim=1).values.clamp_min(1e-12)
    across = torch.cdist(p, q)
    if paired:
        if m != n:
            raise ValueError(f"paired samples need as many rows in P as in Q, got {n} and {m}")
        across.fill_diagonal_(math.inf)
        m -= 1
    s = across.kthvalue(k, dim=1).values.clamp_min(1e-12)
    return float(dim * (s.log() - r.log()).mean() + math.log(m / (n - 1)))


def mean_pairwise_cosine(embeddings: Tensor) -> float:
    """Mean cosine similarity over all pairs of different rows (1: every row points the same way)."""
    n = embeddings.shape[0]
    if n < 2:
        raise ValueError(f"need at least 2 embeddings, got {n}")
    unit = torch.nn.functional.normalize(embeddings.double(), dim=-1)
    total = unit.sum(0)
    # sum over i != j of <u_i, u_j> = |sum u|^2 - sum |u_i|^2, without the n x n matrix.
    return float((total @ total - (unit * unit).sum()) / (n * (n - 1)))


@torch.no_grad()
def alignment_metrics(
    retriever, questions: list[str], batch_size: int = 64, queries: Tensor | None = None
) -> dict[str, float]:
    """`query_mean_cosine` (collapse) and `query_passage_knn_kl` (alignment: KL(passage tower || query
    tower) over the same questions, as DAFT measures it) for a dual encoder on these questions; `queries`:
    their query-tower embeddings when the caller has them already."""
    if queries is None:
        queries = retriever.query_tower.encode(list(questions), batch_size=batch_size)
    queries = queries.float().cpu()
    metrics = {"query_mean_cosine": mean_pairwise_cosine(queries)}
    if len(questions) > 1:
        as_passages = retriever.passage_tower.encode(list(questions), batch_size=batch_size).float().cpu()
        metrics["query_passage_knn_kl"] = knn_kl_divergence(as_passages, queries, paired=True)
    return metrics
