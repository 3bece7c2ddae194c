# Two commands for a new user:   make run   (train a real job on an embedded local Ray)
#                                 make test  (the quick tier of the tests; make test-all: all of them)
# Each sets up .venv on first use. TORCH_VERSION picks the PyTorch build pip installs first;
# gearshift itself only asks for torch>=2.4.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
JOB ?= examples/mlp.yaml
BIN := $(VENV)/bin
STAMP := $(VENV)/.gearshift-installed

.PHONY: install run test test-all clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

run: install
	$(BIN)/gearshift run $(JOB)

# the quick tier: pure logic, plus one real Ray run each of run, submit, switch and recovery
test: install
	$(BIN)/python -m pytest -m "(not ray and not slow) or smoke" $(PYTEST_ARGS)

# everything (what CI runs): the tests that start no Ray and time nothing two at a time (a
# file's tests on one process), then the others one at a time (each leans on the one Ray of the
# session, or on having the machine's cores to itself for its timings). Both parts always run;
# it fails if either does (pytest's 5: nothing selected, is not a failure)
test-all: install
	$(BIN)/python -m pytest -m "not ray and not timing" -n 2 --dist loadfile $(PYTEST_ARGS); a=$$?; \
	$(BIN)/python -m pytest -m "ray or timing" $(PYTEST_ARGS); b=$$?; \
	for c in $$a $$b; do [ $$c -eq 0 ] || [ $$c -eq 5 ] || exit $$c; done

clean:
	rm -rf $(VENV) runs .pytest_cache
