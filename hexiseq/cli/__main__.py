"""`python -m hexiseq.cli ...`: the `hexiseq` command."""

from hexiseq.cli import main

raise SystemExit(main())
