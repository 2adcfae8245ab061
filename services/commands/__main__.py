"""``python -m kvshuttle.services.commands``: the same as the ``kvshuttle`` console script."""

import sys

from kvshuttle.services.commands.cli import main

sys.exit(main())
