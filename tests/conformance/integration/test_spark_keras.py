# Copyright 2019 Uber Technologies, Inc. All Rights Reserved.
# Modifications copyright (C) 2022, NVIDIA CORPORATION. All rights reserved.
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

import collections
import logging
import os
import sys
import warnings

from packaging import version

from unittest import mock
import numpy as np
import pytest
import tensorflow as tf

import pyspark.sql.types as T
from pyspark.ml.linalg import DenseVector, SparseVector
from pyspark.sql.functions import udf

import spark_estimators.keras as hvd
from spark_estimators.data import horovod_util as util
# conformance: changed: horovod.spark.common.constants is internal; the one value a ported test
# reads (its petastorm buffer cap, used there as a number of cores) is copied here.
from types import SimpleNamespace
constants = SimpleNamespace(TOTAL_BUFFER_MEMORY_CAP_GIB=4)
# conformance: horovod.spark.keras.remote, .estimator.EstimatorParams and .util
# (_custom_sparse_to_dense_fn, _serialize_param_value, TFKerasUtil) are internals used only by
# the tests that are not ported (README.md).

sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, 'utils'))

from common import temppath
from spark_common import CallbackBackend, create_mnist_data, create_xor_data, create_xor_data_with_val, local_store, spark_session


try:
    import nvtabular
    HAS_NVTABULAR=True
except ImportError:
    HAS_NVTABULAR=False


def create_xor_model():
    model = tf.keras.models.Sequential()
    model.add(tf.keras.layers.Dense(8, input_dim=2))
    model.add(tf.keras.layers.Activation('tanh'))
    model.add(tf.keras.layers.Dense(1))
    model.add(tf.keras.layers.Activation('sigmoid'))
    return model


def create_mnist_model():
    model = tf.keras.models.Sequential()
    model.add(tf.keras.layers.Conv2D(32, kernel_size=(3, 3),
                                     activation='relu',
                                     input_shape=(8, 8, 1)))
    model.add(tf.keras.layers.MaxPooling2D(pool_size=(2, 2)))
    model.add(tf.keras.layers.Dropout(0.25))
    model.add(tf.keras.layers.Flatten())
    model.add(tf.keras.layers.Dense(10, activation='softmax'))
    return model


def get_mock_fit_fn():
    def fit(model, data_module, steps_per_epoch, validation_steps, callbacks, verbose):
        for callback in callbacks:
            callback.set_model(model)
            callback.on_epoch_end(0, logs={})
        return mock.Mock()
    return fit


def get_sgd_optimizer():
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.1)  # conformance: changed: Keras 3 has no lr=
    return optimizer


class SparkKerasTests(tf.test.TestCase):
    def __init__(self, *args, **kwargs):
        super(SparkKerasTests, self).__init__(*args, **kwargs)
        logging.getLogger('py4j.java_gateway').setLevel(logging.INFO)
        warnings.simplefilter('module')

    # conformance: not ported (see README.md): the NVTabular data-module tests, and the tests
    # that mock horovod internals (remote._pin_gpu_fn, TFKerasUtil.fit_fn, remote.RemoteTrainer)
    # or test private helpers (_serialize_param_value, _custom_sparse_to_dense_fn, reshape,
    # prep_data_tf_keras_fn).

    @pytest.mark.xfail(strict=True, reason="documented difference: mp_start_method other than None is refused (no multiprocessing pool; docs/migration.md), see test_documented_differences.py")
    def test_fit_model(self):
        model = create_xor_model()
        optimizer = get_sgd_optimizer()
        loss = 'binary_crossentropy'

        with spark_session('test_fit_model') as spark:
            df = create_xor_data(spark)

            with local_store() as store:
                keras_estimator = hvd.KerasEstimator(
                    num_proc=2,
                    store=store,
                    model=model,
                    optimizer=optimizer,
                    loss=loss,
                    feature_cols=['features'],
                    label_cols=['y'],
                    batch_size=1,
                    random_seed=1,
                    epochs=3,
                    verbose=2,
                    use_gpu=False,
                    mp_start_method='spawn')

                assert not keras_estimator.getUseGpu()
                assert 'spawn' == keras_estimator.getMpStartMethod()

                keras_estimator.setMpStartMethod('forkserver')
                assert 'forkserver' == keras_estimator.getMpStartMethod()

                keras_model = keras_estimator.fit(df)

                trained_model = keras_model.getModel()
                pred = trained_model.predict([np.ones([1, 2], dtype=np.float32)])
                assert len(pred) == 1
                assert pred.dtype == np.float32

    @pytest.mark.slow  # conformance: 2 then 5 Keras ranks (TOTAL_BUFFER_MEMORY_CAP_GIB + 1) on one machine
    def test_fit_model_multiclass(self):
        model = create_mnist_model()
        optimizer = tf.keras.optimizers.Adadelta(1.0)
        loss = tf.keras.losses.categorical_crossentropy

        for num_cores in [2, constants.TOTAL_BUFFER_MEMORY_CAP_GIB + 1]:
            with spark_session('test_fit_model_multiclass', cores=num_cores) as spark:
                df = create_mnist_data(spark)

                with local_store() as store:
                    keras_estimator = hvd.KerasEstimator(
                        num_proc=num_cores,
                        store=store,
                        model=model,
                        optimizer=optimizer,
                        loss=loss,
                        metrics=['accuracy'],
                        feature_cols=['features'],
                        label_cols=['label_vec'],
                        batch_size=2,
                        epochs=2,
                        verbose=2)

                    keras_model = keras_estimator.fit(df).setOutputCols(['label_prob'])
                    pred_df = keras_model.transform(df)

                    argmax = udf(lambda v: float(np.argmax(v)), returnType=T.DoubleType())
                    pred_df = pred_df.withColumn('label_pred', argmax(pred_df.label_prob))

                    preds = pred_df.collect()
                    assert len(preds) == df.count()

                    row = preds[0]
                    label_prob = row.label_prob.toArray().tolist()
                    assert label_prob[int(row.label_pred)] == max(label_prob)

    @pytest.mark.xfail(strict=True, reason="documented difference: tensorflow_dataset_prefetch_buffer_size other than 0/None and mp_start_method are refused (docs/migration.md), see test_documented_differences.py")
    def test_fit_model_with_tensorflow_dataset_prefetch_buffer_size(self):
        model = create_xor_model()
        optimizer = get_sgd_optimizer()
        loss = 'binary_crossentropy'

        with spark_session('test_fit_model_with_tensorflow_dataset_prefetch_buffer_size') as spark:
            df = create_xor_data(spark)

            with local_store() as store:
                keras_estimator = hvd.KerasEstimator(
                    num_proc=2,
                    store=store,
                    model=model,
                    optimizer=optimizer,
                    loss=loss,
                    feature_cols=['features'],
                    label_cols=['y'],
                    batch_size=1,
                    random_seed=1,
                    epochs=3,
                    verbose=2,
                    use_gpu=False,
                    mp_start_method='spawn',
                    tensorflow_dataset_prefetch_buffer_size=1)

                assert not keras_estimator.getUseGpu()
                assert 'spawn' == keras_estimator.getMpStartMethod()

                keras_estimator.setMpStartMethod('forkserver')
                assert 'forkserver' == keras_estimator.getMpStartMethod()

                keras_model = keras_estimator.fit(df)

                trained_model = keras_model.getModel()
                pred = trained_model.predict([np.ones([1, 2], dtype=np.float32)])
                assert len(pred) == 1
                assert pred.dtype == np.float32
