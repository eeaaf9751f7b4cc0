"""Safe functional evaluation of a user's model.

A perturbed point is a ``{name: tensor}`` dict (views of a flat vector, see
:mod:`geosharp.layout`), evaluated with :func:`swapped`, which puts the tensors in
place for one call and puts the model's own objects back, also on error: the model's
tensors are never written, and a module or parameter registered under several names
(tied embeddings, a module shared by two layers) comes back as the same object under
every name. (``torch.func.functional_call`` restores only the first name of an aliased
module: the others keep the swapped tensors.)
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from .errors import UsageError, warn_user

__all__ = [
    "FunctionalLoss",
    "LossFunction",
    "aliases",
    "checkpoint_errors",
    "checkpoint_holders",
    "checkpointing_kept",
    "computing_in_float32",
    "evaluation_mode",
    "frozen_except",
    "functional_loss",
    "grad_owned",
    "in_float32",
    "keeping_tensors",
    "loss_value",
    "owning_modules",
    "plain_copy",
    "require_grad",
    "scalar_loss",
    "swapped",
    "tensors_kept",
    "usable_for_grad",
]

LossFunction = Callable[[nn.Module, object], Tensor]


@contextlib.contextmanager
def swapped(
    model: nn.Module, tensors: Mapping[str, Tensor], base: Mapping[str, Tensor] | None = None
) -> Iterator[None]:
    """``model`` computes with ``tensors`` (parameter or buffer names of ``model``, any
    of an alias's names) in place of its own for the duration; every name that holds
    the same object (a tied weight, a module registered twice) sees the replacement.
    ``base``: replacements for the names (and aliases) that ``tensors`` leaves out. On
    exit, also on error, every slot holds its original object again.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> model = torch.nn.Sequential(lin, lin)  # one module under two names
    >>> with swapped(model, {"0.weight": torch.zeros(2, 2)}):
    ...     float(model[1].weight.abs().sum())
    0.0
    >>> model[1].weight is lin.weight and isinstance(model[0].weight, torch.nn.Parameter)
    True
    """
    if not tensors and not base:
        yield
        return
    by_name, slots = _registry(model)
    replacement: dict[int, tuple[Tensor, Tensor]] = {}  # id(original) -> (original, new)
    for given in (base or {}, tensors):
        claimed: set[int] = set()
        for name, new in given.items():
            original = by_name.get(name)
            if original is None:
                raise KeyError(f"{name!r} is not a parameter or buffer of the model")
            held = replacement.get(id(original))
            if held is not None and held[1] is not new and id(original) in claimed:
                raise ValueError(
                    f"{name!r} is tied to another name given a different tensor: give one"
                )
            replacement[id(original)] = (original, new)
            claimed.add(id(original))
    written: list[tuple[dict, str, Tensor]] = []
    try:
        for key, (original, new) in replacement.items():
            for table, attr in slots[key]:
                written.append((table, attr, original))
                table[attr] = new
        yield
    finally:
        for table, attr, original in reversed(written):
            table[attr] = original


def _registry(model: nn.Module) -> tuple[dict[str, Tensor], dict[int, list[tuple[dict, str]]]]:
    """Every name of every parameter and buffer (aliases included), and for each object
    the tables and keys that hold it."""
    slots: dict[int, list[tuple[dict, str]]] = {}
    by_name: dict[str, Tensor] = {}
    seen: set[tuple[int, str]] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table = module.__dict__[kind]
            first = (id(module), kind) not in seen
            seen.add((id(module), kind))
            for attr, value in table.items():
                if value is None:
                    continue
                by_name[f"{prefix}.{attr}" if prefix else attr] = value
                if first:
                    slots.setdefault(id(value), []).append((table, attr))
    return by_name, slots


class FunctionalLoss:
    """``f(params, batch)``: the loss with ``params`` swapped into ``model``.

    ``params`` maps parameter names of ``model`` to tensors; parameters not named keep
    their values, or take the ones in ``base`` (parameters and buffers, e.g. float32
    copies). The model is left untouched, also when ``loss_fn`` raises. A backward
    through activation checkpointing recomputes the forward pass during the backward:
    run both inside :meth:`holding` so that the recomputation sees ``params`` too.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFunction,
        base: Mapping[str, Tensor] | None = None,
        narrow: Mapping[str, torch.dtype] | None = None,
    ):
        self.model, self.loss_fn, self.base = model, loss_fn, base
        self.narrow = dict(narrow or {})

    def __call__(self, params: Mapping[str, Tensor], batch: object) -> Tensor:
        with self.holding(params):
            return self.loss_fn(self.model, batch)

    def holding(self, params: Mapping[str, Tensor]):
        """The model computes with ``params`` (and ``base``) inside; those named in
        ``narrow`` cast (differentiably) to the dtype their module computes in (a
        float32 router of a float64 model)."""
        if self.narrow:
            params = {n: t.to(self.narrow[n]) if n in self.narrow else t for n, t in params.items()}
        return swapped(self.model, params, self.base)

    def loss(self, batch: object) -> Tensor:
        """The loss of the model as it is now (inside :meth:`holding`)."""
        return self.loss_fn(self.model, batch)


