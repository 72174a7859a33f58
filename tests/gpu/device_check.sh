#!/usr/bin/env bash
# The GPU checks, as one script for a lent CUDA machine (no Spark JVM, no network there).
#
#   bash tests/gpu/device_check.sh          # logs under $OUT (default /tmp/gpu-check)
#
# Needs python3 with torch (CUDA), pytorch-lightning, pyarrow, pandas, cloudpickle and fsspec, and
# pyspark's Python files (no jars: the Params need no JVM) plus py4j on PYTHONPATH.
# 1. tests/gpu (~1 min): the NCCL backend (job of one GPU; two ranks where two GPUs exist) and
#    the CUDA tensor paths (fused async allreduce, dtypes Gloo/NCCL lack, SyncBatchNorm, two Gloo
#    ranks sharing cuda:0).
# 2. tests/gpu/estimators_local.py (~2-3 min): TorchEstimator and LightningEstimator trained on
#    cuda:0 through fit_on_parquet and LocalBackend (rank processes, no Spark): bf16/fp16
#    autocast, SyncBatchNorm, checkpoint and hot start, one NCCL rank, two Gloo ranks sharing the
#    GPU, predictions on the GPU equal to the CPU's. Writes $OUT/estimators.json.
# 3. With DEVICE_CHECK_CONFORMANCE=1 (~8 more minutes): horovod's own test_torch.py and
#    test_adasum_pytorch.py, ported by changing imports, under one NCCL rank; with the mpi4py and
#    mpich wheels carried in .whl/, Adasum again over --backend mpi.
# The package is used from the checkout (PYTHONPATH); the exit code is non-zero when 1 or 2 failed.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
status=0
nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      'devices', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
timeout 150 $PY -m pytest tests/gpu -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/gpu_tests.log" \
  | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 270 $PY tests/gpu/estimators_local.py --device cuda --out "$OUT" 2>&1 \
  | tee "$OUT/estimators.log" | grep -v '^\[0\].*UserWarning' | tail -40
[ "${PIPESTATUS[0]}" = 0 ] || status=1
if [ "${DEVICE_CHECK_CONFORMANCE:-0}" = 1 ]; then
  for f in test_torch.py test_adasum_pytorch.py; do
    mkdir -p "$OUT/${f%.py}"
    CONFORMANCE_REPORT_DIR="$OUT/${f%.py}" timeout 240 $PY -m spark_estimators.launch -np 1 \
      --backend nccl -m pytest "tests/conformance/parallel/$f" -q -p no:cacheprovider -rfE \
      -o timeout=60 2>&1 | tee "$OUT/${f%.py}_nccl.log" | tail -30
  done
  if ls .whl/mpi4py-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/mpi-site .whl/*.whl && export PYTHONPATH=/tmp/mpi-site:$PYTHONPATH
    mkdir -p "$OUT/adasum_mpi"
    CONFORMANCE_REPORT_DIR="$OUT/adasum_mpi" timeout 150 $PY -m spark_estimators.launch -np 1 \
      --backend mpi -m pytest tests/conformance/parallel/test_adasum_pytorch.py -q \
      -p no:cacheprovider -rfE -o timeout=60 2>&1 | tee "$OUT/adasum_mpi.log" | tail -30
  fi
fi
exit $status
