# ditbook — `make demo` runs the playbook on the shipped reference model; `make test` runs the tests.
# Both create .venv when missing and install everything (torch first, pinned, so a CPU build is
# taken here; on a GPU machine set TORCH= to your CUDA build or use environment.yml).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.ditbook-installed
CARD   ?= models/reference.yaml

.PHONY: install demo test test-fast chromium clean clean-outputs lab

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/nbdime config-git --enable >/dev/null 2>&1 || true
	touch $(STAMP)

install: $(STAMP)

# headless Chromium for the report test (Debian's package)
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: install
	$(BIN)/ditbook run $(CARD)

test: install chromium
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# JupyterLab on this environment (the notebooks' kernel is this venv's python3)
lab: install
	$(BIN)/jupyter lab notebooks/

# build and cache folders only: never outputs/ (run folders) nor the virtual environment
clean:
	rm -rf build dist .pytest_cache
	find . \( -path ./outputs -o -path ./$(VENV) -o -path ./.git \) -prune -o \
	  -type d \( -name __pycache__ -o -name '*.egg-info' -o -name .pytest_cache -o -name .ipynb_checkpoints \) \
	  -prune -exec rm -rf {} +

clean-outputs:
	find outputs -mindepth 1 -maxdepth 1 ! -name README.md -exec rm -rf {} +
