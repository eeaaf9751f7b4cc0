"""Paper-scale drivers: CLIP ViT-B/32 fine-tunes on ImageNet, BERT fine-tunes on MNLI.

Nothing is downloaded: the user supplies local paths.

**CLIP (model-soups style fine-tunes).** A fine-tune is a CLIP image tower plus a linear
classification head on the normalised image embedding. Two layouts are read:

* a Hugging Face directory: ``config.json`` + weights of a ``CLIPModel`` (or
  ``CLIPVisionModelWithProjection``) written by ``save_pretrained``, and
  ``classification_head.safetensors`` (``weight`` ``(classes, d)``, optional ``bias``);
* a model-soups checkpoint ``*.pt``: a state dict in OpenAI CLIP naming
  (``visual.conv1.weight``, ``visual.transformer.resblocks.0.attn.in_proj_weight``,
  ...; an optional ``model.`` prefix is dropped) with ``classification_head.weight``
  (and ``.bias``), converted to the Hugging Face ``CLIPVisionModelWithProjection`` named
  by ``config`` (a ``CLIPVisionConfig`` or a directory holding its ``config.json``).

ImageNet is read from an ImageFolder-style directory (``<root>/<wnid>/<image>``) with
CLIP's preprocessing (resize the short side, centre crop, normalise), implemented with
Pillow and torch. Folders are matched to the head's classes by wnid: with ``classes``
(``--classes``, the wnids in the head's order, one per line, e.g. ImageNet's
``LOC_synset_mapping.txt``), or, without it, only when there are as many folders as the
head has classes (sorted order, the standard class index).

**BERT (McCoy et al. 2020 style MNLI fine-tunes).** Each fine-tune is a Hugging Face
``BertForSequenceClassification`` directory with its tokenizer and trained head; MNLI
is read from a TSV/CSV (``sentence1``/``premise``, ``sentence2``/``hypothesis``,
``gold_label``/``label`` columns) or JSON lines. Label names are read case-insensitively;
integer labels are Hugging Face ``glue/mnli``'s (0 entailment, 1 neutral, 2
contradiction; -1, unlabelled, and GLUE's ``-`` are dropped). They reach the model's
outputs through its config's label names, or ``label_order`` (``--label-order``) for a
checkpoint whose labels have no names.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from geosharp.errors import UsageError

__all__ = [
    "MNLI_LABELS",
    "CLIPClassifier",
    "clip_loss",
    "convert_openai_clip_visual",
    "imagenet_batches",
    "list_checkpoints",
    "load_bert_mnli",
    "load_clip_finetune",
    "main",
    "mnli_batches",
    "read_gaps",
    "read_mnli",
    "run_paper",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MNLI_LABELS = ("contradiction", "entailment", "neutral")  # GLUE's order


class CLIPClassifier(nn.Module):
    """CLIP image tower + linear head on the normalised image embedding."""

    def __init__(self, vision: nn.Module, head: nn.Linear):
        super().__init__()
        self.vision = vision
        self.classification_head = head

    def forward(self, pixel_values: Tensor) -> Tensor:
        embeds = self.vision(pixel_values=pixel_values).image_embeds
        return self.classification_head(F.normalize(embeds, dim=-1))


def _head_from(state: dict, prefix: str = "") -> nn.Linear:
    weight = state[prefix + "weight"]
    bias = state.get(prefix + "bias")
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        head.weight.copy_(weight)
        if bias is not None:
            head.bias.copy_(bias)
    return head


def convert_openai_clip_visual(state: dict, n_layers: int) -> dict:
    """OpenAI-CLIP visual-tower keys -> Hugging Face ``CLIPVisionModelWithProjection``."""
    out = {
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.pre_layrnorm.bias": state["visual.ln_pre.bias"],
        "vision_model.post_layernorm.weight": state["visual.ln_post.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].t().contiguous(),
    }
    for i in range(n_layers):
        src, dst = f"visual.transformer.resblocks.{i}.", f"vision_model.encoder.layers.{i}."
        w_q, w_k, w_v = state[src + "attn.in_proj_weight"].chunk(3, dim=0)
        b_q, b_k, b_v = state[src + "attn.in_proj_bias"].chunk(3, dim=0)
        for name, w, b in (("q", w_q, b_q), ("k", w_k, b_k), ("v", w_v, b_v)):
            out[dst + f"self_attn.{name}_proj.weight"] = w
            out[dst + f"self_attn.{name}_proj.bias"] = b
        pairs = {
            "attn.out_proj": "self_attn.out_proj",
            "ln_1": "layer_norm1",
            "ln_2": "layer_norm2",
            "mlp.c_fc": "mlp.fc1",
            "mlp.c_proj": "mlp.fc2",
        }
        for a, b in pairs.items():
            for p in ("weight", "bias"):
                out[dst + f"{b}.{p}"] = state[src + f"{a}.{p}"]
    return out


def load_clip_finetune(path: str | Path, config=None) -> CLIPClassifier:
    """A CLIP fine-tune from a Hugging Face directory or a model-soups ``.pt`` file."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    path = Path(path)
    if path.is_dir():
        from safetensors.torch import load_file

        head = _head_from(load_file(path / "classification_head.safetensors"))
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("model_type") == "clip":
            from transformers import CLIPModel

            full = CLIPModel.from_pretrained(path, local_files_only=True)
            vision = CLIPVisionModelWithProjection(full.config.vision_config)
            vision.config.projection_dim = full.config.projection_dim
            vision.vision_model.load_state_dict(full.vision_model.state_dict())
            vision.visual_projection = full.visual_projection
        else:
            vision = CLIPVisionModelWithProjection.from_pretrained(path, local_files_only=True)
        return CLIPClassifier(vision, head).eval()
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    state = {re.sub(r"^(module\.)?(model\.)?", "", k): v for k, v in state.items()}
    if config is None:
        raise UsageError(
            "a model-soups .pt checkpoint needs a CLIPVisionConfig: pass --config DIR "
            "(config= in Python)"
        )
    if not isinstance(config, CLIPVisionConfig):
        config = CLIPVisionConfig.from_pretrained(config, local_files_only=True)
    vision = CLIPVisionModelWithProjection(config)
    converted = convert_openai_clip_visual(state, config.num_hidden_layers)
    missing, unexpected = vision.load_state_dict(converted, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise UsageError(
            f"{path} does not fit the config: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]} (and more); pass the --config it was trained with"
        )
    return CLIPClassifier(vision, _head_from(state, "classification_head.")).eval()


def list_checkpoints(root: str | Path) -> list[Path]:
    """Fine-tunes under ``root``: sub-directories with ``config.json`` and ``*.pt`` files."""
    root = Path(root)
    dirs = [p for p in sorted(root.iterdir()) if (p / "config.json").exists()]
    return dirs + sorted(root.glob("*.pt"))


def _clip_preprocess(image, size: int) -> Tensor:
    image = image.convert("RGB")
    w, h = image.size
    scale = size / min(w, h)
    image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), 3)
    w, h = image.size
    left, top = (w - size) // 2, (h - size) // 2
    image = image.crop((left, top, left + size, top + size))
    x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    x = x.view(size, size, 3).permute(2, 0, 1).float() / 255.0
    mean, std = torch.tensor(CLIP_MEAN)[:, None, None], torch.tensor(CLIP_STD)[:, None, None]
    return (x - mean) / std


