"""A model loaded straight into its FSDP2 shards: each rank reads from the safetensors files only the rows of every
weight it keeps, so no rank ever holds the whole model. Loading whole and then sharding costs a full host copy per
rank: a Ray cluster's 32B reference is 64 GB of bf16, and a node runs four of its ranks.

The model is built with its parameters on the meta device (its buffers, such as the rotary frequencies, are
computed as usual: they are small and not in the weight files), sharded, and only then given memory. FSDP2 splits
every parameter along its first dimension as `torch.chunk` does, so rank r of W keeps rows [r * c, (r + 1) * c) of
a weight of n rows, c = ceil(n / W). Folders this cannot read that way (`.bin` weights, names the files do not
hold, such as checkpoints transformers converts at load) return None: the caller loads whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from alignrl.models.folder import auto_class, loading, weight_files


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no initialisation worth the
    name) while their buffers are computed on the CPU as usual."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":  # a parameter tied to one on meta stays that one
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def tensor_files(folder: Path) -> dict[str, Path] | None:
    """Which safetensors file holds each tensor; None when the weights are in another format."""
    from safetensors import safe_open

    files = weight_files(folder)
    if not all(f.suffix == ".safetensors" for f in files):
        return None
    where = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), path))
    return where


def first_rows(param: torch.Tensor, local: torch.Tensor) -> int:
    """The first row of the global weight that this rank's shard `local` of `param` holds (FSDP2: dim-0 chunks)."""
    if not isinstance(param, DTensor):
        return 0
    mesh = param.device_mesh
    chunk = -(-param.shape[0] // mesh.size())
    return min(mesh.get_local_rank() * chunk, param.shape[0])


def meta_model(folder: Path, dtype: torch.dtype) -> torch.nn.Module | None:
    """The causal LM of `folder` in `dtype` with its parameters on the meta device, or None when its weights cannot be
    read by rows (not safetensors, or names the files do not hold)."""
    from transformers import AutoConfig

    where = tensor_files(folder)
    if where is None:
        return None
    with loading(folder, "model"):
        config = AutoConfig.from_pretrained(str(folder))
        with params_on_meta():
            model = auto_class(config).from_config(config, dtype=dtype)
    if any(name not in where for name, _ in model.named_parameters()):  # tied weights once, as the files keep them
        return None
    if (folder / "generation_config.json").is_file():  # as from_pretrained: its checkpoints keep the folder's own
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    model.config.use_cache = False  # as load_causal_lm: training default; the rollout engine asks for the cache
    return model


def fill_shards(model: torch.nn.Module, folder: Path, device: torch.device) -> None:
    """Memory for a `meta_model` (sharded by now, or not at all) on `device`, and each parameter's rows of the weights
    of `folder` in it, in the parameter's dtype."""
    from safetensors import safe_open

    where = tensor_files(folder)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # each parameter object kept: tied ones stay tied
    try:
        model.to_empty(device=device)  # the shards get memory; so do the buffers, whose values are put back
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    names = dict(model.named_parameters())  # after to_empty: FSDP2 gives its sharded parameters new objects
    with torch.no_grad(), loading(folder, "model"):
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        for path in sorted(set(where[n] for n in names)):
            with safe_open(str(path), framework="pt") as f:
                for name in (n for n in names if where[n] == path):
                    p = names[name]
                    local = p.to_local() if isinstance(p, DTensor) else p
                    start = first_rows(p, local)
                    rows = f.get_slice(name)[start:start + local.shape[0]] if local.dim() else f.get_tensor(name)
                    local.copy_(rows.to(local.dtype))


def load_sharded(folder: Path, dtype: torch.dtype, device: torch.device,
                 shard: Callable[[torch.nn.Module], None]) -> torch.nn.Module | None:
    """The causal LM of `folder` in `dtype`, frozen and in eval mode, sharded by `shard` (e.g. fully_shard over the
    ranks) before any weight is read, each rank reading its own rows. None when the folder cannot be read by rows."""
    model = meta_model(folder, dtype)
    if model is None:
        return None
    model.eval()
    model.requires_grad_(False)
    shard(model)
    fill_shards(model, folder, device)
    return model


def held_elements(model: torch.nn.Module) -> int:
    """Parameter elements this rank holds (its shards, or the whole model when unsharded)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes of parameters this rank holds: its shards, or the whole model when unsharded."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def size_text(n: int) -> str:
    """Bytes as a start line says them: GiB from 1 GiB, MiB below."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
