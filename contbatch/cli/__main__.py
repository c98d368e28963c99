"""`python -m contbatch.cli`: the `contbatch` command."""

from __future__ import annotations

from contbatch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