def imagenet_class_ids(root: str | Path, n_classes: int, classes: str | Path | None = None):
    """``{folder: class index of the head}`` of an ImageNet folder: by wnid through
    ``classes`` (a file of the head's wnids in order, the first word of each line), or,
    without it, the folders in sorted order when there are exactly ``n_classes``."""
    root = Path(root)
    folders = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not folders:
        raise UsageError(f"--data {root}: no class folders (expected {root}/<wnid>/<image>)")
    if classes is not None:
        wnids = [line.split()[0] for line in Path(classes).read_text().splitlines() if line.strip()]
        if len(wnids) != n_classes:
            raise UsageError(
                f"--classes {classes} lists {len(wnids)} classes; the head has {n_classes}"
            )
        index = {w: i for i, w in enumerate(wnids)}
        unknown = [f for f in folders if f not in index]
        if unknown:
            raise UsageError(f"class folders {unknown[:5]} are not in --classes {classes}")
        return {f: index[f] for f in folders}
    if len(folders) != n_classes:
        raise UsageError(
            f"--data {root} has {len(folders)} class folders and the head {n_classes} "
            "classes: which index each folder has is unknown; pass --classes with the "
            "head's wnids in order (e.g. ImageNet's LOC_synset_mapping.txt)"
        )
    return {f: i for i, f in enumerate(folders)}


