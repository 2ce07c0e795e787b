"""``batchspec train-draft``: train a draft for a target from a prompt set, on CPU (a head also on a GPU): a
feature-reading head (``--kind head``, the default) or a small draft model (``--kind model``), written to a folder
``batchspec.LLM(target, draft=OUT)`` loads. The work is done by ``batchspec.training``; this module reads the flags and
checks them, the target, the prompts and the folders before any model loads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import DEFAULT_TARGET, non_negative_int, positive_int, prepare_out

HELP = "train a draft (feature-reading head or small draft model) for a target"
DESCRIPTION = """Train a draft for a target on CPU (a head also on a GPU: --device cuda): a feature-reading head
(--kind head, the default) or a small draft model (--kind model), written to a folder that
batchspec.LLM(target, draft=OUT) loads.

Stages (--stages, run in this order, each reading the previous one's output from --work):
  gen     the target answers the prompts greedily; kept in chunks, so an interrupted gen resumes
  train   writes --save; its state is kept at checkpoints, so an interrupted train resumes
  export  writes the draft folder --out
Training in several steps with different settings is several invocations of --stages train, each continuing from
the last one's --save with --init. Rerunning the same command resumes from what --work holds."""

STAGES = ("gen", "train", "export")
# targets a head can be built for, and a draft model trained from (its --model-init layers: Llama only)
ARCHITECTURES = ("llama", "qwen2", "qwen3")

# flags whose default depends on --kind
KIND_DEFAULTS = {
    "head": {"num_prompts": 4000, "epochs": 4, "batch_tokens": 4096, "lr": 1e-3, "log_every": 25},
    "model": {"num_prompts": 1300, "epochs": 6, "batch_tokens": 2048, "lr": 2e-3, "log_every": 20},
}
# flags of one kind only, with their defaults
KIND_FLAGS = {
    "head": {"chunks": None, "data": None, "vocab": 8192, "copy_layer": -1, "random_layer": False, "depth": 1,
             "init": None, "follow": False, "noise": 0.2, "weight_decay": 0.1, "reg": 1.0, "soft": 0.1, "clip": 1.0,
             "eval_every": 200, "device": "cpu", "gen_seconds": None},
    "model": {"topk": 16, "heldout": True, "hidden": 162, "layers": 2, "heads": 9, "intermediate": 768,
              "model_init": "layers", "from_layers": "0,1", "emb_lr_scale": 0.3, "negatives": 4096},
}


def add_arguments(p) -> None:
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--kind", choices=["head", "model"], default="head",
                   help="head: a feature-reading head (EAGLE-style, reads the target's hidden states); model: a small "
                        "independent draft model (default head)")
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: path, model id or built-in name (default "
                   f"{DEFAULT_TARGET}); Llama, Qwen2 or Qwen3 architecture")
    p.add_argument("--work", required=True, help="work folder: generated data, checkpoints, resume state")
    p.add_argument("--out", default=None, help="export: the draft folder (default WORK/draft); a README.md in it is "
                   "kept")
    p.add_argument("--stages", default=",".join(STAGES), help="comma list of gen, train, export (default all three)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", default=None, help="head: where gen and train run, e.g. cuda (default cpu); the "
                   "exported head runs anywhere")
    g = p.add_argument_group("gen")
    g.add_argument("--prompts", default="templates",
                   help="templates: the generated training set (13 Spec-Bench-like categories); broad: any topic "
                        "under any request (texts from --passages); or a prompt file, JSONL (turns[0]) or plain text, "
                        "one prompt a line (default templates)")
    g.add_argument("--passages", nargs="*", default=[], help="with --prompts broad: head gen folders whose answers "
                   "become the texts of the prompts that quote one")
    g.add_argument("--num-prompts", type=positive_int, default=None,
                   help="prompts to generate (default: head 4000, model 1300; a prompt file: all of it)")
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--batch", type=positive_int, default=64, help="generation batch size (default 64)")
    g.add_argument("--chunk", type=positive_int, default=250, help="prompts per chunk file (default 250; model: a "
                   "prompt file's group)")
    g.add_argument("--chunks", type=positive_int, default=None,
                   help="head: stop after the first N chunks (default all)")
    g.add_argument("--gen-seconds", type=float, default=None,
                   help="head: start no chunk after this many seconds of gen (the first always runs; a later run "
                        "resumes with the rest); for a machine lent for a fixed time (default no limit)")
    g.add_argument("--topk", type=positive_int, default=None, help="model: top-k log-probs kept per answer token (16)")
    g.add_argument("--heldout", action=argparse.BooleanOptionalAction, default=None,
                   help="model: also answer the built-in prompts, for held-out agreement only (default on)")
    t = p.add_argument_group("train")
    t.add_argument("--save", default=None, help="the trained checkpoint (default: head WORK/head.pt, model WORK/model)")
    t.add_argument("--data", nargs="+", default=None, help="head: gen folders to train on, in order (default WORK)")
    t.add_argument("--init", default=None, help="head: a checkpoint (--save of an earlier run) to continue from; its "
                   "token map is kept")
    t.add_argument("--epochs", type=positive_int, default=None, help="default: head 4, model 6")
    t.add_argument("--max-steps", type=non_negative_int, default=None,
                   help="steps in all (default: --epochs over the data)")
    t.add_argument("--batch-tokens", type=positive_int, default=None, help="padded tokens per batch (head 4096, "
                   "model 2048)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (head 1e-3, model 2e-3)")
    t.add_argument("--hard", type=float, default=0.5, help="weight of the cross-entropy on the target's tokens (0.5)")
    t.add_argument("--log-every", type=positive_int, default=None, help="steps between log lines (head 25, model 20)")
    t.add_argument("--vocab", type=positive_int, default=None, help="head: tokens the head scores, the target's most "
                   "frequent answer tokens (8192)")
    t.add_argument("--copy-layer", type=int, default=None, help="head: the target layer that initialises the head's "
                   "layer (-1, Llama targets)")
    t.add_argument("--random-layer", action="store_true", default=None, help="head: random initialisation instead")
    t.add_argument("--depth", type=positive_int, default=None,
                   help="head: drafting steps trained at every position (training-time test: steps after the first "
                        "read the head's own predicted features) (1)")
    t.add_argument("--follow", action="store_true", default=None,
                   help="head: add chunks written by a running gen stage each epoch")
    t.add_argument("--noise", type=float, default=None, help="head: uniform noise added to input features, +- (0.2)")
    t.add_argument("--weight-decay", type=float, default=None, help="head: AdamW weight decay (0.1)")
    t.add_argument("--reg", type=float, default=None, help="head: weight of the feature regression, smooth L1 (1.0)")
    t.add_argument("--soft", type=float, default=None, help="head: weight of the soft cross-entropy on the target's "
                   "scores (0.1)")
    t.add_argument("--clip", type=float, default=None, help="head: gradient norm clipping (1.0)")
    t.add_argument("--eval-every", type=positive_int, default=None,
                   help="head: steps between held-out evaluations and checkpoints (200)")
    t.add_argument("--hidden", type=positive_int, default=None, help="model: hidden size (162)")
    t.add_argument("--layers", type=positive_int, default=None, help="model: layers of a random-init draft (2)")
    t.add_argument("--heads", type=positive_int, default=None, help="model: attention heads of a random-init draft (9)")
    t.add_argument("--intermediate", type=positive_int, default=None, help="model: MLP size (768)")
    t.add_argument("--model-init", choices=["layers", "data", "svd"], default=None,
                   help="model: layers (default): the target's --from-layers compressed to --hidden; data / svd: "
                        "random layers, embedding from a data-weighted / plain top-SVD projection of the target's head")
    t.add_argument("--from-layers", default=None, help="model: the target layers a 'layers' draft starts from (0,1)")
    t.add_argument("--emb-lr-scale", type=float, default=None, help="model: the embedding's learning rate factor "
                   "(0.3)")
    t.add_argument("--negatives", type=non_negative_int, default=None,
                   help="model: sampled softmax negatives per step, 0: full softmax (4096)")


