# ditbook — `make demo` runs the playbook on the shipped reference model; `make test` runs the tests.
# Both create .venv when missing and install everything. torch: pyproject.toml asks for a range
# (torch>=2.7.1,<3) that an existing CUDA build satisfies, so a venv that already has torch keeps
# it; only a venv without torch gets the pinned build below (TORCH; from the default index, which on
# the build machines serves the CPU wheel from local disk). On a GPU machine use environment.yml,
# or name a CUDA index, e.g. make install TORCH_INDEX=https://download.pytorch.org/whl/cu130
# Python 3.11 or 3.12 (diffusers 0.42 needs 3.11 or newer).

PYTHON      ?= python3
VENV        ?= .venv
BIN         := $(VENV)/bin
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
STAMP       := $(VENV)/.ditbook-installed
CARD        ?= models/reference.yaml
# extra arguments for `make lab`; on a remote host: make lab LAB_ARGS="--ip=0.0.0.0 --no-browser"
LAB_ARGS    ?=
# JupyterLab refuses to start as root unless told
ROOT_ARGS   := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: install demo test test-fast novel chromium clean clean-outputs lab gpu-check screenshots

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] <= (3, 12)))' || \
		{ echo "ditbook needs Python 3.11 or 3.12; $(PYTHON) is $$($(PYTHON) -V 2>&1). Set PYTHON=python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# nbdime's git drivers are set by absolute path: `git diff` works without activating the venv
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/nbdime config-git --enable >/dev/null 2>&1 || true
	git config diff.jupyternotebook.command "$(abspath $(BIN))/git-nbdiffdriver diff" || true
	git config merge.jupyternotebook.driver "$(abspath $(BIN))/git-nbmergedriver merge %O %A %B %L %P" || true
	touch $(STAMP)

install: $(STAMP)

# headless Chromium for the report test (Debian's package)
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: install
	$(BIN)/ditbook run $(CARD)

# the README's screenshots of report.html from the newest finished run (after `make demo`): the
# three docs/report_*.png and docs/screenshots.json; then name the run in the README's caption
screenshots: install chromium
	$(BIN)/ditbook screenshots

test: install chromium
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# on a GPU host, after `. .gpu-wheels/install.sh` (docs/gpu.md): both shipped cards through the five
# stages with the novel-model suite beside them, then the composed FLUX-shape benchmark alone; writes
# docs/gpu-check.json (commit it). A copy without its git folder names the commit:
# make gpu-check GPU_CHECK_ARGS="--revision <commit>"
GPU_CHECK_ARGS ?=
gpu-check:
	python3 benchmarks/gpu_check.py --record docs/gpu-check.json --novel all $(GPU_CHECK_ARGS)

# the novel-model suite: all ten third-party DiTs of tests/novel/ through `ditbook run` with the
# card's defaults (make test runs two of them); outcomes in docs/novel_models.md
novel: install
	DITBOOK_NOVEL_ALL=1 $(BIN)/python -m pytest -q tests/test_novel_models.py

# JupyterLab on this environment (the notebooks' kernel is this venv's python3, "Python 3 (ipykernel)"),
# opened at the repository root: models/, notebooks/ and outputs/ in its file browser. A notebook's
# kernel runs in notebooks/; its CARD = "models/reference.yaml" and new runs (RUN_DIR = "") are
# resolved against this root all the same (ditbook.context.open_stage), so runs land in outputs/.
lab: install
	$(BIN)/jupyter lab $(ROOT_ARGS) --ServerApp.root_dir="$(CURDIR)" $(LAB_ARGS)

# build and cache folders only: never outputs/ (run folders) nor the virtual environment
clean:
	rm -rf build dist .pytest_cache
	find . \( -path ./outputs -o -path ./$(VENV) -o -path ./.git \) -prune -o \
	  -type d \( -name __pycache__ -o -name '*.egg-info' -o -name .pytest_cache -o -name .ipynb_checkpoints \) \
	  -prune -exec rm -rf {} +

clean-outputs:
	find outputs -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
