# Two commands a fresh machine needs: `make demo` and `make test`.
# Both create (or refresh, when pyproject.toml changes) a Python 3.12 virtualenv in .venv.
PY ?= python3.12
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv gpu-check clean

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "error: $(PY) not found (megatron-core needs Python >= 3.12; set PY=...)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/colo-rollout demo configs/demo_cpu.yaml

# two workers, one test module each at a time (--dist loadfile): a module's tests share one
# spawned process group, and much of a module's time is its ranks waiting on each other
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
