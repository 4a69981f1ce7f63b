"""First-party tasks: verifiable generated tasks, local datasets, and a tiny-model builder.

* `reverse-digits` — reverse an N-digit string (partial-credit reward).
* `arithmetic` — multi-digit addition (partial credit, or `exact_match`).
* `dataset` — any local parquet/jsonl file through Hugging Face `datasets`.

`reverse-digits` and `arithmetic` also build a tiny Llama plus an in-process-trained
character tokenizer (`model.builder: reverse-digits`), cached on disk.
"""
