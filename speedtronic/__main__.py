"""``python -m speedtronic`` runs the same CLI as the ``speedtronic`` console script."""

from __future__ import annotations

import sys

from speedtronic.cli import main

if __name__ == "__main__":
    sys.exit(main())