def functional_loss(
    model: nn.Module,
    loss_fn: LossFunction,
    base: Mapping[str, Tensor] | None = None,
    narrow: Mapping[str, torch.dtype] | None = None,
) -> FunctionalLoss:
    """:class:`FunctionalLoss` of ``model`` and ``loss_fn``."""
    return FunctionalLoss(model, loss_fn, base, narrow)


def keeping_tensors(function):
    """``function(model, ...)`` inside :func:`tensors_kept` (not for a model sharded
    with FSDP2, whose own hooks swap its parameters' objects)."""

    @functools.wraps(function)
    def wrapper(model, *args, **kwargs):
        if not isinstance(model, nn.Module) or any(
            hasattr(p, "full_tensor") for p in model.parameters()
        ):
            return function(model, *args, **kwargs)
        with tensors_kept(model):
            return function(model, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def tensors_kept(model: nn.Module) -> Iterator[None]:
    """Every parameter and buffer of ``model`` comes back as the object, dtype and
    memory it was, also where the model's own forward converts one (a router that casts
    its classifier to float32 in its first forward: NLLB-MoE, Switch Transformers), and
    on error.

    >>> import torch
    >>> class CastsItself(torch.nn.Linear):
    ...     def forward(self, x):
    ...         self.float()  # as such routers do
    ...         return super().forward(x.float())
    >>> layer = CastsItself(2, 2).double()
    >>> with tensors_kept(layer):
    ...     _ = layer(torch.ones(1, 2, dtype=torch.float64))
    ...     layer.weight.dtype
    torch.float32
    >>> layer.weight.dtype
    torch.float64
    """
    tables = []
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            table = module.__dict__[kind]
            tables.append((table, dict(table)))
    data = {id(t): (t, t.data) for t in {id(t): t for _, saved in tables for t in saved.values()
                                         if t is not None}.values()}  # fmt: skip
    try:
        yield
    finally:
        for table, saved in tables:
            for key, value in saved.items():
                if table.get(key) is not value:
                    table[key] = value
        for t, original in data.values():
            if t.dtype != original.dtype or t.data_ptr() != original.data_ptr():
                with torch.no_grad():
                    t.data = original


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode (dropout off, normalisation statistics frozen) and its
    Hugging Face configs' ``use_cache`` off (an evaluation keeps no key-value cache, and
    transformers says it turns it off under activation checkpointing); restore every
    submodule's ``training`` flag and every ``use_cache`` on exit, also on error."""
    flags = [(m, m.training) for m in model.modules()]
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    caching = [c for c in configs.values() if getattr(c, "use_cache", None) is True]
    model.eval()
    for config in caching:
        config.use_cache = False
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag
        for config in caching:
            config.use_cache = True


