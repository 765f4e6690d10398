"""The `specbudget` command line: the composition root, above every other package
(engine, training, ...), so nothing below it imports it."""
