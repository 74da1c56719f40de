# The two commands of the README: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export DS_ACCELERATOR ?= cpu
export HF_HUB_OFFLINE ?= 1

.PHONY: setup demo demo-synthetic demo-retrieval demo-loss test test-gpu bench-cpu clean

setup: $(STAMP)

# torch==2.13.0 (the CPU build) is pinned in requirements-ci.txt and installed in the same pip
# command as everything else: an unpinned resolve pulls a multi-GB CUDA build.
$(STAMP): requirements-ci.txt requirements-nodeps.txt setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-ci.txt -e .
	# OpenCLIP's loss module, for the side-by-side tests. Without its dependencies: the only
	# torchvision wheel for torch 2.13 offline is a CUDA build, which breaks transformers' imports.
	$(BIN)/python -m pip install -q --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

# The main job on its built-in default: CLIP on the scikit-learn digits, 2 CPU ranks, deepspeed launcher.
demo: $(STAMP)
	$(BIN)/python -m ds_infcl.demos.trainer --task digits

demo-synthetic: $(STAMP)
	$(BIN)/python -m ds_infcl.demos.trainer --task synthetic

demo-retrieval: $(STAMP)
	$(BIN)/python -m ds_infcl.demos.retrieval --out runs/retrieval_demo

demo-loss: $(STAMP)
	$(BIN)/python -m ds_infcl.demos.loss

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# On a CUDA machine, in an environment that has torch, triton and DeepSpeed (no .venv): the Triton
# kernels against float64 (1 GPU) and the ring on NCCL (2+ GPUs).
test-gpu:
	TRITON_INTERPRET=0 $(PYTHON) -m pytest -q -s tests/gpu

bench-cpu: $(STAMP)
	$(BIN)/python -m ds_infcl.bench.cpu_tiled --out docs/bench

clean:
	rm -rf $(VENV) build *.egg-info runs data/digits
