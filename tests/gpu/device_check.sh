#!/usr/bin/env bash
# The GPU checks, as one script for a lent CUDA machine (no Spark, no network there).
#
#   bash tests/gpu/device_check.sh          # logs under $OUT (default /tmp/gpu-check)
#
# 1. tests/gpu: the NCCL backend (job of one GPU; two ranks where two GPUs exist) and the CUDA
#    tensor paths (fused async allreduce, dtypes Gloo/NCCL lack, SyncBatchNorm, two Gloo ranks
#    sharing cuda:0).
# 2. horovod's own test_torch.py and test_adasum_pytorch.py, ported by changing imports, under one
#    NCCL rank: with CUDA present they add torch.cuda.* dtypes to most tests.
# The package is used from the checkout (PYTHONPATH); Spark is not needed for these paths.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      'devices', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
timeout 180 $PY -m pytest tests/gpu -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/gpu_tests.log" \
  | tail -25
for f in test_torch.py test_adasum_pytorch.py; do
  mkdir -p "$OUT/${f%.py}"
  CONFORMANCE_REPORT_DIR="$OUT/${f%.py}" timeout 240 $PY -m spark_estimators.launch -np 1 \
    --backend nccl -m pytest "tests/conformance/parallel/$f" -q -p no:cacheprovider -rfE \
    -o timeout=60 2>&1 | tee "$OUT/${f%.py}_nccl.log" | tail -30
done
# 3. Adasum (horovod's test_adasum_pytorch.py needs MPI and CUDA): with the mpi4py and mpich
#    wheels carried in .whl/ (README of the device tool), one rank over --backend mpi.
if ls .whl/mpi4py-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/mpi-site .whl/*.whl && export PYTHONPATH=/tmp/mpi-site:$PYTHONPATH
  mkdir -p "$OUT/adasum_mpi"
  CONFORMANCE_REPORT_DIR="$OUT/adasum_mpi" timeout 150 $PY -m spark_estimators.launch -np 1 \
    --backend mpi -m pytest tests/conformance/parallel/test_adasum_pytorch.py -q \
    -p no:cacheprovider -rfE -o timeout=60 2>&1 | tee "$OUT/adasum_mpi.log" | tail -30
fi
