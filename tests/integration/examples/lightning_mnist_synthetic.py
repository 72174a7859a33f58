"""horovod's examples/spark/pytorch/pytorch_lightning_spark_mnist.py on spark_estimators.

What changed against horovod's example, and why:

* imports: ``horovod.spark.lightning`` -> ``spark_estimators.lightning`` (same ``TorchEstimator``
  name, same ``MIN_PL_VERSION``), ``horovod.spark.common.backend`` ->
  ``spark_estimators.core.backend``, ``horovod.spark.common.store`` -> ``spark_estimators.store``;
* data: synthetic MNIST-shaped rows (784 pixels in 0..255 as libsvm sparse vectors, 10
  classes, each a bar at its own place) instead of downloading MNIST, so it runs offline;
* Lightning 2.x removed hooks the example used: ``LightningModule.validation_epoch_end`` became
  ``on_validation_epoch_end``; ``Callback.on_init_start/on_init_end/on_epoch_end`` are gone
  (the epoch counter counts train and validation epoch ends instead);
* the train/test split is seeded, so a test can bound the accuracy;
* ``ModelCheckpoint`` and ``EarlyStopping`` are always added: horovod skipped them for torch >=
  1.13 because its own Lightning strategy broke them.

Everything else (the network, the estimator call, transform and evaluation) is horovod's.
Prints ``Test accuracy: <float>``.
"""

import argparse
import sys

import numpy as np
import pyspark.sql.types as T
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from packaging import version
from pyspark import SparkConf
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.feature import OneHotEncoder
from pyspark.ml.linalg import Vectors
from pyspark.sql import SparkSession
from pyspark.sql.functions import udf
from pytorch_lightning import LightningModule

import spark_estimators.lightning as hvd
from spark_estimators.core.backend import SparkBackend
from spark_estimators.lightning.estimator import MIN_PL_VERSION
from spark_estimators.store import Store

parser = argparse.ArgumentParser(
    description="PyTorch Spark MNIST Example",
    formatter_class=argparse.ArgumentDefaultsHelpFormatter,
)
parser.add_argument("--master", help="spark master to connect to")
parser.add_argument(
    "--num-proc",
    type=int,
    default=2,
    help="number of worker processes for training, default: `spark.default.parallelism`",
)
parser.add_argument("--batch-size", type=int, default=64, help="input batch size for training")
parser.add_argument("--epochs", type=int, default=12, help="number of epochs to train")
parser.add_argument(
    "--work-dir",
    default="/tmp",
    help="temporary working directory to write intermediate files (a path or a store URL)",
)
parser.add_argument(
    "--data-dir",
    default="/tmp",
    help="unused: the data is synthetic",
)
parser.add_argument("--rows", type=int, default=2000, help="number of synthetic rows")
parser.add_argument("--enable-profiler", action="store_true", help="Enable profiler")
parser.add_argument("--seed", type=int, default=None, help="seed of the model's initial weights")


