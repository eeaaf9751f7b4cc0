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

ImageNet is read from an ImageFolder-style directory (``<root>/<wnid>/<image>``, classes
in sorted order) with CLIP's preprocessing (resize the short side, centre crop,
normalise), implemented with Pillow and torch.

**BERT (McCoy et al. 2020 style MNLI fine-tunes).** Each fine-tune is a Hugging Face
``BertForSequenceClassification`` directory; MNLI is read from a GLUE-style TSV
(``sentence1``, ``sentence2``, ``gold_label`` columns) or JSON lines (``premise``,
``hypothesis``, ``label``).
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

from ..errors import UsageError

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


def imagenet_batches(
    root: str | Path, batch_size: int, n_images: int | None = None, size: int = 224, seed: int = 0
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(pixel_values, labels)`` batches from an ImageFolder-style directory: a fixed,
    seeded subset of ``n_images`` images (all when ``None``)."""
    from PIL import Image

    from ..data import image_folder_items

    items, _ = image_folder_items(root, n_images, seed)
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        with_images = []
        for f, _ in chunk:
            with Image.open(f) as im:
                with_images.append(_clip_preprocess(im, size))
        yield torch.stack(with_images), torch.tensor([c for _, c in chunk])


def clip_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


# --------------------------------------------------------------------------- MNLI


def load_bert_mnli(path: str | Path):
    """A BERT MNLI fine-tune (``BertForSequenceClassification`` directory) in eval mode."""
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification.from_pretrained(path, local_files_only=True).eval()


def _label_index(config, name: str) -> int:
    mapping = {k.lower(): v for k, v in (getattr(config, "label2id", None) or {}).items()}
    if set(MNLI_LABELS) <= set(mapping):
        return int(mapping[name])
    return MNLI_LABELS.index(name)


def read_mnli(path: str | Path) -> list[tuple[str, str, str]]:
    """``(premise, hypothesis, label name)`` from a GLUE TSV or a JSON-lines file."""
    path = Path(path)
    rows = []
    if path.suffix in (".jsonl", ".json"):
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                label = r.get("label", r.get("gold_label"))
                if isinstance(label, int):
                    label = MNLI_LABELS[label]
                rows.append(
                    (
                        r.get("premise", r.get("sentence1")),
                        r.get("hypothesis", r.get("sentence2")),
                        label,
                    )
                )
    else:
        with path.open(newline="") as f:
            for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
                rows.append((r["sentence1"], r["sentence2"], r["gold_label"]))
    return [r for r in rows if r[2] in MNLI_LABELS]


def mnli_batches(
    model_dir: str | Path,
    rows: list[tuple[str, str, str]],
    batch_size: int,
    n_examples: int | None = None,
    max_length: int = 128,
    config=None,
) -> list[dict[str, Tensor]]:
    """Tokenised batches (``input_ids``, ``token_type_ids``, ``attention_mask``,
    ``labels``) of the first ``n_examples`` rows, labels mapped by the model's config."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    config = config or AutoConfig.from_pretrained(model_dir, local_files_only=True)
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
        labels = torch.tensor([_label_index(config, r[2]) for r in chunk])
        batches.append({**dict(enc), "labels": labels})
    return batches


# --------------------------------------------------------------------------- driver


def _measure_checkpoint(
    model, batches, loss_fn, measures, rho_factors, n_iters, seed, path, autocast_dtype=None
):
    """Sharpness at every (measure, radius); resumable, rewritten atomically."""
    from ..measures import DEFAULT_RHO
    from .zoo import measure_grid, read_json

    record = read_json(path)
    if record.get("complete"):
        return record
    grid = {name: [float(DEFAULT_RHO[name] * f) for f in rho_factors] for name in measures}
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
    )


def read_gaps(path: str | Path) -> dict[str, float]:
    """``checkpoint,gap`` CSV (checkpoint = directory or file name) -> ``{name: gap}``."""
    with Path(path).open(newline="") as f:
        return {r["checkpoint"]: float(r["gap"]) for r in csv.DictReader(f)}


def _load(args, ckpt: Path, rows):
    """Model, measurement batches and loss of one checkpoint."""
    from ..hf import classification_loss

    if args.setting == "clip":
        model = load_clip_finetune(ckpt, config=args.config)
        size = model.vision.config.image_size
        batches = list(
            imagenet_batches(args.data, args.batch_size, args.n_points, size=size, seed=args.seed)
        )
        loss_fn = clip_loss
    else:
        model = load_bert_mnli(ckpt)
        batches = mnli_batches(ckpt, rows, args.batch_size, args.n_points)
        loss_fn = classification_loss
    return model, batches, loss_fn


def run_paper(args) -> dict:
    """Measure every checkpoint (this rank's share of them under ``torchrun``), then,
    on rank 0 once all are done, read every record back and write ``summary.json``."""
    from .. import distributed as gd
    from ..data import move_batch
    from ..errors import MissingInputError
    from ..hf import quiet_transformers
    from ..io import write_json_atomic
    from ..options import autocast_dtype, check_device
    from ..progress import Progress
    from .stats import kendall_tau_with_ci

    out = Path(args.out)
    checkpoints = list_checkpoints(args.checkpoints)
    if not checkpoints:
        raise MissingInputError(
            f"no checkpoints under {args.checkpoints} (sub-directories with config.json, "
            "or *.pt files)"
        )
    rank, _ = gd.init()  # under torchrun every rank takes its share of the checkpoints
    device = check_device(args.device)
    autocast = autocast_dtype(args.autocast)
    rows = read_mnli(args.data) if args.setting == "bert" else None
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
        )
    gd.barrier()
    records = {
        c.name: json.loads((out / "measures" / f"{c.name}.json").read_text()) for c in checkpoints
    }
    summary = dict(setting=args.setting, n_models=len(records), taus={})
    if args.gaps:
        gaps = read_gaps(args.gaps)
        names = [n for n in records if n in gaps]
        gap = [gaps[n] for n in names]
        for measure in args.measures:
            for key in records[names[0]]["measures"][measure] if names else []:
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
    from ..measures import MEASURES
    from ..options import add_autocast, add_device, add_seed, positive_float, positive_int
    from .zoo import ALL_MEASURES

    p.add_argument("setting", choices=("clip", "bert"))
    p.add_argument("--checkpoints", required=True, help="directory of fine-tunes")
    p.add_argument("--data", required=True, help="ImageNet folder (clip) or MNLI TSV/JSONL (bert)")
    p.add_argument("--config", help="CLIPVisionConfig directory for model-soups .pt files")
    p.add_argument("--gaps", help="CSV with columns checkpoint,gap for the Kendall taus")
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
    from ..options import Parser

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
    from ..errors import MissingInputError
    from ..options import check_device

    for key, value in PAPER_PROTOCOL[args.setting].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_device(args.device)
    for option in ("checkpoints", "data", "gaps", "config"):
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
