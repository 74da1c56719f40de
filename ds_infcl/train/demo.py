"""Moved to ``ds_infcl.demos.trainer``; this name keeps ``python -m ds_infcl.train.demo`` and old imports working."""

from ds_infcl.demos.trainer import *  # noqa: F401,F403
from ds_infcl.demos.trainer import main

if __name__ == "__main__":
    raise SystemExit(main())
