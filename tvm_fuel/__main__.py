"""``python -m tvm_fuel``: see ``tvm_fuel.cli``."""

import sys

from .cli import main

sys.exit(main())
