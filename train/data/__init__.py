"""The data, from stored documents to batches: the file kinds (files.py) and the kinds of source that read them
(sources.py), where a stored text may be cut (cuts.py), the held-out split (held_out.py), tokenizers (tokenizer.py),
reading and tokenizing a piece at a time (token_stream.py), packing into rows (packing.py), the grain pipeline that
joins them (pipeline.py) and the batch it yields (batch.py); needle-in-a-haystack rows (haystack.py) and the
synthetic retrieval source made of them (retrieval.py); the record of what a data position depends on, compared on
resume (record.py).

It imports no JAX, Flax, models, layers or parallel, and the run config only for annotations (import-linter checks),
so data can be read, split and tested without a device; of the rest of train/ it imports only train/errors.py."""
