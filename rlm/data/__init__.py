"""QA datasets, passage corpora and the offline toy world."""
