"""Train with cring on Ray Train, then serve the checkpoint with Ray Serve.

CRingTrainer trains a small classifier on synthetic data over --num-workers
workers (cring.torch, the Horovod API); rank 0 reports the weights as a Ray
Train checkpoint. A Ray Serve deployment loads that checkpoint and answers
JSON requests over HTTP, on the loopback interface only (127.0.0.1). The
script then queries it over HTTP with held-out samples, checks the answers
equal the checkpoint's model run here, prints the accuracy, and shuts Serve
and Ray down. Needs ray[serve] (pip install "ray[train,serve]").

    python examples/serve_ray.py                 # a local Ray instance, a free port
    python examples/serve_ray.py --port 8000
"""

import argparse
import json
import os
import socket
import tempfile
import time
import urllib.request

import ray
import ray.train
import torch
import torch.nn.functional as F
from ray import serve
from ray.train import RunConfig, ScalingConfig

from cring.ray import CRingTrainer

DIM, CLASSES = 16, 4
HOST = "127.0.0.1"  # Serve's HTTP proxy listens here only


def make_data(n: int, seed: int):
    """Gaussian blobs around fixed class centres (the same centres for any seed)."""
    centres = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(0)) * 0.7
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    return centres[labels] + torch.randn(n, DIM, generator=g), labels


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    )


def train_loop_per_worker(config: dict) -> None:
    import cring.torch as hvd

    torch.set_num_threads(1)
    hvd.init()  # rank, size and rendezvous come from CRingTrainer
    rank, size = hvd.rank(), hvd.size()
    x_all, y_all = make_data(config["samples"], seed=1)
    x, y = x_all[rank::size], y_all[rank::size]
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    batch = config["batch"]
    for epoch in range(config["epochs"]):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for step in range(len(x) // batch):
            idx = order[step * batch : (step + 1) * batch]
            optimizer.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
        with torch.no_grad():
            loss = F.cross_entropy(model(x), y)
        loss = hvd.allreduce(loss, name="epoch_loss").item()
        if rank == 0 and epoch == config["epochs"] - 1:
            with tempfile.TemporaryDirectory() as d:
                torch.save(model.state_dict(), os.path.join(d, "model.pt"))
                ray.train.report(
                    {"epoch": epoch, "loss": loss},
                    checkpoint=ray.train.Checkpoint.from_directory(d),
                )
        else:
            ray.train.report({"epoch": epoch, "loss": loss})


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Classifier:
    """Loads the trained weights from the checkpoint directory once; each
    request is JSON {"inputs": [[...DIM numbers...], ...]} and gets back
    {"classes": [...], "probabilities": [[...], ...]}."""

    def __init__(self, checkpoint_dir: str) -> None:
        torch.set_num_threads(1)
        self.model = make_model()
        self.model.load_state_dict(torch.load(os.path.join(checkpoint_dir, "model.pt")))
        self.model.eval()

    async def __call__(self, request) -> dict:
        body = await request.json()
        inputs = torch.tensor(body["inputs"], dtype=torch.float32)
        if inputs.dim() != 2 or inputs.shape[1] != DIM:
            return {"error": f"inputs must be a list of rows of {DIM} numbers"}
        with torch.no_grad():
            probabilities = torch.softmax(self.model(inputs), dim=1)
        return {
            "classes": probabilities.argmax(dim=1).tolist(),
            "probabilities": probabilities.tolist(),
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def query(url: str, rows: list, timeout_s: float) -> dict:
    """POST rows to the deployment, retrying while the proxy comes up (bounded)."""
    data = json.dumps({"inputs": rows}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(
            url, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except OSError:  # connection refused or reset, 404/503 while the route comes up
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    parser.add_argument("--queries", type=int, default=200, help="held-out samples to send")
    parser.add_argument(
        "--storage-path", default=os.path.join(tempfile.gettempdir(), "cring_serve_ray")
    )
    args = parser.parse_args()
    port = args.port or free_port()

    # one logical CPU per training worker, plus one for Train's own actor
    ray.init(num_cpus=args.num_workers + 1, include_dashboard=False)
    try:
        trainer = CRingTrainer(
            train_loop_per_worker,
            train_loop_config={
                "lr": args.lr,
                "epochs": args.epochs,
                "samples": args.samples,
                "batch": args.batch,
            },
            scaling_config=ScalingConfig(num_workers=args.num_workers),
            run_config=RunConfig(
                name=time.strftime("cring_serve_ray_%Y%m%d_%H%M%S"),
                storage_path=args.storage_path,
            ),
        )
        result = trainer.fit()
        checkpoint_dir = result.checkpoint.path  # a local directory (local storage_path)
        print(f"trained: loss {result.metrics['loss']:.4f}; checkpoint {checkpoint_dir}")

        serve.start(http_options={"host": HOST, "port": port})
        serve.run(Classifier.bind(checkpoint_dir), name="classifier", route_prefix="/classify")
        url = f"http://{HOST}:{port}/classify"
        x, y = make_data(args.queries, seed=2)  # held out: not the training seed
        answer = query(url, x.tolist(), timeout_s=120)
        served = torch.tensor(answer["classes"])

        local = make_model()  # the checkpoint's model, run here: the same answers
        local.load_state_dict(torch.load(os.path.join(checkpoint_dir, "model.pt")))
        with torch.no_grad():
            expected = local(x).argmax(dim=1)
        same = bool(torch.equal(served, expected))
        accuracy = (served == y).float().mean().item()
        print(
            f"served {len(served)} predictions over HTTP at {url}: accuracy {accuracy:.3f}, "
            f"{'equal to' if same else 'DIFFERENT from'} the checkpoint's model run locally"
        )
        if not same:
            raise SystemExit("the served predictions differ from the checkpoint's model")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
