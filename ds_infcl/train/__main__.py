"""``python -m ds_infcl.train``: see ``ds_infcl.train.cli``."""

import sys

from ds_infcl.train.cli import main

sys.exit(main())
