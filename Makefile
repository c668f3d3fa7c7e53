# The two commands of the README: `make serve` and `make test`. Both install what they need first,
# into the Python environment PYTHON belongs to (the active virtual environment's python3, say).
PYTHON ?= python3
# One stamp per environment: switching to a fresh venv installs again.
STAMP := .install-stamp-$(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.md5(sys.prefix.encode()).hexdigest()[:10])')

.PHONY: install serve test bench-load bench-step bench-serve gpu-check

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) scripts/install.sh
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(PYTHON) -m server $(ARGS)

test: $(STAMP)
	$(PYTHON) -m pytest -q $(ARGS)

bench-load: $(STAMP)
	$(PYTHON) -m benchmarks.load $(ARGS)

bench-step: $(STAMP)
	$(PYTHON) -m benchmarks.step $(ARGS)

bench-serve: $(STAMP)
	$(PYTHON) -m benchmarks.serve $(ARGS)

gpu-check: $(STAMP)
	$(PYTHON) -m benchmarks.gpu_check $(ARGS)
