# Two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The demo needs only the torch set (no TensorFlow, Lightning, MPI): its own stamp in the same venv.
DEMO_STAMP := $(VENV)/.installed-demo
PYTEST_ARGS ?=

.PHONY: demo test test-all test-notebooks-autolog test-spark35 test-petastorm test-conformance \
	test-multihost lint bench install clean wheel soak

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[all,dev]"
	touch $(STAMP)

install: $(STAMP)

$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[torch]"
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m spark_estimators.demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-all: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# One driver, 200 run() calls and 50 fits: threads, fds, sockets, children and RSS stay flat (issue 40).
soak: $(STAMP)
	$(PY) -m pytest tests/integration/test_driver_leaks.py -m slow -s $(PYTEST_ARGS)

# Every notebook again with mlflow.autolog() turned on first, as on Databricks (issue 41).
test-notebooks-autolog: $(STAMP)
	SPARK_ESTIMATORS_NOTEBOOK_AUTOLOG=1 $(PY) -m pytest tests/notebooks -k "top_to_bottom or readme" \
		$(PYTEST_ARGS)

# horovod's own tests, ported by changing imports (tests/conformance/README.md, docs/conformance.md).
# Its own pytest process (horovod's tests manage Spark sessions themselves); `make test` skips the
# directory, CI runs this target. CONFORMANCE_MARKERS="" adds the tests marked slow.
CONFORMANCE_MARKERS ?= not slow
test-conformance: $(STAMP)
	$(PY) -m pytest tests/conformance -m "$(CONFORMANCE_MARKERS)" $(PYTEST_ARGS); rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# Three hosts in network namespaces with a Spark standalone cluster across them (tests/multihost,
# docs/clusters.md "Testing across hosts"). Its own pytest process; `make test` skips the directory.
# Needs root and iproute2 (.ci/run installs it); without them the tests fail, they never skip.
test-multihost: $(STAMP)
	$(PY) -m pytest tests/multihost -p no:cacheprovider $(PYTEST_ARGS)

# reader="petastorm" in its pinned environment (requirements-petastorm.txt: petastorm 0.13.1 needs
# pyspark 4.0.x, pyarrow 14, numpy<2): the reader's settings and estimators fitting through it.
VENVPS := .venv-petastorm
PYPS := $(VENVPS)/bin/python

$(VENVPS)/.installed: pyproject.toml requirements-petastorm.txt
	test -x $(PYPS) || $(PYTHON) -m venv $(VENVPS)
	$(PYPS) -m pip install -q -r requirements-petastorm.txt
	$(PYPS) -m pip install -q --no-deps petastorm==0.13.1
	$(PYPS) -m pip install -q --no-deps -e .
	touch $@

test-petastorm: $(VENVPS)/.installed
	$(PYPS) -m pytest -p no:cacheprovider -m "not slow" -W "ignore::FutureWarning" \
		tests/petastorm_env tests/unit/test_data_reader.py $(PYTEST_ARGS)

# The pyspark 3.5 floor (classic sessions): the tested set with pyspark swapped for 3.5, in its own
# venv, and the subset docs/concepts.md names ("What is tested where"). About 5 minutes.
VENV35 := .venv-spark35
PY35 := $(VENV35)/bin/python
PYSPARK35 ?= 3.5.9
SPARK35_TESTS := tests/unit/test_pyspark_versions.py tests/integration/test_run.py \
	tests/integration/test_torch_estimator.py
SPARK35_SELECT := not torch_estimator or loss_decreases or transform_equals or pipeline_save_load \
	or bad_input_fails

$(VENV35)/.installed: pyproject.toml constraints.txt
	test -x $(PY35) || $(PYTHON) -m venv $(VENV35)
	grep -v -e '^pyspark==' -e '^py4j==' constraints.txt > $(VENV35)/constraints.txt
	echo 'pyspark==$(PYSPARK35)' >> $(VENV35)/constraints.txt
	$(PY35) -m pip install -q -c $(VENV35)/constraints.txt -e ".[torch]" pytest pytest-timeout \
		psutil grpcio grpcio-status googleapis-common-protos zstandard
	touch $@

test-spark35: $(VENV35)/.installed
	$(PY35) -m pytest -p no:cacheprovider -m "not slow" -k "$(SPARK35_SELECT)" $(SPARK35_TESTS) \
		$(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check spark_estimators tests bench
	$(VENV)/bin/ruff format --check spark_estimators tests bench
	$(VENV)/bin/mypy

wheel: $(STAMP)
	$(PY) -m pip wheel --no-deps -w dist .

clean:
	rm -rf $(VENV) $(VENV35) $(VENVPS) dist build *.egg-info
