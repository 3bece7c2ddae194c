"""`python -m gearshift ...`: the same as the `gearshift` command."""

from gearshift.orchestrator.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
