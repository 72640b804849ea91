"""``python -m molt_core.cli``: the ``molt`` command."""

from molt_core.cli import main

main()
