"""Moved to ``ds_infcl.demos.retrieval``; this name keeps ``python -m ds_infcl.train.retrieval_demo`` and old imports working."""

from ds_infcl.demos.retrieval import *  # noqa: F401,F403
from ds_infcl.demos.retrieval import main

if __name__ == "__main__":
    raise SystemExit(main())
