# Copyright 2019 Uber Technologies, Inc. All Rights Reserved.
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
# conformance: horovod's examples/tensorflow2/tensorflow2_keras_mnist.py at 2626dc87 (Apache-2.0, see ../README.md),
# imports changed to spark_estimators; other changes are marked "# conformance: changed:".

import sys

import tensorflow as tf

import spark_estimators
import spark_estimators.collective.keras as hvd

import os  # conformance: changed: the synthetic data file, step and epoch counts come from the harness
import numpy  # conformance: changed: the report at the end


def main():
    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    with numpy.load(os.environ['CONFORMANCE_MNIST_NPZ']) as data:  # conformance: changed: synthetic MNIST-shaped data instead of the download
        (mnist_images, mnist_labels) = (data['x_train'], data['y_train'])  # conformance: changed: (same)

    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
                 tf.cast(mnist_labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients.
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'],
                        jit_compile=False)  # conformance: changed: Keras 3's compile has no experimental_run_tf_function; its counterpart is jit_compile=False (XLA cannot compile the allreduce)

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),

        # Horovod: average metrics among workers at the end of every epoch.
        #
        # Note: This callback must be in the list before the ReduceLROnPlateau,
        # TensorBoard or other metrics-based callbacks.
        hvd.callbacks.MetricAverageCallback(),

        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.keras'))  # conformance: changed: Keras 3's ModelCheckpoint saves whole models as .keras

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    history = mnist_model.fit(dataset, steps_per_epoch=int(os.environ.get('CONFORMANCE_STEPS', 500)) // hvd.size(), callbacks=callbacks, epochs=int(os.environ.get('CONFORMANCE_EPOCHS', 24)), verbose=verbose)  # conformance: changed: fewer steps and epochs on a 2-core machine; the history for the report below

    # conformance: changed: added - the accuracy on the first 1000 images and a checksum of the weights, for the harness
    probs = mnist_model.predict(tf.cast(mnist_images[:1000, ..., tf.newaxis] / 255.0, tf.float32), verbose=0)
    accuracy = float(numpy.mean(numpy.argmax(probs, axis=1) == mnist_labels[:1000]))
    checksum = float(sum(numpy.abs(w).sum(dtype=numpy.float64) for w in mnist_model.get_weights()))
    print('Rank %d: accuracy %.4f, weights %.9e, lr %.6f, epoch accuracy %s' % (
        hvd.rank(), accuracy, checksum, float(mnist_model.optimizer.learning_rate.numpy()),
        ['%.4f' % a for a in history.history['accuracy']]), flush=True)


if __name__ == '__main__':
    if len(sys.argv) == 4:
        # run training through horovod.run
        np = int(sys.argv[1])
        hosts = sys.argv[2]
        comm = sys.argv[3]
        print('Running training through horovod.run')
        spark_estimators.run(main, num_proc=np, use_gloo=comm == 'gloo', use_mpi=comm == 'mpi')  # conformance: changed: run() takes num_proc; the hosts are Spark's task slots
    else:
        # this is running via horovodrun
        main()