def imagenet_batches(
    root: str | Path,
    batch_size: int,
    n_images: int | None = None,
    size: int = 224,
    seed: int = 0,
    class_ids: dict[str, int] | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(pixel_values, labels)`` batches from an ImageFolder-style directory: a fixed,
    seeded subset of ``n_images`` images (all when ``None``); labels through
    ``class_ids`` (:func:`imagenet_class_ids`; default: the sorted folders)."""
    from geosharp.loading.data import image_folder_items, read_images

    items, folders = image_folder_items(root, n_images, seed)
    if not items:
        raise UsageError(f"--data {root}: no images in its class folders ({root}/<wnid>/<image>)")
    ids = [class_ids[f] for f in folders] if class_ids is not None else list(range(len(folders)))
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        images = read_images([f for f, _ in chunk], "RGB")
        pixels = torch.stack([_clip_preprocess(im, size) for im in images])
        yield pixels, torch.tensor([ids[c] for _, c in chunk])


def clip_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


# --------------------------------------------------------------------------- MNLI


def load_bert_mnli(path: str | Path):
    """A BERT MNLI fine-tune (``BertForSequenceClassification`` directory) in eval mode;
    an error when its weights lack the trained classifier (a new random head would be
    measured, another on every load)."""
    from transformers import BertForSequenceClassification

    from geosharp.loading.hf import check_weights, quiet_transformers

    check_weights(path)
    with quiet_transformers():
        model, info = BertForSequenceClassification.from_pretrained(
            path, local_files_only=True, output_loading_info=True
        )
    missing = [k for k in info.get("missing_keys", ()) if "position_ids" not in k]
    if missing:
        raise UsageError(
            f"{path} has no trained {missing[0]} (and {len(missing) - 1} more missing): the "
            "fine-tune's classifier must be saved with it"
        )
    return model.eval()


HF_MNLI_ORDER = ("entailment", "neutral", "contradiction")  # datasets' glue/mnli
_COLUMNS = {
    "premise": ("sentence1", "premise"),
    "hypothesis": ("sentence2", "hypothesis"),
    "label": ("gold_label", "label"),
}


def mnli_label_ids(config, label_order: list[str] | None = None) -> dict[str, int]:
    """``{MNLI label name: model output}`` from the config's label names, or from
    ``label_order`` (the names in output order) when the config names none; an error
    when neither says it, or they disagree."""
    from geosharp.loading.hfdata import label_names

    if getattr(config, "num_labels", 3) != 3:
        raise UsageError(f"the checkpoint has {config.num_labels} outputs; MNLI has 3 classes")
    given = None
    if label_order is not None:
        order = [n.strip().lower() for n in label_order]
        if sorted(order) != sorted(MNLI_LABELS):
            raise UsageError(
                f"--label-order {','.join(label_order)}: give {', '.join(HF_MNLI_ORDER)} "
                "in the order of the model's outputs"
            )
        given = {n: i for i, n in enumerate(order)}
    names = label_names(config)
    if names is not None:
        lookup = {v.strip().lower(): k for k, v in names.items()}
        if not set(MNLI_LABELS) <= set(lookup):
            raise UsageError(
                f"the checkpoint's labels {sorted(names.values())} are not MNLI's "
                f"({', '.join(MNLI_LABELS)})"
            )
        mapping = {n: lookup[n] for n in MNLI_LABELS}
        if given is not None and given != mapping:
            raise UsageError("--label-order disagrees with the checkpoint's own label names")
        return mapping
    if given is None:
        raise UsageError(
            "the checkpoint's labels have no names (LABEL_0, LABEL_1, LABEL_2), so which "
            "output is entailment is unknown: pass --label-order with the order it was "
            "fine-tuned with (Hugging Face glue/mnli: entailment,neutral,contradiction)"
        )
    return given


def read_mnli(path: str | Path) -> list[tuple[str, str, str]]:
    """``(premise, hypothesis, label name)`` of the labelled rows of a TSV/CSV or
    JSON-lines file (see the module's docstring); unlabelled rows are dropped, other
    problems are errors naming the row."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise UsageError(f"{path}: not UTF-8 text (offset {err.start}); save it as UTF-8") from None
    if path.suffix in (".jsonl", ".json"):
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((number, json.loads(line)))
                except json.JSONDecodeError:
                    raise UsageError(f"{path}, line {number}: not a JSON object") from None
    else:
        tsv = path.suffix != ".csv"
        reader = csv.DictReader(
            text.splitlines(),
            delimiter="\t" if tsv else ",",
            quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL,
        )
        records = [(number, r) for number, r in enumerate(reader, 2)]
    rows = []
    for number, record in records:
        if not isinstance(record, dict):
            raise UsageError(f"{path}, line {number}: expected an object with named fields")
        values = {}
        for field, names in _COLUMNS.items():
            key = next((n for n in names if n in record), None)
            if key is None:
                raise UsageError(
                    f"{path}, line {number}: no {' or '.join(map(repr, names))} field "
                    f"(fields: {', '.join(map(str, record))})"
                )
            values[field] = record[key]
        label = _mnli_label(values["label"], path, number)
        if label is None:
            continue
        for field in ("premise", "hypothesis"):
            if not isinstance(values[field], str) or not values[field].strip():
                raise UsageError(f"{path}, line {number}: the {field} is empty or missing")
        rows.append((values["premise"], values["hypothesis"], label))
    if not rows:
        raise UsageError(f"{path} holds no labelled MNLI rows")
    return rows


def _mnli_label(label, path: Path, number: int) -> str | None:
    """The label's name; ``None`` for an unlabelled row (-1, ``-``, empty)."""
    text = str(label).strip().lower() if label is not None else ""
    if isinstance(label, bool):
        text = "?"
    elif isinstance(label, int) or text.lstrip("-").isdigit():
        index = int(text)
        if index == -1:
            return None
        if 0 <= index < 3:
            return HF_MNLI_ORDER[index]
    if text in ("", "-"):
        return None
    if text in MNLI_LABELS:
        return text
    raise UsageError(
        f"{path}, line {number}: label {label!r} is not an MNLI label "
        f"({', '.join(HF_MNLI_ORDER)}, or 0-2 in that order)"
    )


def mnli_batches(
    model_dir: str | Path,
    rows: list[tuple[str, str, str]],
    batch_size: int,
    n_examples: int | None = None,
    max_length: int = 128,
    config=None,
    label_order: list[str] | None = None,
) -> list[dict[str, Tensor]]:
    """Tokenised batches (``input_ids``, ``token_type_ids``, ``attention_mask``,
    ``labels``) of the first ``n_examples`` rows, labels mapped to the model's outputs
    by :func:`mnli_label_ids`; the checkpoint's own tokenizer (an error without one)."""
    from geosharp.loading.hf import load_config, load_tokenizer

    tok = load_tokenizer(model_dir)
    config = config or load_config(model_dir)
    ids = mnli_label_ids(config, label_order)
    rows = rows[:n_examples] if n_examples is not None else rows
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        enc = tok(
            [r[0] for r in chunk],
            [r[1] for r in chunk],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        labels = torch.tensor([ids[r[2]] for r in chunk])
        batches.append({**dict(enc), "labels": labels})
    return batches


# --------------------------------------------------------------------------- driver


def _measure_checkpoint(
    model,
    batches,
    loss_fn,
    measures,
    rho_factors,
    n_iters,
    seed,
    path,
    autocast_dtype=None,
    settings=None,
    progress=False,
):
    """Sharpness at every (measure, radius); resumable, rewritten atomically. A record
    made with other ``settings`` is refused; a measure or radius it lacks is added."""
    from geosharp.measures import DEFAULT_RHO

    from .zoo import measure_grid, read_json
    from .zoo.store import missing

    record = read_json(path)
    grid = {name: [float(DEFAULT_RHO[name] * f) for f in rho_factors] for name in measures}
    if settings is not None:
        _same_settings(record, settings, path)
        record["settings"] = settings
    if record.get("complete") and not missing(record, grid):
        return record
    return measure_grid(
        record,
        path,
        model,
        batches,
        loss_fn,
        grid,
        n_iters=n_iters,
        seed=seed,
        autocast_dtype=autocast_dtype,
        progress=progress,
    )


def _same_settings(record: dict, settings: dict, path) -> None:
    if not record:
        return
    was = record.get("settings")
    if was is None:
        raise UsageError(
            f"{path} was written without its settings (an older geosharp): use another --out"
        )
    changed = [k for k in sorted(set(was) | set(settings)) if was.get(k) != settings.get(k)]
    if changed:
        k = changed[0]
        raise UsageError(
            f"{path} was measured with other settings ({k}: {was.get(k)!r} there, "
            f"{settings.get(k)!r} now): use another --out, or the same settings"
        )


def run_settings(args) -> dict:
    """What changes a stored value: records carry it, and a rerun with other settings
    on the same ``--out`` is refused."""
    keys = ("setting", "n_points", "batch_size", "n_iters", "seed", "autocast", "config",
            "label_order", "classes", "max_length")  # fmt: skip
    out = {k: getattr(args, k, None) for k in keys}
    out["data"] = str(Path(args.data).resolve())
    return out


def read_gaps(path: str | Path) -> dict[str, float]:
    """``checkpoint,gap`` CSV (checkpoint = directory or file name) -> ``{name: gap}``."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise UsageError(f"--gaps {path}: not UTF-8 text") from None
    reader = csv.DictReader(text.splitlines())
    if not {"checkpoint", "gap"} <= set(reader.fieldnames or ()):
        raise UsageError(
            f"--gaps {path}: needs columns checkpoint,gap "
            f"(has {', '.join(reader.fieldnames or [])})"
        )
    gaps = {}
    for number, row in enumerate(reader, 2):
        try:
            gaps[row["checkpoint"].strip()] = float(row["gap"])
        except (TypeError, ValueError, AttributeError):
            raise UsageError(
                f"--gaps {path}, line {number}: gap {row['gap']!r} is not a number"
            ) from None
    return gaps


def matched_gaps(gaps: dict[str, float], checkpoints: list[Path], path) -> dict[str, float]:
    """The gap of every checkpoint (by directory or file name); an error naming the
    checkpoints without one and the names that match no checkpoint."""
    names = [c.name for c in checkpoints]
    stems = {c.stem: c.name for c in checkpoints}
    out = {}
    for key, gap in gaps.items():
        name = key if key in names else stems.get(key, Path(key).name)
        if name in names:
            out[name] = gap
    lacking = [n for n in names if n not in out]
    unused = [k for k in gaps if (k if k in names else stems.get(k, Path(k).name)) not in names]
    if lacking or unused:
        raise UsageError(
            f"--gaps {path} does not match the checkpoints: no gap for {lacking[:3]}"
            f"{' ...' if len(lacking) > 3 else ''}; names matching no checkpoint {unused[:3]}"
            f"{' ...' if len(unused) > 3 else ''}"
        )
    return out


def _load(args, ckpt: Path, rows):
    """Model, measurement batches and loss of one checkpoint."""
    from geosharp.loading.hf import classification_loss

    if args.setting == "clip":
        model = load_clip_finetune(ckpt, config=args.config)
        size = model.vision.config.image_size
        ids = imagenet_class_ids(
            args.data, model.classification_head.out_features, getattr(args, "classes", None)
        )
        batches = list(
            imagenet_batches(
                args.data, args.batch_size, args.n_points, size=size, seed=args.seed, class_ids=ids
            )
        )
        loss_fn = clip_loss
    else:
        model = load_bert_mnli(ckpt)
        batches = mnli_batches(
            ckpt, rows, args.batch_size, args.n_points,
            label_order=getattr(args, "label_order", None),
        )  # fmt: skip
        loss_fn = classification_loss
    return model, batches, loss_fn


def run_paper(args) -> dict:
    """Measure every checkpoint (this rank's share of them under ``torchrun``), then,
    on rank 0 once all are done, read every record back and write ``summary.json``."""
    from geosharp import distributed as gd
    from geosharp.cli.options import autocast_dtype, check_device
    from geosharp.errors import MissingInputError
    from geosharp.io import write_json_atomic
    from geosharp.loading.data import move_batch
    from geosharp.loading.hf import quiet_transformers
    from geosharp.measures import DEFAULT_RHO
    from geosharp.progress import Progress

    from .stats import kendall_tau_with_ci

    out = Path(args.out)
    checkpoints = list_checkpoints(args.checkpoints)
    if not checkpoints:
        raise MissingInputError(
            f"no checkpoints under {args.checkpoints} (sub-directories with config.json, "
            "or *.pt files)"
        )
    if args.setting == "clip":  # every fine-tune's files, before any is measured
        for ckpt in checkpoints:
            if ckpt.is_dir() and not (ckpt / "classification_head.safetensors").exists():
                raise MissingInputError(
                    f"{ckpt}: no classification_head.safetensors (the fine-tune's head, "
                    "weight (classes, d) and optional bias); save it beside config.json"
                )
    rank, _ = gd.init()  # under torchrun every rank takes its share of the checkpoints
    device = check_device(args.device)
    autocast = autocast_dtype(args.autocast)
    rows = read_mnli(args.data) if args.setting == "bert" else None
    gaps = matched_gaps(read_gaps(args.gaps), checkpoints, args.gaps) if args.gaps else None
    settings = run_settings(args)
    mine = [checkpoints[i] for i in gd.shard(len(checkpoints))]
    bar = Progress(mine, desc=f"measure {args.setting}", unit="model", enabled=rank == 0)
    for ckpt in bar:
        with quiet_transformers():  # no load reports or bars
            model, batches, loss_fn = _load(args, ckpt, rows)
        _measure_checkpoint(
            model.to(device),
            [move_batch(b, device) for b in batches],
            loss_fn,
            args.measures,
            args.rho_factors,
            args.n_iters,
            args.seed,
            out / "measures" / f"{ckpt.name}.json",
            autocast_dtype=autocast,
            settings=settings,
            progress=rank == 0,
        )
    gd.barrier()
    records = {
        c.name: json.loads((out / "measures" / f"{c.name}.json").read_text()) for c in checkpoints
    }
    summary = dict(setting=args.setting, n_models=len(records), taus={})
    if gaps:
        names = list(records)
        gap = [gaps[n] for n in names]
        for measure in args.measures:
            keys = [repr(float(DEFAULT_RHO[measure] * f)) for f in args.rho_factors]
            for key in keys:
                vals = [records[n]["measures"][measure][key]["value"] for n in names]
                ci = kendall_tau_with_ci(vals, gap, n_boot=args.n_boot, seed=args.seed)
                summary["taus"].setdefault(measure, {})[key] = ci.to_dict()
    if rank == 0:
        write_json_atomic(out / "summary.json", summary)
    gd.barrier()
    return summary


DESCRIPTION = (
    "Sharpness of paper-scale fine-tunes (CLIP on ImageNet, BERT on MNLI) from local paths."
)


def add_arguments(p) -> None:
    """The driver's command-line options (``geosharp study paper --help``)."""
    from geosharp.cli.options import (
        add_autocast,
        add_device,
        add_seed,
        positive_float,
        positive_int,
    )
    from geosharp.measures import MEASURES

    from .zoo import ALL_MEASURES

    p.add_argument("setting", choices=("clip", "bert"))
    p.add_argument("--checkpoints", required=True, help="directory of fine-tunes")
    p.add_argument("--data", required=True, help="ImageNet folder (clip) or MNLI TSV/JSONL (bert)")
    p.add_argument("--config", help="CLIPVisionConfig directory for model-soups .pt files")
    p.add_argument("--gaps", help="CSV with columns checkpoint,gap for the Kendall taus")
    p.add_argument(
        "--label-order",
        type=lambda text: [t.strip() for t in text.split(",")],
        help="bert: the MNLI labels in the order of the model's outputs, for checkpoints "
        "whose config names none (e.g. entailment,neutral,contradiction)",
    )
    p.add_argument(
        "--classes",
        help="clip: file of the head's ImageNet wnids in order, one per line (e.g. "
        "LOC_synset_mapping.txt); needed when --data holds a subset of the classes",
    )
    p.add_argument("--out", default="runs/paper", help="results directory (runs/paper)")
    p.add_argument(
        "--n-points",
        type=positive_int,
        help="training points (the paper's protocol: clip 2048, bert 1024)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, help="batch size (the paper's: clip 256, bert 128)"
    )
    p.add_argument("--n-iters", type=positive_int, default=20, help="Auto-PGD steps (20)")
    p.add_argument(
        "--measures", nargs="+", choices=list(MEASURES), default=list(ALL_MEASURES), metavar="M"
    )
    p.add_argument(
        "--rho-factors",
        nargs="+",
        type=positive_float,
        default=[0.25, 0.5, 1.0, 2.0, 4.0],
        help="radii as multiples of each measure's default (0.25 0.5 1 2 4)",
    )
    p.add_argument("--n-boot", type=positive_int, default=1000, help="bootstrap resamples")
    add_seed(p, "data subset and random starts")
    add_device(p)
    add_autocast(p)


def _parser():
    from geosharp.cli.options import Parser

    p = Parser(prog="geosharp study paper", description=DESCRIPTION)
    add_arguments(p)
    return p


def main(argv=None) -> int:
    return run(_parser().parse_args(argv))


# The paper's protocol: sharpness on training points, in batches, per setting.
PAPER_PROTOCOL = {
    "clip": dict(n_points=2048, batch_size=256),
    "bert": dict(n_points=1024, batch_size=128),
}


def run(args) -> int:
    """Run the driver for parsed options; paths and the device are checked first. Points
    and batch size default to the paper's protocol (``PAPER_PROTOCOL``)."""
    from geosharp.cli.options import check_device
    from geosharp.errors import MissingInputError

    for key, value in PAPER_PROTOCOL[args.setting].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_device(args.device)
    for option in ("checkpoints", "data", "gaps", "config", "classes"):
        value = getattr(args, option)
        if value is not None and not Path(value).exists():
            raise MissingInputError(f"--{option} {value}: no such file or directory")
    summary = run_paper(args)
    print(
        json.dumps(summary["taus"], indent=1)
        if summary["taus"]
        else f"measured {summary['n_models']} models"
    )
    return 0