def checkpoint_holders(model: nn.Module) -> list[nn.Module] | None:
    """The modules of ``model`` that hold Hugging Face's ``gradient_checkpointing`` flag
    (``[]``: none), or ``None`` where a checkpoint function is reentrant."""
    holders = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not holders:
        return holders
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        keywords = getattr(func, "keywords", None)
        if func is not None and (keywords is None or keywords.get("use_reentrant") is not False):
            return None
    return holders


def checkpointing_kept(model: nn.Module, loss: Callable[[], Tensor]) -> bool:
    """Inside :func:`evaluation_mode`: keep Hugging Face activation checkpointing on.

    transformers checkpoints a layer only when the module that holds the
    ``gradient_checkpointing`` flag is in training mode; this sets ``training`` on those
    modules alone (their submodules, dropout included, stay in eval mode), so that a
    measure's backward recomputes their activations as training does. Kept only where
    it changes nothing else: the checkpoint function is not reentrant (a reentrant one
    cannot differentiate with respect to the measured parameters alone), and ``loss()``
    without gradients, where nothing is checkpointed, is bit for bit the eval mode's.
    Returns whether it was kept (else every flag is as :func:`evaluation_mode` set it,
    and a warning says why)."""

    holders = checkpoint_holders(model)
    if holders is None:
        warn_user(
            "activation checkpointing is off during the measure: a reentrant checkpoint "
            "cannot differentiate with respect to the measured parameters alone; enable it "
            "with gradient_checkpointing_kwargs={'use_reentrant': False}"
        )
        return False
    if not holders:
        return False
    with torch.no_grad():
        reference = loss()
        for module in holders:
            module.training = True
        same = torch.equal(loss(), reference)
    if not same:
        for module in holders:
            module.training = False
        warn_user(
            "activation checkpointing is off during the measure: the layers that hold it "
            "compute differently in training mode (dropout in their own forward)"
        )
    return same


def scalar_loss(loss: object) -> Tensor:
    """``loss`` as a 0-d tensor; an error unless ``loss_fn`` returned a one-element tensor."""
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError("loss_fn must return a scalar")
    return loss.reshape(())


def grad_owned(function: Callable) -> Callable:
    """``function`` computes with gradients whatever the caller's mode: under
    ``torch.no_grad()`` and ``torch.inference_mode()`` too (the caller's is kept)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            return function(*args, **kwargs)

    return wrapper


def usable_for_grad(batch: object) -> object:
    """``batch`` with every tensor made under ``torch.inference_mode()`` cloned to a
    normal one (autograd cannot save an inference tensor for backward); others as they
    are."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(Tensor, lambda t: t.clone() if t.is_inference() else t, batch)


def in_float32(outputs: Tensor) -> Tensor:
    """Half-precision ``outputs`` in float32, others as they are: the precision a loss
    is computed in (a bfloat16 log-softmax rounds a confident prediction's loss to 0,
    and every loss to one of its 256 steps per octave)."""
    if outputs.dtype in (torch.float16, torch.bfloat16):
        return outputs.float()
    return outputs


def aliases(model: nn.Module) -> list[tuple[Tensor, list[str]]]:
    """Each parameter object of ``model`` once, with every name it is registered under
    (the first is ``named_parameters``' own; a tied weight or a module registered twice
    has more).

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> [names for _, names in aliases(torch.nn.Sequential(lin, lin))]
    [['0.weight', '1.weight'], ['0.bias', '1.bias']]
    """
    out: dict[int, tuple[Tensor, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), (p, []))[1].append(name)
    return list(out.values())


