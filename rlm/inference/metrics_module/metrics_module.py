"""Open-domain QA exact match and F1 as a local `evaluate` module (the hub's metrics are unreachable offline).

Load it with `evaluate.load(rlm.inference.metrics.evaluate_module_path())`. The scores are `rlm.inference.metrics`'s: SQuAD/NQ
normalisation, max over the gold answers, reported in [0, 1].
"""

import datasets
import evaluate

from rlm.inference.metrics import qa_scores

_DESCRIPTION = (
    "Exact match and token F1 of open-domain QA predictions, max over each question's gold answers."
)

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of predicted answer strings.
    references: list of lists of gold answer strings (one list per prediction).
Returns:
    exact_match: mean exact match in [0, 1].
    f1: mean token F1 in [0, 1].
Example:
    >>> metric = evaluate.load(path_to_this_folder)
    >>> metric.compute(predictions=["Paris"], references=[["paris", "Paris, France"]])
    {'exact_match': 1.0, 'f1': 1.0}
"""

_CITATION = """\
@inproceedings{rajpurkar-etal-2016-squad,
  title = {{SQuAD}: 100,000+ Questions for Machine Comprehension of Text},
  author = {Rajpurkar, Pranav and Zhang, Jian and Lopyrev, Konstantin and Liang, Percy},
  booktitle = {EMNLP},
  year = {2016}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class OpenQAExactMatch(evaluate.Metric):
    """Exact match and F1 over lists of gold answers."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string"),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
        )

    def _compute(self, predictions, references):
        return qa_scores(predictions, references)
