# The two commands of the README: `make serve` and `make test`. Both install what they need first.
PYTHON ?= python3
STAMP := .install-stamp

.PHONY: install serve test bench-load bench-step bench-serve

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

# transformers serve (the peer) needs accelerate: the bench extra
bench-serve: $(STAMP)
	$(PYTHON) -m pip install -q -e '.[test,bench]'
	$(PYTHON) -m benchmarks.serve $(ARGS)
