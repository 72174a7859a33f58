#!/usr/bin/env bash
# Build the folder that carries this checkout to a GPU machine that has torch but no pyspark:
#
#   bash tests/gpu/make_carry.sh DEST [SITE_PACKAGES]
#
# DEST gets spark_estimators/, tests/, bench/, pyproject.toml and site/ (pyspark's Python files
# without its jars, tests and examples, and py4j: ~19 MB; the Params need no JVM). Then, there:
#
#   cd DEST && export PYTHONPATH=$PWD/site && OUT=$OUT bash tests/gpu/device_check.sh
#   cd DEST && PYTHONPATH=$PWD/site python3 bench/gpu.py --out $OUT
set -eu
DEST=${1:?usage: make_carry.sh DEST [SITE_PACKAGES]}
SITE=${2:-$(python3 -c 'import os, pyspark; print(os.path.dirname(os.path.dirname(pyspark.__file__)))')}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$DEST"
mkdir -p "$DEST/site"
cp -r "$ROOT/spark_estimators" "$ROOT/tests" "$ROOT/bench" "$ROOT/pyproject.toml" "$DEST/"
cp -r "$SITE/pyspark" "$SITE/py4j" "$DEST/site/"
rm -rf "$DEST/site/pyspark/"{jars,tests,examples,bin,sbin,licenses,data}
find "$DEST" -name __pycache__ -prune -exec rm -rf {} +
find "$DEST/site" -path '*/tests' -prune -exec rm -rf {} +
du -sh "$DEST"
