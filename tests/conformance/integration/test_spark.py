# Copyright 2018 Uber Technologies, Inc. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================


import contextlib
import copy
import shutil
import uuid

from spark_estimators.store import FilesystemStore
import io
import itertools
import logging
import os
import platform
import re
import sys
import threading
import time
import unittest
import warnings
from packaging import version

from unittest import mock
import psutil
import pyspark
import pytest
from pyspark.ml.linalg import DenseVector, SparseVector, VectorUDT
from pyspark.sql.types import ArrayType, BooleanType, DoubleType, FloatType, IntegerType, \
    NullType, StructField, StructType

import spark_estimators
from spark_estimators.collective.torch import gloo_built, mpi_built
from spark_estimators.data import horovod_util as util
from spark_estimators.store import DBFSLocalStore, HDFSStore, LocalStore, Store
from spark_estimators.task import get_available_devices
# conformance: horovod.common.util's gloo_built/mpi_built come from the collective API here;
# horovod.runner.* (codec, secret, safe_shell_exec, timeout, settings, is_open_mpi, in_thread),
# horovod.spark.common.constants, horovod.spark.driver.* (SparkDriverHostDiscovery, rsh),
# horovod.spark.runner._task_fn, horovod.spark.task's gloo_exec_fn / mpirun_exec_fn and
# SparkTaskClient are horovod internals used only by the tests that are not ported (README.md).

sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, 'utils'))

from spark_common import spark_session, create_test_data_from_schema, create_xor_data, local_store

from common import is_built, tempdir, override_env, undo, delay, spawn



# Spark will fail to initialize correctly locally on Mac OS without this
if platform.system() == 'Darwin':
    os.environ['OBJC_DISABLE_INITIALIZE_FORK_SAFETY'] = 'YES'


def fn(result=0):
    return result


@spawn
def run_get_available_devices():
    # Run this test in an isolated "spawned" environment because creating a local-cluster
    # leads to errors that cause downstream tests to stall:
    # https://issues.apache.org/jira/browse/SPARK-31922
    def fn():
        import spark_estimators.collective.torch as hvd

        hvd.init()
        devices = get_available_devices()
        return devices, hvd.local_rank()

    with spark_session('test_get_available_devices', gpus=2):
        return spark_estimators.run(fn, env={'PATH': os.environ.get('PATH')}, verbose=0)


