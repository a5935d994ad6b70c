"""`python -m hexiseq.cli ...`: the `hexiseq` command."""

from hexiseq.cli import console

raise SystemExit(console())