@contextlib.contextmanager
def frozen_except(model: nn.Module, keep: Iterable[str]) -> Iterator[None]:
    """Inside, the parameters of ``model`` not named in ``keep`` (any alias counts) do
    not require grad: a backward computes no gradient for what is not measured. Every
    flag is restored on exit, also on error.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> with frozen_except(model, ["1.weight"]):
    ...     [p.requires_grad for p in model.parameters()]
    [False, False, True, False]
    >>> all(p.requires_grad for p in model.parameters())
    True
    """
    kept = set(keep)
    flipped = [p for p, names in aliases(model) if p.requires_grad and not kept & set(names)]
    try:
        for p in flipped:
            p.requires_grad_(False)
        yield
    finally:
        for p in flipped:
            p.requires_grad_(True)


REENTRANT_FIX = (
    "use use_reentrant=False (PyTorch's recommended setting; in Hugging Face, "
    "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"
)
_NO_INPUT_GRAD = "None of the inputs have requires_grad=True"  # torch's reentrant warning
_SAID: dict = {}  # the warnings said again, each once (as the default filter would)


class Checkpoints:
    """What :func:`checkpoint_errors` saw: ``cut``, a reentrant checkpoint whose inputs
    need no gradient (the parameters inside it then get none)."""

    cut = False

    def refuse_unreached(self, unreached: list[str]) -> None:
        """One-line error when a cut checkpoint left measured parameters without a
        gradient (a measure would move the rest alone)."""
        if self.cut and unreached:
            more = f" and {len(unreached) - 1} more" if len(unreached) > 1 else ""
            raise UsageError(
                f"{unreached[0]}{more} get no gradient: inside a torch.utils.checkpoint with "
                "use_reentrant=True whose inputs need no gradient, so the measure would move "
                "the other parameters alone; " + REENTRANT_FIX
            )


@contextlib.contextmanager
def checkpoint_errors() -> Iterator[Checkpoints]:
    """Around a forward and backward: PyTorch's error for a backward with respect to
    chosen tensors through reentrant activation checkpointing, as a one-line error
    with its fix, and its warning that a reentrant checkpoint's inputs need no
    gradient, as :attr:`Checkpoints.cut` (every other warning is said again)."""
    import warnings

    seen = Checkpoints()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield seen
        except RuntimeError as err:
            if "use_reentrant=True" not in str(err):
                raise
            raise UsageError(
                "the model uses torch.utils.checkpoint with use_reentrant=True, which cannot "
                "differentiate with respect to the measured parameters alone: " + REENTRANT_FIX
            ) from None
    for w in caught:
        if str(w.message).startswith(_NO_INPUT_GRAD):
            seen.cut = True
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_SAID)


def require_grad(loss: Tensor) -> None:
    """An error unless ``loss`` depends on the parameters (a backward can reach them)."""
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not depend on the perturbed parameters (it does not require "
            "grad): compute it from the model's output inside loss_fn, without "
            "torch.no_grad(), .detach() or .item()"
        )


