"""The compose scheduler: one container per node on one Docker engine (``scheduler``)."""