def synthetic_mnist(spark, rows, seed=0):
    """MNIST-like libsvm rows: class k is a bar of 1.0-valued pixels at its place, plus noise.

    Pixels are in [0, 1] like the mnist libsvm file the original example downloads (raw 0-255
    values made SGD at lr 0.01 depend on the initial weights: accuracy 0.09-0.9 after 2 epochs).
    """
    rng = np.random.default_rng(seed)
    templates = np.zeros((10, 28, 28))
    for k in range(10):
        top, left = 2 + 12 * (k // 5), 1 + 5 * (k % 5)
        templates[k, top : top + 12, left : left + 5] = 1.0
    templates = templates.reshape(10, 784)
    data = []
    for label in rng.integers(0, 10, size=rows):
        pixels = templates[label] * (rng.random(784) < 0.8) + (rng.random(784) < 0.03) * 1.0
        idx = np.flatnonzero(pixels)
        data.append((float(label), Vectors.sparse(784, idx.tolist(), pixels[idx].tolist())))
    return spark.createDataFrame(data, ["label", "features"])


def train_model(args):
    # do not run this test for pytorch lightning below min supported verson
    import pytorch_lightning as pl

    if version.parse(pl.__version__) < version.parse(MIN_PL_VERSION):
        print(
            f"Skip test for pytorch_ligthning=={pl.__version__}, "
            f"min support version is {MIN_PL_VERSION}"
        )
        return

    # Initialize SparkSession
    conf = SparkConf().setAppName("pytorch_spark_mnist").set("spark.sql.shuffle.partitions", "16")
    if args.master:
        conf.setMaster(args.master)
    elif args.num_proc:
        conf.setMaster(f"local[{args.num_proc}]")
    spark = SparkSession.builder.config(conf=conf).getOrCreate()

    # Setup our store for intermediate data
    store = Store.create(args.work_dir)

    # Synthetic stand-in for the MNIST libsvm download
    df = synthetic_mnist(spark, args.rows)

    # One-hot encode labels into SparseVectors
    encoder = OneHotEncoder(inputCols=["label"], outputCols=["label_vec"], dropLast=False)
    model = encoder.fit(df)
    train_df = model.transform(df)

    # Train/test split
    train_df, test_df = train_df.randomSplit([0.9, 0.1], seed=1)

    # Define the PyTorch model without any Horovod-specific parameters
    class Net(LightningModule):
        def __init__(self, kernel_size):
            super().__init__()
            # The Lightning checkpoint also saves the arguments passed into the LightningModule
            # init under the "hyper_parameters" key in the checkpoint.
            self.save_hyperparameters()
            self.conv1 = nn.Conv2d(1, 10, kernel_size=kernel_size)
            self.conv2 = nn.Conv2d(10, 20, kernel_size=kernel_size)
            self.conv2_drop = nn.Dropout2d()
            self.fc1 = nn.Linear(320, 50)
            self.fc2 = nn.Linear(50, 10)
            self.val_losses = []

        def forward(self, x):
            x = x.float().reshape((-1, 1, 28, 28))
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
            x = x.view(-1, 320)
            x = F.relu(self.fc1(x))
            x = F.dropout(x, training=self.training)
            x = self.fc2(x)
            return F.log_softmax(x, -1)

        def configure_optimizers(self):
            return optim.SGD(self.parameters(), lr=0.01, momentum=0.5)

        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                print(f"training data batch size: {batch['label'].shape}")
            x, y = batch["features"], batch["label"]
            y_hat = self(x)
            loss = F.nll_loss(y_hat, y.long())
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            if batch_idx == 0:
                print(f"validation data batch size: {batch['label'].shape}")
            x, y = batch["features"], batch["label"]
            y_hat = self(x)
            loss = F.nll_loss(y_hat, y.long())
            self.log("val_loss", loss)
            self.val_losses.append(loss)

        # Lightning 2.x: replaces validation_epoch_end(self, outputs)
        def on_validation_epoch_end(self):
            outputs = self.val_losses
            avg_loss = torch.stack(outputs).mean() if len(outputs) > 0 else float("inf")
            self.log("avg_val_loss", avg_loss)
            self.val_losses.clear()

    if args.seed is not None:
        torch.manual_seed(args.seed)
    model = Net(5)

    # Train a Horovod Spark Estimator on the DataFrame
    backend = SparkBackend(
        num_proc=args.num_proc,
        stdout=sys.stdout,
        stderr=sys.stderr,
        prefix_output_with_timestamp=True,
    )

    from pytorch_lightning.callbacks import Callback

    epochs = args.epochs

    class MyDummyCallback(Callback):
        def __init__(self):
            self.epcoh_end_counter = 0
            self.train_epcoh_end_counter = 0
            self.validation_epoch_end_counter = 0

        def on_train_epoch_end(self, trainer, model):
            print("A train epoch ended.")
            self.epcoh_end_counter += 1
            self.train_epcoh_end_counter += 1

        def on_validation_epoch_end(self, trainer, model):
            print("A val epoch ended.")
            self.epcoh_end_counter += 1
            self.validation_epoch_end_counter += 1

        def on_train_end(self, trainer, model):
            print(
                "Training ends:"
                f"epcoh_end_counter={self.epcoh_end_counter}, "
                f"train_epcoh_end_counter={self.train_epcoh_end_counter}, "
                f"validation_epoch_end_counter={self.validation_epoch_end_counter} \n"
            )
            assert self.train_epcoh_end_counter <= epochs
            assert (
                self.epcoh_end_counter
                == self.train_epcoh_end_counter + self.validation_epoch_end_counter
            )

    callbacks = [MyDummyCallback()]

    # ModelCheckpoint
    from pytorch_lightning.callbacks.model_checkpoint import ModelCheckpoint

    callbacks.append(ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=1, verbose=True))
    # EarlyStopping
    from pytorch_lightning.callbacks.early_stopping import EarlyStopping

    callbacks.append(
        EarlyStopping(monitor="val_loss", min_delta=0.001, patience=3, verbose=True, mode="min")
    )

    torch_estimator = hvd.TorchEstimator(
        backend=backend,
        store=store,
        model=model,
        input_shapes=[[-1, 1, 28, 28]],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation=0.1,
        verbose=1,
        callbacks=callbacks,
        profiler="simple" if args.enable_profiler else None,
    )

    torch_model = torch_estimator.fit(train_df).setOutputCols(["label_prob"])

    # Evaluate the model on the held-out test DataFrame
    pred_df = torch_model.transform(test_df)

    argmax = udf(lambda v: float(np.argmax(v)), returnType=T.DoubleType())
    pred_df = pred_df.withColumn("label_pred", argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(
        predictionCol="label_pred", labelCol="label", metricName="accuracy"
    )
    print("Test accuracy:", evaluator.evaluate(pred_df))

    spark.stop()


if __name__ == "__main__":
    args = parser.parse_args()
    train_model(args)
