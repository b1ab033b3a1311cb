"""Train a small Megatron-Core GPT with muonscale's Muon, tensor + data parallel.

CPU (gloo), 2 processes, TP = 2 (needs the Python 3.12 env of ``.ci/megatron_env.sh``)::

    PYTHONPATH=. .venv-megatron/bin/torchrun --nproc-per-node 2 examples/megatron_gpt.py --tp 2
    # TP 2 x DP 2
    PYTHONPATH=. .venv-megatron/bin/torchrun --nproc-per-node 4 examples/megatron_gpt.py --tp 2

With CUDA it uses NCCL and no shims. Throughput on GPU (tokens/s of muonscale vs Megatron's own
Adam, both under Megatron's DDP with bf16 parameters) is measured by
``benchmarks/megatron_gpu.py``, not here.

The model is Megatron's own ``GPTModel`` with the local (non-Transformer-Engine) layer spec;
the data is muonscale's bundled Shakespeare as bytes. On CPU two CUDA-only spots of Megatron's
local path are replaced (see :func:`cpu_shims`).
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist


def cpu_shims() -> None:
    """Megatron-Core's local path on CPU: its attention scratch buffer and dropout RNG tracker
    are CUDA-only (see :func:`muonscale.integrations.megatron.cpu.use_cpu_buffers`)."""
    from muonscale.integrations.megatron.cpu import use_cpu_buffers

    use_cpu_buffers()


def build_model(args, device: torch.device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.query_groups,
        ffn_hidden_size=4 * args.hidden,
        gated_linear_unit=True,
        use_cpu_initialization=device.type == "cpu",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        bf16=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=256,
        max_sequence_length=args.seq,
        position_embedding_type="learned_absolute",
    )
    return model.to(device)


def token_stream(device: torch.device) -> torch.Tensor:
    from muonscale.train.data import ByteTokenizer, load_corpus

    return ByteTokenizer().encode(load_corpus()).to(torch.int64).to(device)


def get_batch(tokens: torch.Tensor, step: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank); each DP rank keeps its slice."""
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(1000 + step)
    global_batch = args.micro_batch * ps.get_data_parallel_world_size()
    starts = torch.randint(0, tokens.numel() - args.seq - 1, (global_batch,), generator=g)
    window = torch.stack([tokens[s : s + args.seq + 1] for s in starts.tolist()])
    mine = window.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    return mine[:, :-1], mine[:, 1:]


def train_step(model, optimizer, tokens, step, args, device) -> float:
    inputs, labels = get_batch(tokens, step, args)
    positions = torch.arange(args.seq, device=device).unsqueeze(0).expand_as(inputs)
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=device), 1)[
        None, None
    ]
    loss = model(inputs, positions, mask, labels=labels).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--query-groups", type=int, default=2, help="GQA key/value heads")
    parser.add_argument("--seq", type=int, default=64, help="sequence length")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per DP rank per step")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if use_cuda
        else torch.device("cpu")
    )
    if use_cuda:
        torch.cuda.set_device(device)

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if use_cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    else:
        cpu_shims()
    torch.manual_seed(0)
    tokens = token_stream(device)
    rank0 = dist.get_rank() == 0

    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    model = build_model(args, device)
    optimizer = megatron_muon([model], MegatronMuonConfig(lr=args.lr, weight_decay=0.1))
    if rank0:
        print(f"TP {args.tp} x DP {ps.get_data_parallel_world_size()}, dp_mode={optimizer.dp_mode}")
        print(optimizer.summary())
    for step in range(args.steps):
        loss = train_step(model, optimizer, tokens, step, args, device)
        if rank0 and (step % 5 == 0 or step == args.steps - 1):
            print(
                f"step {step:4d}  loss {loss:.4f}  "
                f"optimizer wire bytes/rank {optimizer.last_step_wire_bytes}"
            )
    # the model and optimizer hold process groups: let go of them first, so the groups end
    # here and not at interpreter exit, where a gloo group can abort the rank (docs/train.md)
    del model, optimizer
    gc.collect()
    ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
