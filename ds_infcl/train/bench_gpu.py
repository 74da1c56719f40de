"""Moved to ``ds_infcl.bench.engine``; this name keeps ``python -m ds_infcl.train.bench_gpu`` and old imports working."""

from ds_infcl.bench.engine import *  # noqa: F401,F403
from ds_infcl.bench.engine import main

if __name__ == "__main__":
    raise SystemExit(main())
