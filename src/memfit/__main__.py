"""``python -m memfit``: the same as the ``memfit`` command."""

from .cli import main

main()