def settings(args) -> argparse.Namespace:
    """The flags with the defaults of ``--kind`` filled in (``--num-prompts``: none for a prompt file, which is read
    whole); a flag of the other kind is an error. Plain values only: the checkpoint's card records them."""
    other = "model" if args.kind == "head" else "head"
    given = [k for k, v in vars(args).items() if k in KIND_FLAGS[other] and v is not None]
    if given:
        names = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{names} appl{'y' if len(given) > 1 else 'ies'} to --kind {other}, not --kind {args.kind}")
    s = {k: v for k, v in vars(args).items() if k not in ("func", *KIND_FLAGS[other])}
    for k, v in {**KIND_DEFAULTS[args.kind], **KIND_FLAGS[args.kind]}.items():
        if s.get(k) is None and not (k == "num_prompts" and args.prompts not in ("templates", "broad")):
            s[k] = v
    if args.max_steps is not None and args.max_steps < 0:
        raise ValueError(f"--max-steps must be >= 0, got {args.max_steps}")
    stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    bad = [x for x in stages if x not in STAGES]
    if bad or not stages:
        raise ValueError(f"--stages {args.stages!r}: give a comma list of {', '.join(STAGES)}")
    s["stages"] = [x for x in STAGES if x in stages]
    work = Path(args.work).expanduser()
    s["save"] = args.save or str(work / ("head.pt" if args.kind == "head" else "model"))
    s["out"] = args.out or str(work / "draft")
    if args.kind == "head":
        s["data"] = args.data or [args.work]
        s["device"] = check_device(s["device"])
    return argparse.Namespace(**s)


