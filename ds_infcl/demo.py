"""Moved to ``ds_infcl.demos.loss``; this name keeps ``python -m ds_infcl.demo`` and old imports working."""

from ds_infcl.demos.loss import *  # noqa: F401,F403
from ds_infcl.demos.loss import main

if __name__ == "__main__":
    raise SystemExit(main())
