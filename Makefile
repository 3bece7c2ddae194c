# Two commands for a new user:   make run   (train a real job on an embedded local Ray)
#                                 make test  (the quick tier of the tests; make test-all: all of them)
# Each sets up .venv on first use. TORCH_VERSION picks the PyTorch build installed first;
# gearshift itself only asks for torch>=2.4. tools/install.py installs through uv (pip's own
# settings handed over), or through pip where uv cannot be had.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
JOB ?= examples/mlp.yaml
BIN := $(VENV)/bin
STAMP := $(VENV)/.gearshift-installed
TEST_STAMP := $(VENV)/.gearshift-test-installed

.PHONY: install install-test run test test-all test-extended clean

# what a run needs: gearshift and its own requirements (no test extras)
install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python tools/install.py "torch==$(TORCH_VERSION)"
	$(BIN)/python tools/install.py -e .
	touch $(STAMP)

# what the tests need besides: pytest, transformers, mlflow, onnx, Ray Serve, moto (once)
install-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	@echo "installing the test extras (pytest, pyflakes, transformers, mlflow, tensorboard, onnx, onnxruntime, Ray Serve, moto, s3fs) once"
	$(BIN)/python tools/install.py -e ".[test]"
	touch $(TEST_STAMP)

run: install
	$(BIN)/gearshift run $(JOB)

# the quick tier: pure logic, plus one real Ray run each of run, submit, switch and recovery; two
# at a time (a file's tests on one process, the files handed out longest first from
# tests/seconds.json: conftest orders them, --no-loadscope-reorder keeps that order; tests/README.md
# says what each tier costs)
test: install-test
	$(BIN)/python -m pytest -m "(not ray and not slow and not runs) or smoke" -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# everything but the extended variants (what CI runs), in three parts: the tests that start no
# Ray, two at a time (a file's tests on one process, the longest files first); the Ray ones, two at a time too (each process
# its own Ray session); the benches' smoke runs on a Ray of their own (marked alone), two at a time
# with nothing else beside them. No test asserts on measured time (that is bench/'s). Every part
# always runs; it fails if any does (pytest's 5, nothing selected, is not a failure)
test-all: install-test
	$(BIN)/python -m pytest -m "not ray and not alone and not extended" -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); a=$$?; \
	$(BIN)/python -m pytest -m "ray and not alone and not extended" -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); b=$$?; \
	$(BIN)/python -m pytest -m "alone and not extended" -n 2 $(PYTEST_ARGS); c=$$?; \
	for r in $$a $$b $$c; do [ $$r -eq 0 ] || [ $$r -eq 5 ] || exit $$r; done

# the extended variants: further forms of scenarios test-all already runs (marked extended)
test-extended: install-test
	$(BIN)/python -m pytest -m "extended" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