def check_device(name: str) -> str:
    """``--device`` as torch names it, refused where this machine has no such device."""
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r}: {e}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"--device {name}: no such CUDA device here")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: give cpu or cuda[:N]")
    return str(dev)


def check_target(path: str, s) -> None:
    """Refuse a target whose architecture the chosen draft cannot be built for, or flags that do not fit it."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the target's config from {path}: {e}") from None
    kind = "a feature-reading head" if s.kind == "head" else "a draft model"
    if cfg.model_type not in ARCHITECTURES:
        raise ValueError(f"cannot train {kind} for a {cfg.model_type!r} target: supported architectures are "
                         f"{', '.join(ARCHITECTURES)}")
    layers = cfg.num_hidden_layers
    if s.kind == "head" and not s.random_layer and not -layers <= s.copy_layer < layers:
        raise ValueError(f"--copy-layer {s.copy_layer}: the target has {layers} layers")
    if s.kind == "model":
        if s.model_init == "layers":
            if cfg.model_type != "llama":
                raise ValueError(f"--model-init layers copies a Llama target's layers; for a {cfg.model_type!r} "
                                 "target use --model-init data or svd")
            try:
                chosen = [int(x) for x in s.from_layers.split(",")]
            except ValueError:
                chosen = [layers]
            if not chosen or not all(0 <= i < layers for i in chosen):
                raise ValueError(f"--from-layers {s.from_layers!r}: give a comma list of layer indices below {layers}")
            if s.intermediate > cfg.intermediate_size:
                raise ValueError(f"--intermediate {s.intermediate} exceeds the target's MLP size "
                                 f"{cfg.intermediate_size}")
        if s.hidden > cfg.hidden_size:
            raise ValueError(f"--hidden {s.hidden} exceeds the target's hidden size {cfg.hidden_size}")


def check_work(path: str) -> Path:
    return prepare_out(path, folder=True, flag="--work")


def check_out(path: str) -> Path:
    """``--out`` usable before any work: a new or empty folder, or an earlier export (its files are replaced)."""
    from ..drafters.eagle import is_checkpoint

    out = prepare_out(path, folder=True)
    rest = [p.name for p in out.iterdir() if p.name != "README.md"]
    if rest and not (is_checkpoint(out) or (out / "config.json").is_file()):
        raise ValueError(f"--out {path} holds files that are not a draft ({', '.join(sorted(rest)[:3])}); give a new "
                         "or empty folder")
    return out


def run(args) -> int:
    s = settings(args)
    from ..model.loading import load_tokenizer, resolve

    work = check_work(s.work)
    path = resolve(s.target, "target")
    check_target(path, s)
    tokenizer = load_tokenizer(s.target)
    if tokenizer is None:
        raise ValueError(f"the target {s.target!r} has no tokenizer (needed for the prompts and the draft folder); "
                         "give a model directory with one")
    out = check_out(s.out) if "export" in s.stages else None
    pairs = None
    if "gen" in s.stages:
        pairs = gen_prompts(s, tokenizer)
    if "train" in s.stages:
        check_train_input(s)
    if "export" in s.stages and "train" not in s.stages:
        save = Path(s.save)
        if not (save.is_file() if s.kind == "head" else (save / "config.json").is_file()):
            raise ValueError(f"no trained {s.kind} at {save}: run --stages train first (or give --save)")
    try:
        if s.kind == "head":
            from ..training import data, head

            if pairs is not None:
                data.generate_chunks(s.target, pairs, work, s.chunk, s.chunks, s.max_new_tokens, s.batch, s.seed,
                                     device=s.device, seconds=s.gen_seconds)
            if "train" in s.stages:
                head.train_head(s)
            if out is not None:
                head.export_head(s.target, Path(s.save), out, tokenizer)
        else:
            from ..training import draft_model

            if pairs is not None:
                draft_model.gen_records(s, pairs)
            if "train" in s.stages:
                draft_model.train_model(s)
            if out is not None:
                draft_model.export_model(Path(s.save), out, tokenizer)
    except KeyboardInterrupt:
        print("batchspec train-draft: interrupted; the same command resumes from what --work holds", file=sys.stderr)
        return 130
    return 0


def gen_prompts(s, tokenizer) -> list[tuple]:
    """The gen stage's prompts, checked (and the work folder's record of what its data was made from) before any
    model loads."""
    from ..training.data import check_settings, prompt_pairs

    source = s.prompts
    if source not in ("templates", "broad"):
        source = str(Path(source).expanduser().resolve())
        if not Path(source).is_file():
            raise FileNotFoundError(f"prompt file {s.prompts} does not exist; give a JSONL (turns[0]) or text file, "
                                    "or --prompts templates / broad")
    elif source == "broad" and not s.passages:
        raise ValueError("--prompts broad quotes earlier answers: give --passages with head gen folders")
    pairs = prompt_pairs(source, s.num_prompts, s.seed, tokenizer, s.passages)
    check_settings(Path(s.work), {"kind": s.kind, "target": s.target, "prompts": s.prompts, "passages": s.passages,
                                  "num_prompts": s.num_prompts, "seed": s.seed, "max_new_tokens": s.max_new_tokens,
                                  "chunk": s.chunk, **({"topk": s.topk} if s.kind == "model" else {})})
    return pairs


def check_train_input(s) -> None:
    """The train stage's input is there: gen data (unless gen runs first) and the checkpoint of ``--init``."""
    if s.kind == "head":
        if s.init is not None and not Path(s.init).is_file():
            raise FileNotFoundError(f"--init {s.init} does not exist; give the --save of an earlier train run")
        if "gen" not in s.stages:
            from ..training.data import chunk_files

            if not chunk_files([Path(d) for d in s.data]):
                raise ValueError(f"no gen chunks in {', '.join(s.data)}: run --stages gen first (or give --data)")
    elif "gen" not in s.stages and not any(Path(s.work).glob("records*.pt")):
        raise ValueError(f"no gen records in {s.work}: run --stages gen first")

