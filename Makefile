# The README's two commands: `make serve` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
EDITABLE := -e . $(foreach p,$(PLUGINS),-e $(p))
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m

.PHONY: serve test install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# the core and every plugin, editable
$(VENV)/.installed: $(PY) pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(PIP) $(EDITABLE)
	touch $@

# the pinned references the CPU suite compares against (never flash-linear-attention or triton)
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e '.[test]' $(foreach p,$(PLUGINS),-e '$(p)[test]')
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: $(VENV)/.installed
	$(VENV)/bin/tandem pull $(MODEL)
	$(VENV)/bin/tandem serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
