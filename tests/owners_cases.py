"""Owners (node-wise placement) plan cases that run inside every rank of a real 3-rank job (gloo
through launch.spawn, or MPI): each trains a small CNN placed channel by channel for a few
SGD-momentum steps and checks on every rank that the losses and ``full_state_dict()`` equal one
process on the whole batch in float64 to 1e-10 (plan_cases.equals_one_process). Each case returns
this rank's ``par.traffic()``; tests/test_placement.py sums them over ranks and compares with the
km1 of the same partition of ``network_hypergraph``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plan_cases
from torch import nn

from hetcoll import Plan
from hetcoll.comm import wrap
from hetcoll.model import hypergraph_plan
from hetcoll.torch import parallelize

SHAPE = (3, 8, 8)
RANDOM_SEEDS = (0, 1, 2, 3)
HYPERGRAPH_SPEEDS = [2.0, 1.0, 1.0]


def cnn() -> nn.Sequential:
    """conv-BN-ReLU-pool-conv-ReLU-flatten-linear-ReLU-linear: 10 layers, awkward widths."""
    return nn.Sequential(
        nn.Conv2d(3, 7, 3, padding=1),
        nn.BatchNorm2d(7),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(7, 9, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(9 * 4 * 4, 11),
        nn.ReLU(),
        nn.Linear(11, 5),
    )


#: Conv2d / Linear layers of cnn() and their output channels.
WIDTHS = {0: 7, 4: 9, 7: 11, 9: 5}


def random_owners(seed: int, ranks: int = 3) -> dict[str, list[int]]:
    """Arbitrary sets, not contiguous; the last stage-rank owns none of layer 4."""
    rng = np.random.default_rng(seed)
    owners = {str(k): [int(v) for v in rng.integers(0, ranks, n)] for k, n in WIDTHS.items()}
    owners["4"] = [int(v) for v in rng.integers(0, ranks - 1, WIDTHS[4])]
    return owners


def random_plan(seed: int) -> dict[str, Any]:
    """One stage over all 10 layers, its lead rank 2 (not rank 0), one micro-batch: BatchNorm
    in training mode is then exact."""
    return {
        "microbatches": 1,
        "replicas": [
            {
                "samples": 12,
                "stages": [{"ranks": [2, 0, 1], "layers": [0, 10], "owners": random_owners(seed)}],
            }
        ],
    }


#: Whole layers to different ranks, pipelined over 4 (uneven) micro-batches.
LAYERS = {
    "microbatches": 4,
    "replicas": [
        {
            "samples": 14,
            "stages": [
                {
                    "ranks": [0, 1, 2],
                    "layers": [0, 10],
                    "owners": {
                        "0": [0] * 7,
                        "4": [1] * 9,
                        "7": [2] * 11,
                        "9": [1] * 2 + [0] * 3,
                    },
                }
            ],
        }
    ],
}

#: A one-rank stage, then an owners stage (the plan asks for 1F1B; the replica runs GPipe).
PIPELINE = {
    "microbatches": 3,
    "schedule": "1F1B",
    "replicas": [
        {
            "samples": 10,
            "stages": [
                {"ranks": [0], "layers": [0, 4]},
                {
                    "ranks": [2, 1],
                    "layers": [4, 10],
                    "owners": {"4": [0, 1] * 4 + [1], "7": [1, 0, 0] * 3 + [1, 1], "9": [0] * 5},
                },
            ],
        }
    ],
}

#: An owners stage before a one-rank stage: its lead sends the gathered output on.
MIDDLE = {
    "microbatches": 2,
    "schedule": "1F1B",
    "replicas": [
        {
            "samples": 9,
            "stages": [
                {
                    "ranks": [1, 2],
                    "layers": [0, 7],
                    "owners": {"0": [1, 0, 0, 1, 1, 0, 1], "4": [0, 0, 1, 1, 0, 1, 0, 1, 1]},
                },
                {"ranks": [0], "layers": [7, 10]},
            ],
        }
    ],
}

#: One rank holding the whole model beside an owners replica on two ranks.
ASYMMETRIC = {
    "microbatches": 2,
    "replicas": [
        {"samples": 7, "stages": [{"ranks": [0], "layers": [0, 10]}]},
        {
            "samples": 5,
            "stages": [
                {
                    "ranks": [1, 2],
                    "layers": [0, 10],
                    "owners": {
                        "0": [1, 0, 1, 1, 0, 0, 1],
                        "4": [1] * 9,
                        "7": [0, 1] * 5 + [0],
                        "9": [1, 1, 0, 0, 1],
                    },
                }
            ],
        },
    ],
}


def bad_input(group: Any) -> int:
    """Placements that cannot run raise the same ValueError on every rank, before any
    transfer; returns how many were checked."""
    checked = 0
    model = cnn().double()

    def raises(text: str, plan: dict[str, Any], net: nn.Module = model) -> None:
        nonlocal checked
        try:
            parallelize(net, plan, loss_fn=nn.CrossEntropyLoss(), group=group)
        except ValueError as e:
            assert text in str(e), (text, str(e))
            checked += 1
            return
        raise AssertionError(f"no ValueError ({text})")

    def stage(owners: dict[str, list[int]], layers: tuple[int, int] = (0, 10)) -> dict[str, Any]:
        return {
            "replicas": [
                {
                    "samples": 4,
                    "stages": [{"ranks": [0, 1, 2], "layers": list(layers), "owners": owners}],
                }
            ]
        }

    good = random_owners(0)
    raises(
        "plan.replicas[0].stages[0].owners['4']: needs one owner per output channel of '4' (9)",
        stage({**good, "4": [0] * 8}),
    )
    no_linear = {k: v for k, v in good.items() if k != "9"}
    raises("plan.replicas[0].stages[0].owners: has no entry for layer 9", stage(no_linear))
    raises(
        "plan.replicas[0].stages[0].owners['2']: '2' is a ReLU",
        stage({**good, "2": [0] * 7}),
    )
    starts = {
        "replicas": [
            {
                "samples": 4,
                "stages": [
                    {"ranks": [0], "layers": [0, 2]},
                    {"ranks": [1, 2], "layers": [2, 10], "owners": {"4": [0] * 9}},
                ],
            }
        ]
    }
    raises("layer 2 ('2', ReLU) starts the stage", starts)

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(7, 7, 3, padding=1)

        def forward(self, x: Any) -> Any:
            return x + self.conv(x)

    residual = nn.Sequential(nn.Conv2d(3, 7, 3, padding=1), Residual(), nn.Flatten()).double()
    plan = {
        "replicas": [
            {
                "samples": 4,
                "stages": [{"ranks": [0, 1, 2], "layers": [0, 3], "owners": {"0": [0] * 7}}],
            }
        ]
    }
    raises("layer 1 ('1', Residual) holds parameters", plan, residual)
    return checked


def memory_follows_ownership(group: Any) -> bool:
    """A rank holds exactly its channels' weights: Conv2d / Linear rows and bias entries, and
    the matching BatchNorm entries."""
    rank = wrap(group).rank
    model = cnn().double()
    plan = random_plan(0)
    stage = plan["replicas"][0]["stages"][0]
    par = parallelize(model, plan, loss_fn=nn.CrossEntropyLoss(), group=group)
    want = 0
    for key, owners in stage["owners"].items():
        layer = model[int(key)]
        mine = sum(1 for i in owners if stage["ranks"][i] == rank)
        per_channel = layer.weight[0].numel() + 1 + (2 if key == "0" else 0)  # BatchNorm2d
        want += mine * per_channel
    return sum(p.numel() for p in par.parameters()) == want


def run_all(group: Any) -> dict[str, Any]:
    assert wrap(group).size == 3
    out_memory = memory_follows_ownership(group)
    eq = plan_cases.equals_one_process
    out: dict[str, Any] = {}
    out["random"] = [
        eq(group, cnn, Plan.from_dict(random_plan(seed)), SHAPE) for seed in RANDOM_SEEDS
    ]
    out["layers"] = eq(group, cnn, Plan.from_dict(LAYERS), SHAPE, eval_mode=True)
    out["pipeline"] = eq(group, cnn, Plan.from_dict(PIPELINE), SHAPE, eval_mode=True)
    out["middle"] = eq(group, cnn, Plan.from_dict(MIDDLE), SHAPE, eval_mode=True)
    out["asymmetric"] = eq(group, cnn, Plan.from_dict(ASYMMETRIC), SHAPE, eval_mode=True)
    plan = hypergraph_plan(cnn().double(), SHAPE, HYPERGRAPH_SPEEDS, 12, microbatches=2)
    out["hypergraph"] = eq(group, cnn, plan, SHAPE, eval_mode=True)
    out["errors"] = bad_input(group)
    out["memory"] = out_memory
    return out


def run_torch(rank: int, world: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    return run_all(None)
