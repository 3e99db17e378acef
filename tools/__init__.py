"""Maintainers' tools: generators for the docs (``tools.reference``)."""
