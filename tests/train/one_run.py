"""Run ``ds_infcl.train.loop.train`` once in a fresh process (no launcher: a 1-rank world) and
print its outcome as one JSON line, so a test need not call ``train`` in the pytest process (where
the 1-rank world's ``RANK``/``MASTER_PORT`` and process group would outlive the test).

    python -m tests.train.one_run RUN_CONFIG_JSON DS_CONFIG_JSON
"""

import json
import sys

from ds_infcl.train.config import run_config_from_dict
from ds_infcl.train.dist import exit_process
from ds_infcl.train.loop import train


def run(argv) -> dict:
    cfg, ds = run_config_from_dict(json.loads(argv[0])), json.loads(argv[1])
    try:
        return {"steps": train(cfg, ds).steps, "error": None}
    except Exception as e:  # the test asserts on the type and the message
        return {"steps": None, "error": type(e).__name__, "message": str(e)}


if __name__ == "__main__":
    print("ONE_RUN " + json.dumps(run(sys.argv[1:])), flush=True)
    exit_process(0)
