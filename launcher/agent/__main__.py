from launcher.agent.cli import entry

entry()
