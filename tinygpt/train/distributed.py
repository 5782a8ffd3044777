"""Several processes under `torchrun`: the process group, DDP or FSDP2, and the global batch.

The recipe's batch is the global one: with W processes each takes 1/W of every step, and the
sampler hands rank r its share of the same global order, so a run on W GPUs follows the single-GPU
run step for step. Checkpoints always hold the full state in the single-process format (gathered to
rank 0 under FSDP2), so one moves freely between world sizes. The torch.distributed submodules are
imported inside the functions that use them: a single-process run never loads them.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from tinygpt.core.checkpoint import clean_state_dict
from tinygpt.core.config import ConfigError
from tinygpt.core.precision import resolve_device

PARALLEL_MODES = ("ddp", "fsdp")
# A collective that waits longer than this raises instead of hanging forever (a peer that hangs
# rather than dies); rank 0 writing a large checkpoint while the others wait must fit in it.
TIMEOUT_S = float(os.environ.get("TINYGPT_DIST_TIMEOUT_S", 900))
# Rank 0 may tokenize a whole corpus while the others wait for it.
PREP_TIMEOUT_S = float(os.environ.get("TINYGPT_DIST_PREP_TIMEOUT_S", 6 * 3600))


def _active() -> bool:
    """Whether this process is in a process group (some torch builds lack torch.distributed)."""
    return dist.is_available() and dist.is_initialized()


@dataclass(frozen=True)
class Ranks:
    """This process's place in a torchrun job (one process: the defaults)."""

    rank: int = 0
    world_size: int = 1
    parallel: str = "ddp"  # "ddp" or "fsdp" (FSDP2)

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # rank 0 writes the run folder; the others only read it


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """The torchrun environment of this process, or None when it was not started by torchrun."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    try:
        return TorchrunEnv(
            int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))
        )
    except ValueError as e:
        raise ConfigError(
            f"RANK / WORLD_SIZE / LOCAL_RANK must be integers (as torchrun sets them): {e}"
        ) from e


def split_global_batch(
    micro_batch_size: int, grad_accum_steps: int, world_size: int
) -> tuple[int, int]:
    """(micro_batch_size, grad_accum_steps) of one rank so that W ranks together make the recipe's
    global batch. Fewer accumulation steps first (the micro-batch the probe sized stays), else a
    smaller micro-batch."""
    if world_size == 1:
        return micro_batch_size, grad_accum_steps
    if grad_accum_steps % world_size == 0:
        return micro_batch_size, grad_accum_steps // world_size
    if micro_batch_size % world_size == 0:
        return micro_batch_size // world_size, grad_accum_steps
    raise ConfigError(
        f"the global batch of {micro_batch_size} sequences x {grad_accum_steps} accumulation steps "
        f"cannot be split over {world_size} processes: neither grad_accum_steps nor "
        f"micro_batch_size is a multiple of {world_size}. Use a number of processes that divides "
        "one of them, or a recipe whose grad_accum_steps is a multiple of it"
    )


def rank_device(requested: str, local_rank: int) -> torch.device:
    """This rank's device: its own GPU (cuda:LOCAL_RANK) unless the CPU was asked for."""
    if requested in ("auto", "cuda") or requested.startswith("cuda"):
        if torch.cuda.is_available():
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(
                    f"local rank {local_rank} has no GPU: this machine has "
                    f"{torch.cuda.device_count()}; start at most that many processes per node "
                    "(--nproc_per_node)"
                )
            return torch.device("cuda", local_rank)
        if requested != "auto":
            raise ConfigError(
                "device 'cuda' was asked for but torch sees no CUDA GPU; use --device cpu"
            )
    if requested not in ("auto", "cpu"):
        raise ConfigError(
            f"device {requested!r} cannot be used with several processes: use cuda or cpu"
        )
    return torch.device("cpu")


