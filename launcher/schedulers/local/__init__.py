"""The local scheduler: ``nnodes`` emulated nodes on this machine (``scheduler``)."""
