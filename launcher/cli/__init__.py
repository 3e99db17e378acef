"""The ``launcher`` command line: parse, dispatch, print. Its modules: docs/contributors/architecture.md.
The top layer: it may import every other ``launcher`` package; none imports it.
"""
