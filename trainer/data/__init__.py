"""Training text, from its source to the batches of one optimizer step.

This package owns the data path: ``corpus`` (text sources: a Hugging Face dataset, local text files,
the embedded corpus), ``prepare`` (tokenizing a corpus into a data dir once, under a lock, and reusing
it while it matches), ``manifest`` (the data dir's format), ``tokens`` (the BPE tokenizer and token
files), ``splits`` (reading prepared splits and the tokenizer back) and ``batches`` (deterministic,
rank-strided batches). It may import only ``trainer.errors``, ``gptlaunch.files`` and third-party
libraries, never the configuration, the loop or the command line above it, and this file imports
none of its modules: ``corpus`` and ``manifest`` import no torch, numpy or tokenizers, so the up-front
argument check (``trainer.precheck``) uses them without paying for those imports.
"""