def owning_modules(
    model: nn.Module, named: Iterable[tuple[str, Tensor]]
) -> dict[str, tuple[nn.Module, list[tuple[str, str]]]]:
    """Every module that holds a parameter of ``named``, under each of its names (a
    module registered twice, a tied embedding and output head: all of them):
    ``{module name: (module, [(attribute, name in named)])}``.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> found = owning_modules(torch.nn.Sequential(lin, lin), [("0.weight", lin.weight)])
    >>> {name: attrs for name, (_, attrs) in found.items()}
    {'0': [('weight', '0.weight')], '1': [('weight', '0.weight')]}
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    ids = {id(p): n for n, p in named}
    out: dict[str, tuple[nn.Module, list[tuple[str, str]]]] = {}
    for p, names in aliases(model):
        for full in names if id(p) in ids else ():
            owner, _, attr = full.rpartition(".")
            out.setdefault(owner, (modules[owner], []))[1].append((attr, ids[id(p)]))
    return out


def loss_value(loss: Tensor) -> Tensor:
    """``loss`` detached, in float32 if it is half precision."""
    value = loss.detach()
    return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value


@contextlib.contextmanager
def computing_in_float32(
    modules: Iterable[nn.Module], half: torch.dtype | None, before=None, after=None, copies=None
) -> Iterator[None]:
    """Inside, each of ``modules`` computes in float32 beside a model in ``half``: its
    floating inputs in ``half`` are cast up before its forward, its float32 outputs cast
    back after (``half=None``: nothing is cast). An input's float32 copy that backward
    needs is saved as the ``half`` tensor it came from and cast up again there (exact:
    every ``half`` value is a float32 value), not kept in float32 from forward to
    backward. ``before(module)`` and ``after(module)``, if given, run there too;
    ``copies`` (an :class:`UpCasts`, made here if not given) knows the copies. The
    hooks are removed on exit, also on error."""
    copies = UpCasts() if copies is None else copies
    pushed: list[object] = []

    def up(x):
        return copies.up(x) if isinstance(x, Tensor) and x.dtype == half else x

    def down(x):
        return x.to(half) if isinstance(x, Tensor) and x.dtype == torch.float32 else x

    def pre(module, args, kwargs):
        if before is not None:
            before(module)
        if half is None:
            return None
        pushed.append(copies.push())
        return tree_map(up, args), tree_map(up, kwargs)

    def post(module, _args, output):
        if half is not None:
            copies.pop(pushed.pop())
        if after is not None:
            after(module)
        return tree_map(down, output) if half is not None else None

    handles = []
    try:
        for module in modules:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            # also where the forward raises (activation checkpointing stops a recompute
            # by raising): the saved-tensor hooks pushed before it are popped in order
            handles.append(module.register_forward_hook(post, always_call=True))
        yield
    finally:
        while pushed:  # a forward that raised where its hooks could not run
            copies.pop(pushed.pop())
        for handle in handles:
            handle.remove()


class _Half:
    """A float32 copy of ``half`` (or a view of it) saved for backward as ``half``
    itself and the view's geometry."""

    __slots__ = ("copy_version", "half", "offset", "size", "stale", "stride", "version")

    def __init__(self, half: Tensor, view: Tensor):
        self.half, self.version, self.copy_version = half, half._version, view._version
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()
        self.stale = False  # the copy was changed in place after it was saved

    def unpack(self) -> Tensor:
        if self.stale or self.half._version != self.version:
            raise RuntimeError(
                "a half-precision input of a module computing in float32, or its float32 "
                "copy, was changed in place after it was saved for the gradient: change it "
                "out of place, or measure a float32 model"
            )
        return self.half.float().as_strided(self.size, self.stride, self.offset)


