"""``muonscale`` command line: ``muonscale bench``, ``muonscale train``, ``muonscale route`` and
``muonscale docs``.

Flags are generated from the config dataclasses (``BenchConfig``, ``TrainConfig``), with each
field's docstring as help, so the command line and the configs cannot drift apart. torch is
imported only once a command runs, so ``muonscale --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import importlib.util
import json
import re
import signal
import sys
from pathlib import Path

import muonscale

DESCRIPTION = "Muon optimizer at AdamW's speed: benchmark it, train with it."

BENCH_DESCRIPTION = """\
Train AdamW, muonscale Muon (and --baselines) on the same model, data order, seed,
schedule and token budget, steps interleaved, each at its own learning rate. Reports
steps to AdamW's final validation loss, throughput (tokens/s) and memory in
report.md / report.json, with plots. Default: tiny byte-level GPT on the bundled
Shakespeare corpus, on CPU, in under 6 minutes on 2 cores.
"""

BENCH_EPILOG = """\
examples:
  muonscale bench                                  # the default CPU comparison
  muonscale bench --baselines torch-muon           # add torch.optim.Muon
  muonscale bench --sweep --steps 200              # pick each contender's lr by a short sweep
  muonscale bench --data my_corpus.txt --tokenizer bpe   # on your own text, BPE tokens
  muonscale bench --out runs/v --sweep --seeds 3 --variants pe=coefficients:polar_express
                                                   # + a Muon variant, every lr swept, 3 seeds
  muonscale bench --device cuda --model gpt2-small --tokens-per-step 65536 --micro-batch-size 16
"""


def build_parser() -> argparse.ArgumentParser:
    from muonscale.bench.config import BenchConfig
    from muonscale.train.config import TrainConfig, add_dataclass_arguments

    parser = argparse.ArgumentParser(prog="muonscale", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"muonscale {muonscale.__version__}")
    commands = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", required=True
    )

    bench = commands.add_parser(
        "bench",
        help="AdamW vs Muon side by side; writes report.md, report.json and plots",
        description=BENCH_DESCRIPTION,
        epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_dataclass_arguments(bench, BenchConfig)
    bench.set_defaults(command_parser=bench)

    train = commands.add_parser(
        "train",
        help="train the reference GPT with one optimizer",
        description="One training run of the reference GPT (muonscale.train.TrainingRun).",
    )
    add_dataclass_arguments(train, TrainConfig)
    train.set_defaults(command_parser=train)
    train.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar, or progress lines without tqdm (default: True)",
    )
    train.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="also write TensorBoard event files into DIR: losses, lr, the optimizer's update "
        "RMS, skipped steps and step time (needs tensorboard)",
    )

    route = commands.add_parser(
        "route",
        help="print which parameters of a model go to Muon and which to AdamW, without training",
        description="The routing table muonscale gives a model (muonscale.Muon.summary()): "
        "algorithm, shape, reason, transposed and split weights. MODEL is "
        "package.module:callable returning an nn.Module, or a Hugging Face config.json (or "
        "a folder holding one; needs transformers).",
    )
    route.add_argument("model", metavar="MODEL", help="package.module:callable or config.json")
    route.add_argument(
        "--qkv-split",
        choices=("qkv", "head"),
        default="qkv",
        help="how a model's fused QKV weights (model.qkv_layout) are split (default: qkv)",
    )
    route.set_defaults(command_parser=route)

    docs = commands.add_parser(
        "docs",
        help="list the documentation's pages, or print one (they ship with the package)",
        description="The documentation as Markdown, the pages of the docs site: without PAGE "
        "the list of pages, with PAGE that page (by its name or title, e.g. options or "
        "'Newton-Schulz', as docstrings name them).",
    )
    docs.add_argument("page", metavar="PAGE", nargs="?", help="a page's name or title")
    docs.set_defaults(command_parser=docs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            return _bench(args)
        if args.command == "route":
            return _route(args)
        if args.command == "docs":
            return _docs(args)
        return _train(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _config_or_exit(cls: type, args: argparse.Namespace):
    from muonscale.train.config import dataclass_from_args

    try:
        return dataclass_from_args(cls, args)
    except (ValueError, NotImplementedError) as error:
        args.command_parser.error(str(error))  # exits with status 2 and the usage line


def _bench(args: argparse.Namespace) -> int:
    from muonscale.bench import BenchConfig, prepare_out_dir, run_bench, writable_folder
    from muonscale.bench.runner import train_config_for
    from muonscale.memory import MemoryBudget

    config = _config_or_exit(BenchConfig, args)
    try:  # MUONSCALE_*_MB, read by every optimizer built later
        MemoryBudget.from_environment()
    except ValueError as error:
        args.command_parser.error(str(error))
    for contender in config.contenders:  # fail on bad model/batch flags before any training
        try:
            train_config_for(config, contender, config.lr_for(contender))
        except ValueError as error:
            args.command_parser.error(str(error))
    if config.data is not None:
        from muonscale.train.data import load_corpus

        try:
            load_corpus(config.data)
        except (OSError, ValueError) as error:
            args.command_parser.error(f"--data: {error}")
    try:
        out_dir = prepare_out_dir(config.out)
        if config.tensorboard is not None:
            writable_folder(Path(config.tensorboard), "--tensorboard")
    except OSError as error:
        args.command_parser.error(str(error))
    run_bench(dataclasses.replace(config, out=str(out_dir)))
    return 0


def _train(args: argparse.Namespace) -> int:
    from muonscale.train.checkpoint import CheckpointError
    from muonscale.train.config import TrainConfig

    config = _config_or_exit(TrainConfig, args)
    if args.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        args.command_parser.error(
            "--tensorboard needs the tensorboard package, which is not installed: "
            'pip install "muonscale[bench]" (or pip install tensorboard)'
        )
    from muonscale.train.trainer import NonFiniteLossError, TrainingRun

    if config.parallel != "none":
        from muonscale.train.parallel import torchrun_environment

        try:
            torchrun_environment()
        except RuntimeError as error:
            args.command_parser.error(str(error))
    run = None
    try:
        run = TrainingRun(config)
        rank = run.rank
        summary = run.run(progress=args.progress, tensorboard=args.tensorboard)
    except (OSError, CheckpointError, NonFiniteLossError) as error:  # each names its file
        print(f"muonscale train: error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:  # e.g. micro-batch not divisible by the number of ranks
        print(f"muonscale train: error: {error}", file=sys.stderr)
        return 2
    finally:
        if run is not None:
            run.close()
    if summary.interrupted:
        where = (
            f"checkpoint at step {summary.steps}: {summary.checkpoint}; continue with "
            f"--resume auto --out-dir {config.out_dir}"
            if summary.checkpoint
            else "nothing saved (--out-dir none)"
        )
        print(f"muonscale train: interrupted by {summary.signal}; {where}", file=sys.stderr)
        return 128 + int(getattr(signal.Signals, summary.signal or "SIGINT"))
    if rank == 0:
        print(summary_line(summary), flush=True)
    return 0


def summary_line(summary) -> str:
    """The line ``muonscale train`` ends with: steps, losses, checkpoint, wall time."""
    val = f"{summary.val_loss:.4f}" if summary.val_loss is not None else "not evaluated"
    train = f"{summary.train_loss:.4f}" if summary.train_loss is not None else "-"
    checkpoint = summary.checkpoint or "none (--out-dir none)"
    return (
        f"muonscale train: {summary.steps} steps, train loss {train}, val loss {val}, "
        f"checkpoint {checkpoint} ({summary.seconds:.1f} s)"
    )


def _route(args: argparse.Namespace) -> int:
    from muonscale.route_model import ModelSpecError, build_model, routing_table

    try:
        model = build_model(args.model)
    except ModelSpecError as error:
        args.command_parser.error(str(error))
    print(routing_table(model, qkv_split=args.qkv_split))
    return 0


DOCS_INDEX = "index.json"
"""In the installed package's ``docs/`` folder: ``[{"name", "title", "file"}, ...]`` in the
site's order, written by the build (``setup.py``) from ``mkdocs.yml``."""


