"""The whole job of ``geosharp measure`` loaded and checked before anything slow
(:func:`load_job`): the checkpoint in its dtype, the batches of ``--data``
(:mod:`geosharp.loading.batches`), one pre-flight pass, the symmetries, and under
``torchrun --fsdp`` the model sharded without a whole copy on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UsageError

__all__ = ["Job", "load_job"]


@dataclass
class Job:
    """What ``geosharp measure`` measures: the model and its loss on the batches, as
    loaded and checked, with what was said about how."""

    model: torch.nn.Module
    batches: list
    loss_fn: object
    task: str
    symmetries: object
    fit: object
    loading: list[str]
    new_parameters: list[str]
    n_parameters: int
    rank: int = 0
    world: int = 1


def load_job(args, path: Path, device: torch.device) -> Job:
    """The checkpoint at ``path`` (in ``--dtype``) and the batches of ``--data`` on
    ``device``, checked by one pass over every batch (:func:`geosharp.loading.hfdata.preflight`),
    with the model's symmetries found on the first batch; under ``torchrun`` the process
    group is started, and with ``--fsdp`` the model is sharded along its pairs without a
    whole copy on any device (:func:`_load_sharded`)."""
    from .. import distributed as gd
    from ..measures.fsdp import reshard
    from ..symmetry import find_symmetries
    from .batches import load_batches, resolve_task
    from .data import move_batch
    from .hf import check_weights, load_causal_lm, load_classifier, load_config
    from .hfdata import CAUSAL_LM, causal_lm_loss, preflight, task_loss

    config = load_config(path)
    check_weights(path)
    dtype, said = weights_dtype(args.dtype, config)
    if args.gradient_checkpointing:
        check_checkpointable(path, config)
    batches, loading = load_batches(args, path, config)
    if not batches:
        raise UsageError(f"--data {args.data} holds no data points")
    loading += [said] if said else []
    if args.gradient_checkpointing:
        loading.append("activation checkpointing: on (transformers', non-reentrant)")
    if args.fsdp:
        loading.append("weights: read by process 0 on the CPU; each process receives its shards")
    rank, world = gd.init()  # under torchrun the batches are split over the ranks
    task = resolve_task(args.task, config)
    causal = task == CAUSAL_LM
    load = load_causal_lm if causal else load_classifier
    loss_fn = causal_lm_loss if causal else task_loss
    batches = [move_batch(b, device) for b in batches]
    if args.fsdp:
        model, new, n_parameters, symmetries = _load_sharded(
            load, path, dtype, args.seed, device, batches[0], loss_fn, args.gradient_checkpointing
        )
        fit = preflight(model, batches, args.data, task)
        reshard(model)
    else:
        loaded = load(path, dtype=dtype, seed=args.seed)
        model, new = loaded.model.to(device), loaded.new_parameters
        if args.gradient_checkpointing:
            checkpointing_on(model)
        fit = preflight(model, batches, args.data, task)  # every input runs, before anything slow
        symmetries = find_symmetries(model, batches[0], loss_fn=loss_fn, warn=False)
        n_parameters = sum(p.numel() for p in model.parameters())
    return Job(model, batches, loss_fn, task, symmetries, fit, loading, new, n_parameters,
               rank, world)  # fmt: skip


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def weights_dtype(option: str, config) -> tuple[torch.dtype, str | None]:
    """The dtype ``--dtype`` loads the weights in (``auto``: the checkpoint's own, its
    config's ``dtype``/``torch_dtype``; float32 where it names none) and the line that
    says so (none for float32 from a float32 checkpoint)."""
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    held = str(saved).removeprefix("torch.") if saved is not None else None
    if option == "auto" and held in DTYPES:
        chosen, how = held, " (--dtype auto: the checkpoint's dtype)"
    elif option == "auto":
        chosen = "float32"
        how = " (--dtype auto: config.json names no dtype" + (
            ")" if held is None else f", or one geosharp does not measure in: {held})"
        )
    elif option == "float32" and held in ("bfloat16", "float16"):
        chosen = option
        how = f" (the checkpoint holds {held}: --dtype auto measures in it, in less memory)"
    else:
        chosen, how = option, "" if option == "float32" else f" (--dtype {option})"
    if chosen == "float32":
        return DTYPES[chosen], f"weights: float32{how}" if how else None
    return DTYPES[chosen], (
        f"weights: {chosen}{how}; measured in float32 in the modules that own perturbed "
        f"parameters, in {chosen} elsewhere"
    )


def check_checkpointable(path: Path, config) -> None:
    """An error, before the weights load, where ``--gradient-checkpointing`` names a
    model whose transformers class (config.json's ``architectures``) does not support
    it; the class loaded is checked again by :func:`checkpointing_on`."""
    from .hf import named_class

    cls = named_class(config)
    if cls is not None:
        _check_checkpointable(cls, f" ({path})")


def _check_checkpointable(cls: type, where: str = "") -> None:
    if not getattr(cls, "supports_gradient_checkpointing", False):
        raise UsageError(
            f"--gradient-checkpointing: {cls.__name__}{where} does not support activation "
            "checkpointing in transformers; drop the option"
        )


def checkpointing_on(model: torch.nn.Module) -> None:
    """Hugging Face's activation checkpointing, non-reentrant (the kind a measure can
    differentiate through for chosen parameters)."""
    _check_checkpointable(type(model))
    plain = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=plain)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=plain)


def _load_sharded(load, path, dtype, seed, device, batch, loss_fn, checkpointing):
    """A checkpoint sharded with FSDP2 over the process group, without a whole copy on
    any device: process 0 reads it on the CPU (``load``, as one process would:
    classifier heads and all); every process builds the same model on the ``meta``
    device, finds its pairs there (:func:`~geosharp.symmetry.find_symmetries` on the
    structure), shards it along them (:func:`geosharp.fsdp.shard`), and receives its
    shards and the buffers from process 0; the pairs are then verified on the sharded
    model with ``batch``, the verdicts agreed. Returns ``(model, new parameters,
    number of parameters, symmetries)``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from ..distributed import all_reduce_max
    from ..measures.fsdp import reshard, shard
    from ..symmetry import find_symmetries
    from ..symmetry.discovery import verify_symmetries

    rank = dist.get_rank()
    whole, (cls, config, new, dtypes) = _read_on_process_0(load, path, dtype, seed)
    model = _on_meta(cls, config, dtypes)
    model.eval()
    symmetries = find_symmetries(model, warn=False)  # on the structure: no weights
    n_parameters = sum(p.numel() for p in model.parameters())
    shard(model, symmetries)
    model.to_empty(device=device)
    set_model_state_dict(
        model,
        whole.state_dict() if rank == 0 else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    sources = dict(whole.named_buffers()) if rank == 0 else {}
    for name, buffer in model.named_buffers():  # the non-persistent ones too
        if rank == 0:
            buffer.copy_(sources[name])
        dist.broadcast(buffer, src=0)
    del whole, sources
    if checkpointing:
        checkpointing_on(model)
    agree = all_reduce_max()
    symmetries = verify_symmetries(model, symmetries, batch, loss_fn=loss_fn, agree=agree)
    reshard(model)
    return model, new, n_parameters, symmetries


def _read_on_process_0(load, path, dtype, seed):
    """``load(path, ...)`` on process 0: its model there (``None`` elsewhere) and, on
    every process, ``(class, config, new parameters, {name: dtype})`` of its parameters
    and buffers, in one broadcast; where the load fails, every process raises (a
    :class:`UsageError` as the same one line), none waits for it."""
    import torch.distributed as dist

    whole, failed, said = None, None, [None]
    if dist.get_rank() == 0:
        try:
            loaded = load(path, dtype=dtype, seed=seed)
        except Exception as err:
            failed = err
            said = [("failed", type(err).__name__, str(err))]
        else:
            whole = loaded.model
            tensors = (*whole.named_parameters(), *whole.named_buffers())
            dtypes = {n: t.dtype for n, t in tensors}
            said = [(type(whole), whole.config, loaded.new_parameters, dtypes)]
    dist.broadcast_object_list(said, src=0)
    if failed is not None:
        raise failed
    if said[0][0] == "failed":
        _, kind, message = said[0]
        if kind == UsageError.__name__:
            raise UsageError(message)
        raise RuntimeError(f"process 0 failed to load the checkpoint: {kind}: {message}")
    return whole, said[0]


def _on_meta(cls, config, dtypes: dict[str, torch.dtype]) -> torch.nn.Module:
    """``cls`` built from ``config`` on the meta device, each parameter and buffer in
    the dtype ``dtypes`` names for it (a tied tensor converted once, kept tied); an
    error where its names are not those of ``dtypes``."""
    with torch.device("meta"):
        model = cls._from_config(config)
    converted: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                name = f"{prefix}.{key}" if prefix else key
                if t is None or (id(t) not in converted and dtypes.get(name, t.dtype) == t.dtype):
                    continue
                if id(t) not in converted:
                    cast = t.to(dtypes[name])
                    if isinstance(t, torch.nn.Parameter):
                        cast = torch.nn.Parameter(cast, t.requires_grad)
                    converted[id(t)] = cast
                table[key] = converted[id(t)]
    names = {n for n, _ in (*model.named_parameters(), *model.named_buffers())}
    if names != set(dtypes):
        raise UsageError(
            f"--fsdp: {cls.__name__} built from its config has other parameters than the "
            f"checkpoint loaded ({sorted(names ^ set(dtypes))[0]}); drop --fsdp"
        )
    return model
