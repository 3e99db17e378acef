"""The ``launcher`` command line: parse, dispatch, print. ``main`` builds the parser and maps each
command to its function; ``flags`` turns flags and config files into a validated JobSpec (the job's
flags from JobSpec's fields, each scheduler's from its options model); ``submit`` renders, records and
submits a job (and follows it when attached); ``jobs`` answers ``list``, ``status``, ``logs``, ``wait``
and ``cancel`` from the job record; ``hosts`` runs ``probe`` and ``check``; ``build`` builds the
training image. The top layer: it may import every other ``launcher`` package; none imports it.
"""
