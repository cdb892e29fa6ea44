"""Worker for tests/test_elastic.py: cring.torch.elastic.ElasticSampler in a
TorchState under `cringrun --elastic`. Every step allreduces the one-hot
counts of the samples its batch holds into state.seen[epoch] (committed and
restored with the rest of the state), so that the survivors' final
state.seen says how often the job trained on each sample in each epoch.

  --steps, --commit-every, --kill, --kill-during, --out: see elastic_common.py
  (--steps is unused: the run ends after --epochs epochs of the dataset)
  --samples N --batch-size B --epochs E
"""

import torch

import cring.torch as hvd
import cring.torch.elastic

if __name__ == "__main__":
    from elastic_common import Killer, parser

    torch.set_num_threads(1)
    p = parser()
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    me = Killer(args)

    hvd.init()
    n = args.samples
    dataset = torch.utils.data.TensorDataset(torch.arange(n))
    sampler = cring.torch.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    state = cring.torch.elastic.TorchState(
        sampler=sampler, seen=torch.zeros(args.epochs, n), epoch=0, step=0, sizes=[]
    )

    @cring.torch.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            for batch_idx, (idx,) in enumerate(loader):
                me.before_step(state.step)
                counts = torch.zeros(n).index_add_(0, idx, torch.ones(len(idx)))
                state.seen[state.epoch] += hvd.allreduce(counts, op=hvd.Sum, name="seen")
                state.sampler.record_batch(batch_idx, args.batch_size)
                state.sizes.append(hvd.size())
                state.step += 1
                if state.step % args.commit_every == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    me.write_result(
        {
            "rank": hvd.rank(),
            "size": hvd.size(),
            "seen": state.seen.tolist(),
            "sizes": state.sizes,
        }
    )
