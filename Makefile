# Two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test test-all lint bench install clean wheel

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[all,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m spark_estimators.demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-all: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check spark_estimators tests bench
	$(VENV)/bin/ruff format --check spark_estimators tests bench
	$(VENV)/bin/mypy

wheel: $(STAMP)
	$(PY) -m pip wheel --no-deps -w dist .

clean:
	rm -rf $(VENV) dist build *.egg-info