@contextlib.contextmanager
def process_group(
    env: TorchrunEnv, device: torch.device, timeout_s: float = TIMEOUT_S
) -> Iterator[None]:
    """Join the job's process group (NCCL for GPU tensors, gloo for CPU ones), then leave it."""
    if _active():  # the caller set it up: leave it as it is
        yield
        return
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # gloo carries the small CPU-side agreements (stop flags, target counts) without a GPU sync
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
        raise RuntimeError(
            f"process group says rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"the environment {env.rank} of {env.world_size}"
        )
    yield
    # Not on an error: after a lost peer, tearing NCCL down can hang; the process is ending anyway.
    dist.destroy_process_group()


@contextlib.contextmanager
def joined(requested: str, parallel: str = "ddp") -> Iterator[tuple[torch.device, Ranks]]:
    """This process's device and place in the job, for the block: started by torchrun with several
    processes, its own GPU inside the job's process group (`rank_device`, `process_group`);
    otherwise one process on the device asked for ("auto": the best present)."""
    env = torchrun_env()
    if env is not None and env.world_size > 1:
        dev = rank_device(requested, env.local_rank)
        with process_group(env, dev):
            yield dev, Ranks(env.rank, env.world_size, parallel)
        return
    yield resolve_device(requested), Ranks(parallel=parallel)


@contextlib.contextmanager
def main_process_first(
    rank: int, world_size: int, timeout_s: float = PREP_TIMEOUT_S
) -> Iterator[None]:
    """Rank 0 runs the body first (tokenizer, token cache, run.json); the others wait, then run it
    and find everything made. If rank 0 fails, torchrun ends the waiting ones."""
    if world_size == 1:
        yield
        return
    # Its own gloo group: waiting for a tokenizer must not be cut short by the training timeout.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    if rank != 0:
        dist.barrier(group=group)
    yield
    if rank == 0:
        dist.barrier(group=group)
    dist.destroy_process_group(group)


def is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def wrap_model(
    model: torch.nn.Module, parallel: str, device: torch.device, use_compile: bool
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module that trains, the module that evaluates) for `parallel` over the default group.
    DDP wraps the compiled model (as nanoGPT does); evaluation runs the compiled model without DDP,
    so it needs no collective. FSDP2 shards each transformer block (compiled first) and the root in
    place."""
    if not _active():
        raise RuntimeError(
            "training with world_size > 1 needs a process group: start under torchrun "
            "(`pretrain` joins it itself) or use tinygpt.train.distributed.process_group"
        )
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        compiled = torch.compile(model) if use_compile else model
        # The rope tables are buffers that never change: broadcasting them every forward is waste
        # (newer torch names the switch forward_sync_buffers and deprecates broadcast_buffers).
        newer = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        no_buffer_sync = {"forward_sync_buffers" if newer else "broadcast_buffers": False}
        ddp = DDP(
            compiled,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            **no_buffer_sync,
        )
        return ddp, compiled
    if parallel == "fsdp":
        if getattr(getattr(model, "config", None), "fused_proj", False):
            # Distributed checkpointing gathers the state under the parameters' own names, not the
            # Hugging Face names a fused model saves.
            raise ConfigError(
                "fused_proj=True does not work with parallel='fsdp' yet: set fused_proj=False, "
                "or use parallel='ddp'"
            )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.model.layers:  # type: ignore[union-attr]
            if use_compile:
                block.compile()
            fully_shard(block, mesh=mesh)
        # embeddings, final norm and lm_head (tied or not) at the root
        fully_shard(model, mesh=mesh)
        return model, model
    raise ConfigError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")


def gradient_sync(forward_model: torch.nn.Module, model: torch.nn.Module, sync: bool):
    """A context for one micro-step: gradients are reduced across ranks only when `sync`."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: a flag, not a context
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(forward_model, "no_sync"):
        return forward_model.no_sync()
    return contextlib.nullcontext()


def grad_scaler(precision, model: torch.nn.Module) -> torch.amp.GradScaler:
    """The precision's GradScaler; under FSDP2 one that agrees across ranks on inf/NaN."""
    if precision.use_scaler and _active() and is_fsdp(model):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(precision.device_type)
    return precision.grad_scaler()


def agree_sum(values: list[int]) -> list[int]:
    """Sum small integers over ranks on the CPU (gloo): no GPU sync, one tiny collective."""
    if not _active():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    if _active():
        dist.all_reduce(t)
    return t


