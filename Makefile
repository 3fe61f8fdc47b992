# ddp-magics: `make lab` to learn, `make test` to check everything.
# Every install goes through constraints.txt: it pins torch==2.13.0 (a looser torch pulls a CUDA build).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
CONSTRAINTS := -c constraints.txt
NBVAL_ARGS := -p no:cacheprovider --nbval --nbval-current-env --nbval-cell-timeout=120
# JupyterLab refuses to run as root without --allow-root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: install lab test notebooks bench clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-runs only when the dependencies or their pins change (or the venv is new). The kernel spec
# installed into the venv makes "python3" run the venv's python, in JupyterLab and under nbclient.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PIP) install $(CONSTRAINTS) -e ".[test]"
	$(PY) -m ipykernel install --sys-prefix --name python3
	touch $@

lab: install
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --no-browser $(ALLOW_ROOT)

# The notebook step treats "no tests collected" (exit code 5) and a missing notebooks/ as success.
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests
	@if [ ! -d notebooks ]; then echo "notebooks/ missing: no lessons to test"; exit 0; fi; \
	echo "$(PY) -m pytest $(NBVAL_ARGS) notebooks"; \
	status=0; $(PY) -m pytest $(NBVAL_ARGS) notebooks || status=$$?; \
	if [ $$status -eq 5 ]; then echo "no notebooks to test"; exit 0; fi; \
	exit $$status

notebooks: install
	$(PY) scripts/execute_notebooks.py

bench: install
	-$(PY) benchmarks/cell_latency.py
	-$(PY) benchmarks/trace_overhead.py
	-$(PY) benchmarks/ring_allreduce.py
	$(PY) benchmarks/startup.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -name .ipynb_checkpoints -type d -prune -exec rm -rf {} +
