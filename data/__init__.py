"""Data pipeline (docs/design.md §T3): sources, tokenizer, default corpus, packing, mixture, resume.

Entry points live in `data.pipeline` (`make_train_iterator`, `make_eval_iterator`,
`make_tokenizer`); this package imports nothing at load so `configs/` can read `data.config`
without grain.
"""
