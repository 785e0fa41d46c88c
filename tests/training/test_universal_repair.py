"""training.engines.deepspeed.repair_universal_load on a hand-built optimizer state shaped like the one
deepspeed 0.19's universal-checkpoint load leaves behind (no DeepSpeed run needed)."""
from types import SimpleNamespace

import torch

from training.engines.deepspeed import repair_universal_load


def _loaded_state(fused: bool):
    # Parameters on the meta device stand in for GPU ones: a CPU-only run can still tell "beside the
    # parameter" from "on the CPU".
    params = [torch.nn.Parameter(torch.empty(4, device="meta")) for _ in range(3)]
    shared_step = torch.tensor(7.0)  # what the load does: one CPU tensor for every state
    # Group 0 lists only one of its two partitions, as ZeRO-3 leaves it (it swaps sub-group partitions
    # in and out of param_groups); the state holds all three. Group 0's weight decay copied onto 1.
    groups = [{"params": params[:1], "weight_decay": 0.1, "lr": 1e-3, "fused": fused},
              {"params": params[2:], "weight_decay": 0.1, "lr": 1e-3, "fused": fused}]
    state = {p: {"step": shared_step, "exp_avg": torch.empty(4, device="meta")} for p in params}
    return SimpleNamespace(param_groups=groups, state=state), params


def test_fused_groups_get_one_float32_step_each_beside_the_parameter():
    opt, params = _loaded_state(fused=True)
    repair_universal_load(opt, [{"weight_decay": 0.1, "fused": True}, {"weight_decay": 0.0, "fused": True}])
    steps = [opt.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == 3  # one each (the loaded state shared one)
    assert all(s.device.type == "meta" and s.dtype == torch.float32 and s.dim() == 0 for s in steps)
    assert opt.param_groups[1]["weight_decay"] == 0.0  # the group's own hyperparameters back
    assert opt.param_groups[0]["lr"] == 1e-3  # lr is the schedule's, left alone


def test_unfused_groups_keep_step_on_the_cpu_with_its_value():
    opt, params = _loaded_state(fused=False)
    repair_universal_load(opt, [{"fused": False}, {"fused": False}])
    steps = [opt.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == 3
    assert all(s.device.type == "cpu" and s.item() == 7.0 for s in steps)
    steps[0] += 1  # Adam's increment of one state leaves the others alone
    assert steps[1].item() == 7.0