def page_name(title: str) -> str:
    """A page's name on the command line: its title in lowercase, other characters as ``-``
    (``"Newton–Schulz"`` -> ``newton-schulz``)."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def nav_pages(mkdocs_yml: str) -> list[tuple[str, str]]:
    """``[(title, path)]`` of the Markdown pages in ``mkdocs.yml``'s nav, in its order."""
    found = []
    for line in mkdocs_yml.splitlines():
        match = re.fullmatch(r"\s*- (.+?): (\S+\.md)\s*", line)
        if match:
            found.append((match.group(1), match.group(2)))
    return found


def doc_pages() -> list[dict]:
    """The documentation's pages, ``{"name", "title", "path"}`` each: from the installed
    package's ``docs/`` folder, or in a source checkout from the repository itself (an
    editable install); ``[]`` when neither is there."""
    shipped = importlib.resources.files("muonscale") / "docs"
    if shipped.joinpath(DOCS_INDEX).is_file():
        index = json.loads(shipped.joinpath(DOCS_INDEX).read_text(encoding="utf-8"))
        return [{**p, "path": shipped.joinpath(p["file"])} for p in index]
    root = Path(muonscale.__file__).resolve().parent.parent
    if not (root / "mkdocs.yml").is_file():
        return []
    pages = nav_pages((root / "mkdocs.yml").read_text(encoding="utf-8"))
    return [
        {"name": page_name(title), "title": title, "path": root / path}
        for title, path in pages
        if (root / path).is_file()
    ]


def _docs(args: argparse.Namespace) -> int:
    pages = doc_pages()
    if not pages:
        print("muonscale docs: this installation carries no documentation", file=sys.stderr)
        return 1
    if args.page is None:
        width = max(len(p["name"]) for p in pages)
        print("The documentation (muonscale docs PAGE prints one):\n")
        for p in pages:
            print(f"  {p['name']:<{width}}  {p['title']}")
        return 0
    wanted = page_name(args.page)
    for p in pages:
        if wanted in (p["name"], page_name(Path(str(p["path"])).stem)):
            sys.stdout.write(p["path"].read_text(encoding="utf-8"))
            return 0
    names = ", ".join(p["name"] for p in pages)
    args.command_parser.error(f"no page {args.page!r}; the pages: {names}")


if __name__ == "__main__":
    sys.exit(main())