def local_value(t: Any) -> Any:
    """A DTensor (e.g. the gradient norm under FSDP2) as a plain tensor; anything else unchanged."""
    if not _active():
        return t
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each optimizer group's parameter names in order (a tied matrix under its first name)."""
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def gather_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state_fn: Callable, rank: int
) -> tuple[dict | None, dict | None]:
    """(model state, optimizer state) in the single-process format on rank 0, (None, None)
    elsewhere. Under FSDP2 a collective (full tensors land on rank 0's CPU); the optimizer state is
    re-keyed from parameter names to the indices `Optimizer.state_dict` uses."""
    if not (_active() and is_fsdp(model)):
        return (state_fn(model), optimizer.state_dict()) if rank == 0 else (None, None)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sd, osd = get_state_dict(model, optimizer, options=_full_options(cpu_offload=True))
    if rank != 0:
        return None, None
    if getattr(getattr(model, "config", None), "tie_embeddings", False):
        sd.pop("lm_head.weight", None)  # as model_state: the tied matrix is saved once
    sd = {k: v.contiguous() for k, v in sd.items()}
    # The groups as Optimizer.state_dict writes them (index ids, hyperparameters with their types).
    groups = optimizer.state_dict()["param_groups"]
    state = {}
    for g, names in zip(groups, _param_names(model, optimizer)):
        for i, n in zip(g["params"], names):
            if n in osd["state"]:
                state[i] = osd["state"][n]
    return sd, {"state": state, "param_groups": groups}


def load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sd: dict,
    osd: dict,
    load_state_fn: Callable,
) -> None:
    """Load a full (single-process format) model and optimizer state on every rank."""
    if not (_active() and is_fsdp(model)):
        load_state_fn(model, sd)
        optimizer.load_state_dict(osd)
        return
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = clean_state_dict(sd)
    if getattr(getattr(model, "config", None), "tie_embeddings", False):
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    # every rank read the same checkpoint from disk: each keeps its own shard, nothing is broadcast
    set_model_state_dict(model, sd, options=_full_options())
    names = _param_names(model, optimizer)
    state, groups = {}, []
    for g, group_names in zip(osd["param_groups"], names):
        for i, n in zip(g["params"], group_names):
            if i in osd["state"]:
                state[n] = osd["state"][i]
        groups.append({**g, "params": group_names})
    set_optimizer_state_dict(
        model, optimizer, {"state": state, "param_groups": groups}, options=_full_options()
    )
    # it turns tuples (betas) into lists
    for live, saved in zip(optimizer.param_groups, osd["param_groups"]):
        live.update({k: v for k, v in saved.items() if k != "params"})


# how a lost peer reads in an error (lower case), the backends naming themselves included
_PEER_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout")
_PEER_HINTS += ("nccl", "gloo")


def is_peer_failure(e: BaseException) -> bool:
    """Whether an error looks like a collective that lost its peers (dead, hung, unreachable)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(h in str(e).lower() for h in _PEER_HINTS)


def check_parallel(
    parallel: str,
    optimizer: str,
    world_size: int,
    custom_state: bool = False,
    sample_every: int = 0,
) -> None:
    """Refuse a parallel mode that cannot work, before any work starts."""
    if parallel not in PARALLEL_MODES:
        raise ConfigError(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {parallel!r}")
    if parallel == "fsdp" and custom_state and world_size > 1:
        raise ConfigError(
            "FSDP2 checkpoints hold the whole model; saving a part of it (LoRA adapters) "
            "works with --parallel ddp"
        )
    if parallel == "fsdp" and sample_every and world_size > 1:
        raise ConfigError(
            "train.sample_every needs the whole model on rank 0 and FSDP shards it: set "
            "train.sample_every=0 (a sample is still written at the end) or use --parallel ddp"
        )
    if parallel == "fsdp" and optimizer == "muon" and world_size > 1:
        raise ConfigError(
            "the muon optimizer orthogonalises whole matrices and FSDP2 holds only shards of them: "
            "use --parallel ddp, or the adamw optimizer"
        )
