"""``python -m kvstore.cli``: the ``kvstore`` command."""

from kvstore.cli.main import main

raise SystemExit(main())
