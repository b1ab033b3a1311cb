"""DistributedMuon refuses DTensor parameters and points to DTensorMuon (one process, world 1)."""

import gc

import pytest
import torch
import torch.distributed as dist

import muonscale


@pytest.mark.timeout(120)
def test_distributed_muon_rejects_dtensor_parameters(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        with pytest.raises(TypeError, match="'blocks.0.fc.weight' is a DTensor.*DTensorMuon"):
            muonscale.DistributedMuon([("blocks.0.fc.weight", weight)], lr=1e-3)
        opt = muonscale.DTensorMuon([("blocks.0.fc.weight", weight)], lr=1e-3)
        assert opt.param_groups[0]["algorithm"] == "muon"
        del weight, opt, mesh
        gc.collect()
    finally:
        dist.destroy_process_group()
