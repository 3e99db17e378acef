"""The pinned training image: ``engine`` (the Docker engine through the Docker SDK: one way to connect,
one kind of error), ``build`` (staging the build context, building, pushing) and ``record`` (what the
built image holds, read back by running the probe inside it). It may import ``launcher.preflight`` and
``launcher.job``, never a scheduler; ``launcher build`` (``launcher.cli.build``) and the compose
scheduler use it.
"""