class SparkTests(unittest.TestCase):
    """
    Tests for horovod.spark.run().
    """

    def __init__(self, *args, **kwargs):
        super(SparkTests, self).__init__(*args, **kwargs)
        self.maxDiff = None
        logging.getLogger('py4j.java_gateway').setLevel(logging.INFO)
        warnings.simplefilter('module')

    def run(self, result=None):
        # These unit tests should not be run with horovodrun as some tests
        # setup their own Horovod cluster, where both will then interfere.
        if 'OMPI_COMM_WORLD_RANK' in os.environ or 'HOROVOD_RANK' in os.environ:
            self.skipTest("These tests should not be executed via horovodrun, just pytest")

        super(SparkTests, self).run(result)


    # conformance: not ported (horovod internals, see README.md): the driver/task service,
    # host hash, rsh, mpirun/gloo exec_fn, host discovery, MPI and mocked-launcher tests, and the
    # tests of private data helpers (util._get_col_info, _train_val_split, _get_metadata,
    # _training_cache, check_shape_compatibility, to_list, get_spark_df_output_schema) and of
    # mocked store internals (HDFSStore._get_filesystem_fn, _DBFS_PREFIX_MAPPING).

    """
    Test that horovod.spark.run works properly in a simple setup using Gloo.
    """
    @pytest.mark.xfail(strict=True, reason="documented difference: output lines are prefixed [rank], not horovod's [rank]<stdout>: / [rank]<stderr>: (docs/migration.md), see test_documented_differences.py")
    def test_happy_run_with_gloo(self):
        if not gloo_built():
            self.skipTest("Gloo is not available")

        self.do_test_happy_run(use_mpi=False, use_gloo=True)

    """
    Actually tests that horovod.spark.run works properly in a simple setup.
    """
    def do_test_happy_run(self, use_mpi, use_gloo):
        def fn():
            import spark_estimators.collective.torch as hvd
            import torch

            hvd.init()
            print(f'running fn {hvd.size()}')
            print(f'error line', file=sys.stderr)
            res = hvd.allgather(torch.tensor([hvd.rank()])).tolist()
            return res, hvd.rank()

        stdout = io.StringIO()
        stderr = io.StringIO()
        with spark_session('test_happy_run'):
            with is_built(gloo_is_built=use_gloo, mpi_is_built=use_mpi):
                res = spark_estimators.run(fn, start_timeout=10,
                                        use_mpi=use_mpi, use_gloo=use_gloo,
                                        env={'HOROVOD_LOG_LEVEL': 'WARNING'},
                                        stdout=stdout if use_gloo else None,
                                        stderr=stderr if use_gloo else None,
                                        verbose=2)
                self.assertListEqual([([0, 1], 0), ([0, 1], 1)], res)

                if use_gloo:
                    self.assertRegex(stdout.getvalue(),
                                     r'\[[01]\]<stdout>:running fn 2\n'
                                     r'\[[01]\]<stdout>:running fn 2\n')
                    self.assertRegex(stderr.getvalue(),
                                     r'\[[01]\]<stderr>:error line\n'
                                     r'\[[01]\]<stderr>:error line\n')

    """
    Test that horovod.spark.run_elastic works properly in a simple setup.
    """
    @pytest.mark.xfail(strict=True, reason="documented difference: output lines are prefixed [rank], not horovod's [rank]<stdout>: / [rank]<stderr>: (docs/migration.md), see test_documented_differences.py")
    def test_happy_run_elastic(self):
        if not gloo_built():
            self.skipTest("Gloo is not available")

        def fn():
            # training function does not use ObjectState and @hvd.elastic.run
            # only testing distribution of state-less training function here
            # see test_spark_torch.py for testing that
            import spark_estimators.collective.torch as hvd
            import torch

            hvd.init()
            print(f'running fn {hvd.size()}')
            print(f'error line', file=sys.stderr)
            res = hvd.allgather(torch.tensor([hvd.rank()])).tolist()
            return res, hvd.rank()

        stdout = io.StringIO()
        stderr = io.StringIO()
        with spark_session('test_happy_run_elastic'):
            res = spark_estimators.run_elastic(fn, num_proc=2, min_num_proc=2, max_num_proc=2,
                                            env={'HOROVOD_LOG_LEVEL': 'WARNING'},
                                            stdout=stdout, stderr=stderr,
                                            start_timeout=30, verbose=2)  # conformance: changed: was 10 s; a fresh session on 2 busy cores needs more
            self.assertListEqual([([0, 1], 0), ([0, 1], 1)], res)
            self.assertRegex(stdout.getvalue(),
                             r'\[[01]\]<stdout>:running fn 2\n'
                             r'\[[01]\]<stdout>:running fn 2\n')
            self.assertRegex(stderr.getvalue(),
                             r'\[[01]\]<stderr>:error line\n'
                             r'\[[01]\]<stderr>:error line\n')

    """
    Test that horovod.spark.run times out when it does not start up fast enough using Gloo.
    """
    @pytest.mark.xfail(strict=True, reason="documented difference: num_proc above the task slots fails at once naming the slot count (and fn=None is refused) instead of timing out (docs/migration.md), see test_documented_differences.py")
    def test_timeout_with_gloo(self):
        if not gloo_built():
            self.skipTest("Gloo is not available")

        self.do_test_timeout(use_mpi=False, use_gloo=True)

    """
    Actually tests that horovod.spark.run times out when it does not start up fast enough.
    """
    def do_test_timeout(self, use_mpi, use_gloo):
        # with 2 cores and 4 num_proc this spark run will never start up completely and time out
        with spark_session('test_timeout', cores=2):
            with is_built(gloo_is_built=use_gloo, mpi_is_built=use_mpi):
                with pytest.raises(Exception, match='^Timed out waiting for Spark tasks to start.'):
                    spark_estimators.run(None, num_proc=4, start_timeout=5,
                                      use_mpi=use_mpi, use_gloo=use_gloo,
                                      verbose=0)

    @pytest.mark.skipif(version.parse(pyspark.__version__) < version.parse('3.0.0'),
                        reason='get_available_devices only supported in Spark 3.0 and above')
    @pytest.mark.slow  # conformance: a local-cluster with fake GPUs in a spawned process
    def test_get_available_devices(self):
        res = run_get_available_devices()
        # we expect res being list of (devices, rank)
        # to be either [(['0'], 0), (['1'], 1)] or [(['1'], 0), (['0'], 1)]
        self.assertEqual([0, 1], [rank for (_, rank) in res])
        self.assertListEqual([['0'], ['1']], sorted([devices for (devices, _) in res]))