class UpCasts:
    """Float32 copies of half-precision inputs, each known by its storage until it is
    freed, and the saved-tensor hooks that save such a copy, or a view of it (a linear
    layer saves its input flattened to two dimensions), as its half-precision source.
    Composed with the hooks in force where a module's forward starts (activation
    checkpointing's, a sharded measure's): those pack first; a copy they keep as it is
    is saved as its source instead."""

    _top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    _enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)

    def __init__(self):
        self.sources: dict[int, tuple[weakref.ref, Tensor]] = {}

    def up(self, x: Tensor) -> Tensor:
        y = x.float()
        key = y.untyped_storage().data_ptr()
        if key:  # not an empty tensor
            self.sources[key] = (weakref.ref(y, lambda _, k=key: self.sources.pop(k, None)), x)
        return y

    def half_of(self, x: Tensor) -> Tensor | None:
        """``x`` in the precision it was cast up from, where ``x`` is such a copy (or a
        view of one) as it was made; else ``None``."""
        entry = self.sources.get(x.untyped_storage().data_ptr()) if x.numel() else None
        copy = None if entry is None else entry[0]()
        if copy is None or copy._version != 0 or x.dtype != torch.float32:
            return None
        return entry[1] if x is copy else x.to(entry[1].dtype)

    def push(self) -> object:
        """Enter the hooks for one module's forward; returns what :meth:`pop` takes
        (``None`` where saved-tensor hooks are disabled or their stack cannot be read:
        copies are then saved as they are)."""
        if self._top is None or self._enabled is None or not self._enabled():
            return None
        outer = self._top(True)
        sources, saved = self.sources, []

        def pack(t: Tensor):
            packed = t if outer is None else outer[0](t)
            if packed is t and t.dtype == torch.float32 and t.device.type != "meta":
                entry = sources.get(t.untyped_storage().data_ptr())
                y = None if entry is None else entry[0]()
                if y is not None and y._version == 0:  # the copy as it was made
                    half = _Half(entry[1], t)
                    saved.append((half, t))
                    return half
            return packed

        def unpack(packed):
            if isinstance(packed, _Half):
                return packed.unpack()
            return packed if outer is None else outer[1](packed)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        return hooks, saved

    @staticmethod
    def pop(pushed: object) -> None:
        """Leave the hooks of one forward; a copy changed in place after it was saved
        there makes its saved form refuse to unpack (as autograd refuses a saved tensor
        changed in place)."""
        if pushed is None:
            return
        hooks, saved = pushed  # type: ignore[misc]
        hooks.__exit__(None, None, None)
        for half, view in saved:
            half.stale = view._version != half.copy_version
        saved.clear()


def plain_copy(module: nn.Module, convert: Callable[[Tensor], Tensor]) -> nn.Module:
    """A copy of ``module``'s tree to compute with: each module a new object of its own
    class (FSDP2's dynamic subclass left out) sharing its other attributes and the
    user's hooks (not those of ``torch.distributed``: FSDP's gathers), holding
    ``convert(t)`` for each parameter and buffer (a parameter stays a parameter; a
    tensor or module held under two names stays one object). With ``convert`` a
    ``DTensor``'s ``full_tensor`` it computes what a sharded module computes, on whole
    tensors; with a move to the ``meta`` device, its shapes."""
    made: dict[int, object] = {}

    def tensor(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        if id(t) not in made:
            new = convert(t)
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new.detach(), requires_grad=t.requires_grad)
            made[id(t)] = new
        return made[id(t)]  # type: ignore[return-value]

    def copy(m: nn.Module) -> nn.Module:
        if id(m) in made:
            return made[id(m)]  # type: ignore[return-value]
        cls = _own_class(m)
        new = cls.__new__(cls)
        made[id(m)] = new
        state = dict(vars(m))
        _drop_framework_hooks(state)
        state["_parameters"] = {n: tensor(p) for n, p in m._parameters.items()}
        state["_buffers"] = {n: tensor(b) for n, b in m._buffers.items()}
        state["_non_persistent_buffers_set"] = set(m._non_persistent_buffers_set)
        state["_modules"] = {n: None if c is None else copy(c) for n, c in m._modules.items()}
        new.__dict__.update(state)
        return new

    return copy(module)


def _drop_framework_hooks(state: dict) -> None:
    """In a module's ``vars``, new hook dicts without the hooks ``torch.distributed``
    registered (and their flags)."""
    tables = {k: v for k, v in state.items() if "_hooks" in k and isinstance(v, dict)}
    kept: set[int] = set()
    for key, table in tables.items():
        if key.endswith("_hooks"):  # id -> hook
            state[key] = type(table)(
                (i, hook)
                for i, hook in table.items()
                if not str(getattr(hook, "__module__", "")).startswith("torch.distributed")
            )
            kept.update(state[key])
    for key, table in tables.items():
        if not key.endswith("_hooks"):  # id -> flag (with kwargs, always called)
            state[key] = type(table)((i, flag) for i, flag in table.items() if i in kept)


def _own_class(module: nn.Module) -> type:
    """The class of ``module`` before FSDP2's ``fully_shard`` subclassed it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return type(module)
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
