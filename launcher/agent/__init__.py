"""The node agent: one program beside every node's torchrun agent, under every scheduler
(``launcher.agent.node``), and its command line for hosts reached over ssh (``launcher.agent.cli``)."""
