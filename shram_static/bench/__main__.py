"""`python -m shram_static.bench`: the `bench` command (and its worker processes)."""

from .cli import main

raise SystemExit(main())
