"""``muonscale.distributed_muon`` picks DTensorMuon for DTensor parameters and DistributedMuon for
plain tensors; DistributedMuon and Muon themselves refuse DTensors (one process, world 1)."""

import gc

import pytest
import torch
import torch.distributed as dist

import muonscale


@pytest.mark.timeout(120)
def test_distributed_muon_factory_picks_the_class_by_parameter_kind(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        named = (
            pair for pair in [("blocks.0.fc.weight", weight)]
        )  # a generator, as named_parameters()
        opt = muonscale.distributed_muon(named, lr=1e-3)
        assert type(opt) is muonscale.DTensorMuon and opt.param_groups[0]["algorithm"] == "muon"
        with pytest.raises(ValueError, match="reduce_dtype does not apply"):
            muonscale.distributed_muon([weight], lr=1e-3, reduce_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"muonscale\.distributed_muon"):
            muonscale.DistributedMuon([("blocks.0.fc.weight", weight)], lr=1e-3)
        with pytest.raises(
            ValueError, match=r"'blocks\.0\.fc\.weight'.*muonscale\.distributed_muon"
        ):
            muonscale.Muon([("blocks.0.fc.weight", weight)], lr=1e-3)  # would shard-orthogonalize
        plain = torch.nn.Parameter(torch.randn(8, 4))
        dp = muonscale.distributed_muon((pair for pair in [("w", plain)]), lr=1e-3)
        assert type(dp) is muonscale.DistributedMuon and dp.param_groups[0]["params"][0] is plain
        with pytest.raises(ValueError, match="approximate_per_shard"):
            muonscale.distributed_muon([plain], lr=1e-3, approximate_per_shard=True)
        del weight, opt, mesh
        gc.collect()
    finally:
        dist.destroy_process_group()
