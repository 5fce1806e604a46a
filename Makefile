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
# the test set-up's pin (the packages ask for torch>=2.4, so a CUDA build already in the venv stays)
TORCH ?= torch==2.13.0

.PHONY: serve test install install-test provision-browser dist clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# the core and every plugin, editable; torch pinned first unless the venv has one already
$(VENV)/.installed: $(PY) pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH)"
	$(PIP) $(EDITABLE)
	touch $@

# the pinned references the CPU suite compares against (never flash-linear-attention or triton)
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e '.[test]' $(foreach p,$(PLUGINS),-e '$(p)[test]')
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# the browser test's Debian chromium and chromium-driver: installed only when missing and root has apt-get
provision-browser:
	@sh tools/provision_browser.sh

serve: $(VENV)/.installed
	$(VENV)/bin/tandem pull $(MODEL)
	$(VENV)/bin/tandem serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: $(VENV)/.installed-test provision-browser
	$(VENV)/bin/python -m pytest -q

# wheels of the core and every plugin (not editable), for `pip install dist/*.whl`
dist: $(PY)
	rm -rf dist
	$(PIP) "setuptools>=70.1"
	$(PY) -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w dist . $(PLUGINS)

clean:
	rm -rf $(VENV) .pytest_cache dist
