"""The seed's horovod.torch training script (Horovod with PyTorch > Example), ported by imports.

Seed: 003_*.txt, "Horovod with PyTorch", the "Example" block. Run it as the seed runs scripts
(``horovodrun -np 2 python train.py``)::

    python -m spark_estimators.launch -np 2 tests/integration/examples/seed_torch_script.py

or inside Spark tasks with ``spark_estimators.run(main)`` (the seed's "Horovod Spark Run").

Changed lines (imports only):

- ``import horovod.torch as hvd`` -> ``import spark_estimators.collective.torch as hvd``

The seed leaves ``train_dataset = ...``, ``model = ...``, ``batch_size=...``,
``args.log_interval`` and the imports of ``optim``/``F`` to the reader: here a 10-class dataset
of 512 noisy points (a TensorDataset), a small MLP ending in ``log_softmax`` (the seed's loss is
``F.nll_loss``), ``batch_size=32``, ``log_interval=4`` and 3 epochs instead of 100. The seed
pins the GPU and calls ``model.cuda()`` unguarded; on CPU both are guarded with
``torch.cuda.is_available()`` as the seed's own step 2 shows, and the optimizer gets a
learning rate (``optim.SGD`` has none by default in older torch; 0.1 here). Each rank prints
``RESULT {json}``: its rank, first and last epoch losses and a hash of its final weights.
"""

import hashlib
import json
import types

import torch
import torch.nn.functional as F
import torch.optim as optim

import spark_estimators.collective.torch as hvd  # was: import horovod.torch as hvd

args = types.SimpleNamespace(log_interval=4)


def make_dataset():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 8, generator=g) * 3
    target = torch.randint(0, 10, (512,), generator=g)
    data = centers[target] + torch.randn(512, 8, generator=g)
    return torch.utils.data.TensorDataset(data, target)


def main(epochs=3):
    # ---- the seed's example -------------------------------------------------------------------
    # Initialize Horovod
    hvd.init()

    # Pin GPU to be used to process local rank (one GPU per process)
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())

    # Define dataset...
    train_dataset = make_dataset()

    # Partition dataset among workers using DistributedSampler
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )

    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=32, sampler=train_sampler)

    # Build model...
    torch.manual_seed(hvd.rank())  # different initial weights: the broadcast must fix them
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
        torch.nn.LogSoftmax(dim=1),
    )
    if torch.cuda.is_available():
        model.cuda()

    optimizer = optim.SGD(model.parameters(), lr=0.1)

    # Add Horovod Distributed Optimizer
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    # Broadcast parameters from rank 0 to all other processes.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    epoch_losses = []
    for epoch in range(epochs):
        total, count = 0.0, 0
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                print(
                    "Train Epoch: {} [{}/{}]\tLoss: {}".format(  # noqa: UP032
                        epoch, batch_idx * len(data), len(train_sampler), loss.item()
                    )
                )
            total, count = total + loss.item(), count + 1
        epoch_losses.append(total / count)
    # ---- end of the seed's example ------------------------------------------------------------
    digest = hashlib.sha256(
        b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
    ).hexdigest()
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "shard": len(train_sampler),
        "losses": epoch_losses,
        "weights": digest,
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
