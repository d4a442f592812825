"""The Ray Train script docs/examples/ray_train_digits.py was ported from (tests/e2e/test_loop_guides.py diffs the
two): Ray's Fashion-MNIST example, python/ray/train/examples/pytorch/torch_fashion_mnist_example.py in
github.com/ray-project/ray (Apache-2.0; read at commit 048bcae12e6325146c496ee0b233ea739dfea7ff), moved to
scikit-learn's handwritten digits so that nothing is downloaded. It is written for Ray Train
(`pip install "ray[train]" scikit-learn`); the tests diff it, they do not run it. What differs from Ray's file: get_dataloaders reads the digits (8x8, so
the first layer takes 64 inputs) and shuffles the training set; the network is one hidden layer of 128; no tqdm;
lr 5e-2; the sampler's set_epoch from Ray's user guide; the workers and epochs from the command line.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ray.train
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer


def get_dataloaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    # was: FashionMNIST(root="~/data", download=True, ...); the digits ship with scikit-learn, split as
    # mixtrain's built-in digits example splits them (80% to train, seeded)
    from mixtrain.examples.digits import load_digits

    (x, y), (x_test, y_test) = load_digits()
    training_data = TensorDataset(x.reshape(len(x), 64), y)
    test_data = TensorDataset(x_test.reshape(len(x_test), 64), y_test)
    train_dataloader = DataLoader(training_data, batch_size=batch_size, shuffle=True)
    test_dataloader = DataLoader(test_data, batch_size=batch_size)
    return train_dataloader, test_dataloader


class NeuralNetwork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_relu_stack = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_relu_stack(x)


def train_func_per_worker(config: dict) -> None:
    lr = config["lr"]
    epochs = config["epochs"]
    batch_size = config["batch_size_per_worker"]

    # Get dataloaders inside the worker training function
    train_dataloader, test_dataloader = get_dataloaders(batch_size=batch_size)

    # [1] Prepare Dataloader for distributed training
    # Shard the datasets among workers and move batches to the correct device
    train_dataloader = ray.train.torch.prepare_data_loader(train_dataloader)
    test_dataloader = ray.train.torch.prepare_data_loader(test_dataloader)

    model = NeuralNetwork()

    # [2] Prepare and wrap your model with DistributedDataParallel
    # Move the model to the correct GPU/CPU device
    model = ray.train.torch.prepare_model(model)

    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    # Model training loop
    for epoch in range(epochs):
        if ray.train.get_context().get_world_size() > 1:
            # Required for the distributed sampler to shuffle properly across epochs.
            train_dataloader.sampler.set_epoch(epoch)

        model.train()
        for X, y in train_dataloader:
            pred = model(X)
            loss = loss_fn(pred, y)

            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        model.eval()
        test_loss, num_correct, num_total = 0, 0, 0
        with torch.no_grad():
            for X, y in test_dataloader:
                pred = model(X)
                loss = loss_fn(pred, y)

                test_loss += loss.item()
                num_total += y.shape[0]
                num_correct += (pred.argmax(1) == y).sum().item()

        test_loss /= len(test_dataloader)
        accuracy = num_correct / num_total

        # [3] Report metrics to Ray Train
        # ===============================
        ray.train.report(metrics={"loss": test_loss, "accuracy": accuracy})


def train_digits(num_workers: int = 2, use_gpu: bool = False, epochs: int = 10):
    global_batch_size = 32

    train_config = {"lr": 5e-2, "epochs": epochs, "batch_size_per_worker": global_batch_size // num_workers}

    # Configure computation resources
    scaling_config = ScalingConfig(num_workers=num_workers, use_gpu=use_gpu)

    # Initialize a Ray TorchTrainer
    trainer = TorchTrainer(
        train_loop_per_worker=train_func_per_worker,
        train_loop_config=train_config,
        scaling_config=scaling_config,
    )

    # [4] Start distributed training
    # Run `train_func_per_worker` on all workers
    # =============================================
    result = trainer.fit()
    print(f"Training result: {result}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--use-gpu", action="store_true")
    args = parser.parse_args()
    train_digits(num_workers=args.workers, use_gpu=args.use_gpu, epochs=args.epochs)
