"""The SSH scheduler: one torchrun agent per host, through the system OpenSSH client (``scheduler``)."""
