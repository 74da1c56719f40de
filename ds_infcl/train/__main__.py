"""``python -m ds_infcl.train``: see ``ds_infcl.train.cli``."""

from ds_infcl.train.cli import run

run()
