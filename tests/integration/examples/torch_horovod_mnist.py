"""horovod.spark's pytorch_spark_mnist example, ported.

The seed docs (003_*.txt, "Horovod on Spark") show no TorchEstimator code; they link the
Lightning sibling of this example (lightning_mnist_synthetic.py). This port keeps that
example's pipeline: Store.create, SparkBackend, TorchEstimator with
input_shapes=[[-1, 1, 28, 28]], a lambda loss, setOutputCols, a UDF argmax and a
MulticlassClassificationEvaluator. What differs, and why:

- imports: ``horovod.spark.torch`` -> ``spark_estimators.torch``,
  ``horovod.spark.common.backend.SparkBackend`` -> ``spark_estimators.SparkBackend``,
  ``horovod.spark.common.store.Store`` -> ``spark_estimators.store.Store``;
- data: synthetic 28x28 digits (each class lights its own block of pixels; 600 train and 200
  test rows) instead of downloading MNIST, so it runs offline; the unused one-hot step is gone;
- size for a 2-core test machine: a narrower Net (4 and 8 conv channels, 32 hidden units),
  4 epochs of batch 32 at lr 0.05, seeded weights, a ``main(spark)`` returning the accuracy
  instead of argparse and its own session.
"""

import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.ml.linalg import Vectors
from pyspark.sql import types as T
from pyspark.sql.functions import udf

# --- the only lines that differ from horovod's example -------------------------------------
import spark_estimators.torch as hvd  # was: import horovod.spark.torch as hvd
from spark_estimators import SparkBackend  # was: from horovod.spark.common.backend import ...
from spark_estimators.store import Store  # was: from horovod.spark.common.store import Store

# --------------------------------------------------------------------------------------------


def synthetic_mnist(spark, n, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    images = rng.normal(0.0, 0.3, size=(n, 28, 28))
    for i, label in enumerate(labels):
        r, c = divmod(int(label), 5)
        images[i, 4 + r * 12 : 12 + r * 12, 1 + c * 5 : 5 + c * 5] += 2.0
    rows = [(float(labels[i]), Vectors.dense(images[i].ravel().tolist())) for i in range(n)]
    return spark.createDataFrame(rows, ["label", "features"])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(128, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 128)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, -1)


def main(spark, num_proc=2, epochs=4, batch_size=32, learning_rate=0.05):
    work_dir = tempfile.mkdtemp(prefix="hvd-mnist-")
    # Setup our store for intermediate data
    store = Store.create(work_dir)

    train_df = synthetic_mnist(spark, 600, seed=1)
    test_df = synthetic_mnist(spark, 200, seed=2)

    # Train a Horovod Spark Estimator on the DataFrame
    torch.manual_seed(0)
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=learning_rate, momentum=0.5)
    loss = nn.NLLLoss()

    backend = SparkBackend(
        num_proc=num_proc, stdout=sys.stdout, stderr=sys.stderr, prefix_output_with_timestamp=True
    )
    torch_estimator = hvd.TorchEstimator(
        backend=backend,
        store=store,
        model=model,
        optimizer=optimizer,
        loss=lambda input, target: loss(input, target.long()),
        input_shapes=[[-1, 1, 28, 28]],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=batch_size,
        epochs=epochs,
        validation=0.1,
        verbose=1,
    )

    torch_model = torch_estimator.fit(train_df).setOutputCols(["label_prob"])

    # Evaluate the model on the held-out test DataFrame
    pred_df = torch_model.transform(test_df)
    argmax = udf(lambda v: float(np.argmax(v)), returnType=T.DoubleType())
    pred_df = pred_df.withColumn("label_pred", argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(
        predictionCol="label_pred", labelCol="label", metricName="accuracy"
    )
    accuracy = evaluator.evaluate(pred_df)
    print("Test accuracy:", accuracy)
    return accuracy, torch_model


if __name__ == "__main__":
    from spark_estimators.core.session import create_local_session

    main(create_local_session())
