# `make test` and `make serve` do all set-up on a fresh machine; `make serve ARGS="--port 8080"` passes flags.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test serve install clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# A bare `torch` requirement would pull a multi-GB CUDA build: take the local CPU wheel first.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 tests   # two workers: CI has two cores

serve: $(STAMP)
	$(VENV)/bin/dsv4 serve $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
