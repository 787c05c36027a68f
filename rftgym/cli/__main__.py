"""``python -m rftgym.cli`` (as torchrun and accelerate launch run it): the ``rftgym`` command."""

import sys

from . import main

sys.exit(main())
