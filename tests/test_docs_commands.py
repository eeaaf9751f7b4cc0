"""Every command line in the README and docs/*.md is one the program accepts, and the
README's `geosharp measure` / `geosharp symmetries` examples run (on the tiny test
checkpoints, with a small budget)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from geosharp.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "studies" / "docs").glob("*.md")),
]


def _commands(path: Path) -> list[list[str]]:
    """The geosharp command lines of the ```bash blocks of ``path``, as argv lists
    (continuation lines joined, comments and environment assignments dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split(" #")[0].split("&&")[-1], comments=True)
            words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
            if not words:
                continue
            if words[0].endswith("geosharp"):
                out.append(words[1:])
            elif "geosharp.cli" in words:
                out.append(words[words.index("geosharp.cli") + 1 :])
    return out


CASES = [(p.relative_to(ROOT).as_posix(), argv) for p in DOCS for argv in _commands(p)]


def test_the_docs_have_commands():
    assert len(CASES) > 30 and {c[0] for c in CASES} >= {"README.md", "studies/docs/zoo.md"}


@pytest.mark.parametrize("where, argv", CASES, ids=[f"{w}:{' '.join(a)[:60]}" for w, a in CASES])
def test_every_documented_command_parses(where, argv):
    from geosharp.cli import KNOWN_PLUGINS

    argv = [w.split("|")[0] if w != "..." else "PATH" for w in argv]  # clip|bert: one
    parser = build_parser()
    if argv[0] in KNOWN_PLUGINS and argv[0] not in parser.commands:
        pytest.skip(f"'{argv[0]}' comes with the studies package (studies/), not installed")
    try:
        parser.parse_args(argv)
    except SystemExit as exit:
        assert exit.code == 0, (where, argv)  # --help


def test_readme_measure_examples_run(bert_dir, vit_dir, text_csv, tmp_path, capsys, monkeypatch):
    """The `measure` and `symmetries` lines of the README and the CLI guide, run as
    written on the tiny BERT
    (and ViT for the image folder), with their files made to fit and a budget added."""
    import csv

    import datasets
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    with text_csv.open() as f:
        rows = list(csv.DictReader(f))
    with open("reviews.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"review": r["text"], "sentiment": int(r["label"])}) + "\n")
    table = {"text": [r["text"] for r in rows], "label": [int(r["label"]) for r in rows]}
    datasets.DatasetDict(train=datasets.Dataset.from_dict(table)).save_to_disk("my_dataset")
    for c in range(2):
        Path(f"images/{c}").mkdir(parents=True)
        for i in range(2):
            pixels = torch.randint(0, 256, (8, 8), dtype=torch.uint8).numpy()
            Image.fromarray(pixels).save(f"images/{c}/{i}.png")
    from test_usage import _causal_lm

    lm = _causal_lm(tmp_path / "lm")
    Path("texts.txt").write_text("\n".join(r["text"] for r in rows) + "\n")
    budget = ["--n-points", "8", "--batch-size", "8", "--n-iters", "1", "--quiet"]
    ran = 0
    for argv in _commands(ROOT / "README.md") + _commands(ROOT / "docs" / "cli.md"):
        placeholder = {"CHECKPOINT_DIR", "LM_DIR"} & set(argv)
        if argv[0] not in ("measure", "symmetries") or not placeholder or "..." in argv:
            continue
        checkpoint = vit_dir if "images/" in argv else lm if "LM_DIR" in argv else bert_dir
        argv = [str(checkpoint) if w in placeholder else w for w in argv]
        assert main([*argv, *(budget if argv[0] == "measure" else [])]) == 0, argv
        ran += 1
    capsys.readouterr()
    assert ran == 9 and json.loads(Path("out.json").read_text())["complete"] is True


def test_every_relative_link_of_the_docs_resolves():
    """The README, docs/*.md and the studies' docs link each other (and the results):
    no link is dead."""
    dead = [
        (path.relative_to(ROOT).as_posix(), target)
        for path in [*DOCS, ROOT / "studies" / "README.md"]
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
        if not target.startswith("http") and not (path.parent / target).exists()
    ]
    assert not dead, dead
