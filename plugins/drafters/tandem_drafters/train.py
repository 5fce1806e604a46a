"""Training a block drafter for a target by self-distillation (``tandem train-drafter``).

Two stages, both resumable, under one work folder ``OUT``:

1. **data** (``OUT/data/*.pt``): prompts built offline — source files of the Python standard library and
   installed packages turned into completion, explanation and edit requests, plus chat requests — rendered with
   the target's chat template; the target's own greedy answer is the label. ``batch > 1`` answers that many
   prompts a forward through the runner's batched generator (``batched_of``: ``tandem_llama.batched`` for
   Llama) and stores tokens only; ``batch == 1`` answers one prompt at a time through the serving engine and
   also stores the features (one forward of prompt + answer: the hidden rows at the drafter's layers, the
   runner's taps). Sample ``i`` is always the same prompt (seeded by ``i``), so a restart continues where the
   shards end; ``--workers N`` runs ``N`` processes, each with its own engine. One source file in 16 (by the
   sha1 of its path) is never used: the benchmark's code prompts come from those (``held_out_file``).
2. **train** (``OUT/ckpt/state.pt``, ``OUT/drafter/``): the features of a sample whose shard holds none are
   computed for each step's samples in one batched target forward (``Features``). The drafter learns to
   predict, from the features of the tokens before an anchor and the block ``[token at anchor, mask, ...]``,
   the target's next ``B - 1`` tokens (cross entropy through the target's frozen head, earlier positions
   weighted more). Every
   ``--eval-every`` steps: the held-out loss and the chain acceptance a block would get (``tau``: 1 + the
   leading positions whose argmax is the label); every ``--checkpoint-every`` steps (and at the end, or when
   the time budget is spent) the optimizer state is saved and ``OUT/drafter`` rewritten, so a stopped run
   leaves a loadable drafter and resumes from its last checkpoint.

``OUT/log.jsonl`` holds one line per evaluation and one per stage end; nothing logs prompt or answer text.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem_drafters.block import BlockConfig, BlockModel, default_layers, read_config, save_checkpoint
from tandem_drafters.train_data import (CHAT_TOPICS, DataOptions, _bar, _load, auto_batch, batched_of, generate,
                                        held_out_file, make_request, source_files)

# the data stage's names (tandem_drafters.train_data) are here too: this module is both stages' entry point
__all__ = [
    "CHAT_TOPICS",
    "DataOptions",
    "TrainOptions",
    "auto_batch",
    "batched_of",
    "drafter_shape",
    "generate",
    "held_out_file",
    "load_samples",
    "make_request",
    "source_files",
    "train",
]


# -- training -------------------------------------------------------------------------------------------------


@dataclass
class TrainOptions:
    model: str | None
    weights: str | None
    out: Path
    steps: int = 1000
    lr: float = 6e-4
    warmup: int = 50
    samples_per_step: int = 8
    anchors: int = 16
    checkpoint_every: int = 200
    eval_every: int = 100
    held_out: float = 0.05
    device: str = "cpu"
    dtype: str = "fp32"
    seed: int = 0
    time_budget: float = 0.0
    save_dtype: str = "bf16"
    fresh: bool = False
    gamma: float = 7.0
    bar: bool = True
    eval_samples: int = 256         # held-out samples an evaluation reads at most (the first by index)


def load_samples(out: Path) -> list[dict[str, Any]]:
    """Every sample of the shards, ordered by index."""
    samples = [s for f in sorted((out / "data").glob("*.pt")) for s in torch.load(f, weights_only=False)]
    return sorted(samples, key=lambda s: int(s["i"]))


def is_held_out(i: int, frac: float) -> bool:
    return frac > 0 and int(i) % max(2, round(1 / frac)) == 0


def drafter_shape(hidden: int, layers: int = 2, heads: int = 0, kv_heads: int = 0,
                  intermediate: int = 0) -> dict[str, Any]:
    """A drafter's shape for a target of width ``hidden`` (heads of 64 where it divides, kv heads a third or a
    half of them, the MLP 16/9 of the width)."""
    if not heads:
        heads = hidden // 64 if hidden % 64 == 0 else max(1, hidden // 32 if hidden % 32 == 0 else 1)
    if hidden % heads:
        raise ValueError(f"drafter heads {heads} do not divide the hidden size {hidden}")
    if not kv_heads:
        kv_heads = heads // 3 if heads % 3 == 0 else (heads // 2 if heads % 2 == 0 else heads)
    if not intermediate:
        intermediate = max(64, round(hidden * 16 / 9 / 64) * 64)
    return {"num_layers": layers, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": hidden // heads,
            "intermediate_size": intermediate}


def new_config(served: Any, model_id: str, layers: tuple[int, ...], block_size: int, mask_token: int | None,
               shape: dict[str, Any]) -> BlockConfig:
    caps = served.engine.caps
    H = int(caps.hidden_size)
    V = int(served.tokenizer.vocab_size)
    return BlockConfig(hidden_size=H, vocab_size=V, target_layer_ids=tuple(layers),
                       mask_token_id=V - 1 if mask_token is None else int(mask_token), block_size=block_size,
                       num_target_layers=len(caps.hidden_layers), rope_theta=10000.0, rms_norm_eps=1e-6,
                       target=model_id, tokenizer=served.tokenizer.fingerprint(),
                       extra={"target_vocab_size": V}, **shape)


class _Batch:
    """One sample's blocks: anchors, block ids and positions, the attention mask and the labels."""

    def __init__(self, s: dict[str, Any], anchors: list[int], B: int, mask_id: int, device: torch.device) -> None:
        tok = s["tokens"].long()
        T = tok.numel()
        a = torch.tensor(anchors, dtype=torch.long)
        nb = a.numel()
        pos = a[:, None] + torch.arange(B)[None, :]                                  # [nb, B]
        ids = torch.full((nb, B), mask_id, dtype=torch.long)
        ids[:, 0] = tok[a]
        labels = torch.where(pos < T, tok[pos.clamp(max=T - 1)], torch.full_like(pos, -100))[:, 1:]
        ctx_ok = (torch.arange(T)[None, :] < a[:, None]).repeat_interleave(B, dim=0)  # [nb*B, T]
        blk = torch.arange(nb * B) // B
        self.T, self.nb = T, nb
        self.mask = torch.cat([ctx_ok, blk[:, None] == blk[None, :]], dim=1).to(device)
        self.ids, self.pos = ids.reshape(-1).to(device), pos.reshape(-1).to(device)
        self.labels = labels.to(device)                                              # [nb, B - 1]


class Features:
    """The target's hidden rows at the drafter's layers (the runner's taps, concatenated), for the samples whose
    shard holds none: the batched data stage writes tokens only (a sample's rows are ``len x layers x H``: 20K
    samples of 500 tokens would be ~46 GB in bf16), so the train stage computes them for each step's samples,
    in one batched forward of the target where its runner has a batched generator, else one engine forward a
    sample. Rows are rounded to bf16, as the shards of the batch-1 data stage store them."""

    def __init__(self, engine: Any, layers: Sequence[int]) -> None:
        self.engine, self.layers = engine, tuple(int(x) for x in layers)
        self.gen = batched_of(engine)

    def __call__(self, samples: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [s.get("feats") for s in samples]
        need = [k for k, f in enumerate(out) if f is None]
        if need:
            seqs = [[int(t) for t in samples[k]["tokens"]] for k in need]
            if self.gen is not None:
                rows = self.gen.hidden(seqs, self.layers)
            else:
                eng = self.engine
                eng.tap(self.layers)
                rows = []
                with torch.inference_mode():
                    for seq in seqs:
                        eng.reset()
                        eng.forward(seq)
                        rows.append(torch.cat([eng.hidden_at(li) for li in self.layers], dim=-1))
                    eng.reset()
            for k, r in zip(need, rows):
                out[k] = r.to(torch.bfloat16, copy=True)    # a plain tensor, not an inference one
        return [f for f in out if f is not None]


class Trainer:
    def __init__(self, served: Any, cfg: BlockConfig, o: TrainOptions) -> None:
        self.o, self.cfg = o, cfg
        self.device = torch.device(o.device)
        parts = served.engine.target_parts()
        if parts is None:
            raise ValueError("the target lends no embedding and head (its runner has no parts())")
        self.parts = parts
        self.features = Features(served.engine, cfg.target_layer_ids)
        H = cfg.hidden_size
        with torch.no_grad():
            eye = torch.eye(H, device=parts.device, dtype=parts.dtype)
            head = parts.head(eye).T.contiguous().clone()                            # [V, H]: W = head(I)^T
        self.amp = self.device.type == "cuda"
        self.head_w = head.to(self.device, torch.bfloat16 if self.amp else torch.float32)
        self.model = BlockModel(cfg).to(self.device)
        self._init_weights()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(0.9, 0.95), weight_decay=0.01)
        w = torch.exp(-torch.arange(cfg.block_size - 1, dtype=torch.float32) / o.gamma)
        self.pos_w = (w / w.mean()).to(self.device)
        self.step = 0
        self.elapsed = 0.0
        self.best = math.inf       # the best held-out loss: OUT/drafter holds the weights that reached it

    def _init_weights(self) -> None:
        g = torch.Generator().manual_seed(self.o.seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(1.0 / math.sqrt(2 * self.cfg.num_layers))

    def calibrate(self, engine: Any, samples: Sequence[dict[str, Any]]) -> float:
        """Start the drafter's final norm at the target's own output scale: per dimension, the root mean square of
        the target's rows after its final norm (``hidden_post_norm``) over a few samples. The head then reads
        rows of the size it was trained on; a norm started at 1 against a head fed by a much smaller final norm
        would spend thousands of steps shrinking. Returns the mean scale."""
        acc = None
        n = 0
        with torch.inference_mode():
            for s in samples[:4]:
                engine.reset()
                engine.forward([int(t) for t in s["tokens"]])
                rows = engine.hidden_post_norm().float()
                sq = rows.pow(2).sum(0).cpu()
                acc = sq if acc is None else acc + sq
                n += rows.shape[0]
            engine.reset()
        if acc is None or n == 0:
            return 1.0
        scale = (acc / n).sqrt().clamp(min=1e-3)
        with torch.no_grad():
            self.model.norm.weight.copy_(scale.to(self.model.norm.weight.device))
        return round(float(scale.mean()), 4)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = self.parts.embed(ids.to(self.parts.device)).clone()
        return x.to(self.device, torch.float32) * self.cfg.embed_scale

    def losses(self, s: dict[str, Any], anchors: list[int], feats: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sum of weighted losses, sum of weights, tau per block)`` of one sample's blocks (``feats``: its
        hidden rows, default the shard's or ``Features``')."""
        b = _Batch(s, anchors, self.cfg.block_size, self.cfg.mask_token_id, self.device)
        if feats is None:
            feats = self.features([s])[0]
        feats = feats.to(self.device, torch.float32)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            ctx = self.model.context(feats)
            kv = self.model.context_kv(ctx, torch.arange(b.T, device=self.device))
            h = self.model.blocks(self.embed(b.ids), kv, b.pos, b.mask)
            h = h.view(b.nb, self.cfg.block_size, -1)[:, 1:]
            logits = (h.to(self.head_w.dtype) @ self.head_w.T).float()              # [nb, B - 1, V]
        logits = logits * self.cfg.output_multiplier
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b.labels.reshape(-1), ignore_index=-100,
                             reduction="none").view(b.nb, -1)
        valid = (b.labels != -100).float()
        w = self.pos_w[None, :] * valid
        right = (logits.argmax(-1) == b.labels) & (b.labels != -100)
        tau = 1 + right.long().cumprod(dim=1).sum(dim=1)
        return (ce * w).sum(), w.sum(), tau.float()

    def anchors(self, s: dict[str, Any], rng: random.Random, k: int) -> list[int]:
        T, P = int(s["tokens"].numel()), int(s["prompt_len"])
        cand = list(range(max(P, 1), T - 1))
        return sorted(rng.sample(cand, min(k, len(cand)))) if cand else []

    def lr_at(self, progress: float) -> float:
        o = self.o
        if self.step < o.warmup:
            return o.lr * (self.step + 1) / o.warmup
        return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def evaluate(self, held: Sequence[dict[str, Any]]) -> dict[str, float]:
        rng = random.Random(1234)
        tot = wsum = 0.0
        taus: list[torch.Tensor] = []
        self.model.eval()
        held = list(held)[: max(1, self.o.eval_samples)]
        with torch.no_grad():
            for c in range(0, len(held), 32):
                chunk = held[c:c + 32]
                for s, f in zip(chunk, self.features(chunk)):
                    a = self.anchors(s, rng, self.o.anchors)
                    if not a:
                        continue
                    loss, w, tau = self.losses(s, a, f)
                    tot += float(loss)
                    wsum += float(w)
                    taus.append(tau)
        self.model.train()
        t = torch.cat(taus) if taus else torch.zeros(1)
        return {"held_loss": round(tot / max(wsum, 1e-9), 4), "held_tau": round(float(t.mean()), 3),
                "held_blocks": int(t.numel())}

    # -- checkpoints --------------------------------------------------------------------------------------
    def save_state(self) -> None:
        """The training state (weights, optimizer, step, time, best held-out loss): what a resume starts from."""
        ck = self.o.out / "ckpt"
        ck.mkdir(parents=True, exist_ok=True)
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                 "elapsed": self.elapsed, "best": self.best, "config": self.cfg.to_json(),
                 "rng": torch.get_rng_state()}
        torch.save(state, ck / "state.pt.part")
        os.replace(ck / "state.pt.part", ck / "state.pt")

    def save_drafter(self, extra: dict[str, Any]) -> None:
        """``OUT/drafter``: the weights now, in the published layout, with the training record in the config."""
        cfg = BlockConfig(**{**self.cfg.__dict__, "extra": {**self.cfg.extra, **extra}})
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.o.save_dtype]
        save_checkpoint(self.model, self.o.out / "drafter", dtype=dt, cfg=cfg)

    def resume(self) -> bool:
        path = self.o.out / "ckpt" / "state.pt"
        if self.o.fresh or not path.exists():
            return False
        state = torch.load(path, weights_only=False, map_location=self.device)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.elapsed = int(state["step"]), float(state["elapsed"])
        self.best = float(state.get("best", math.inf))
        return True


def _config_from_state(out: Path) -> BlockConfig | None:
    path = out / "ckpt" / "state.pt"
    if not path.exists():
        return None
    tmp = out / "ckpt" / "config"
    tmp.mkdir(exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(torch.load(path, weights_only=False, map_location="cpu")["config"]))
    return read_config(tmp)


def train(o: TrainOptions, cfg: BlockConfig | None, log: Any = None, served: Any = None) -> dict[str, Any]:
    """Stage 2: train (or resume) to ``o.steps`` steps or the time budget; returns the last record."""
    samples = load_samples(o.out)
    if not samples:
        raise ValueError(f"{o.out / 'data'}: no samples (run the data stage first)")
    held = [s for s in samples if is_held_out(int(s["i"]), o.held_out)]
    train_set = [s for s in samples if not is_held_out(int(s["i"]), o.held_out)] or samples
    if served is None:
        served = _load(o.model, o.weights, o.device, o.dtype, 64)
    if not o.fresh:
        cfg = _config_from_state(o.out) or cfg
    if cfg is None:
        raise ValueError("train: no drafter config (none given and no checkpoint to resume)")
    tr = Trainer(served, cfg, o)
    resumed = tr.resume()
    scale = None if resumed else tr.calibrate(served.engine, train_set)
    rng = random.Random(o.seed * 7919 + tr.step)
    t_start = time.monotonic()
    elapsed_before = tr.elapsed
    horizon = elapsed_before + o.time_budget if o.time_budget > 0 else 0.0
    tokens = sum(int(s["tokens"].numel()) for s in train_set)
    base = {"samples": len(samples), "train_samples": len(train_set), "held_samples": len(held),
            "train_tokens": tokens}
    if log is not None:
        log({"stage": "train-start", "step": tr.step, "resumed": resumed, "norm_scale": scale, **base})
    bar = _bar(max(0, o.steps - tr.step), "train", o.bar and sys.stderr.isatty())
    rec: dict[str, Any] = {}
    stop = False
    while tr.step < o.steps and not stop:
        now = elapsed_before + time.monotonic() - t_start
        progress = max(tr.step / max(o.steps, 1), now / horizon if horizon else 0.0)
        for group in tr.opt.param_groups:
            group["lr"] = tr.lr_at(progress)
        tr.opt.zero_grad(set_to_none=True)
        tot = torch.zeros((), device=tr.device)
        wsum = torch.zeros((), device=tr.device)
        chosen = rng.sample(train_set, min(o.samples_per_step, len(train_set)))
        for s, f in zip(chosen, tr.features(chosen)):
            a = tr.anchors(s, rng, o.anchors)
            if a:
                loss, w, _ = tr.losses(s, a, f)
                tot = tot + loss
                wsum = wsum + w
        loss = tot / wsum.clamp(min=1e-9)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.model.parameters(), 1.0)
        tr.opt.step()
        tr.step += 1
        bar.update(1)
        tr.elapsed = elapsed_before + time.monotonic() - t_start
        stop = bool(horizon) and tr.elapsed >= horizon
        last = tr.step >= o.steps or stop
        if tr.step % o.eval_every == 0 or last:
            rec = {"stage": "eval", "step": tr.step, "loss": round(float(loss.detach()), 4),
                   "lr": round(tr.lr_at(progress), 7), "seconds": round(tr.elapsed, 1),
                   **tr.evaluate(held or train_set[:8])}
            if rec["held_loss"] < tr.best:      # keep the drafter that does best on the held-out samples
                tr.best = rec["held_loss"]
                rec["kept"] = True
                tr.save_drafter({"trained_steps": tr.step, "train_seconds": round(tr.elapsed, 1), **base,
                                 **{k: v for k, v in rec.items() if k.startswith("held_")}})
            if log is not None:
                log(rec)
        if tr.step % o.checkpoint_every == 0 or last:
            tr.save_state()
    bar.close()
    if not (o.out / "drafter" / "config.json").exists():   # resumed at the end with no drafter written
        rec = {"stage": "eval", "step": tr.step, "seconds": round(tr.elapsed, 1), **tr.evaluate(held or train_set[:8])}
        tr.save_drafter({"trained_steps": tr.step, "train_seconds": round(tr.elapsed, 1), **base,
                         **{k: v for k, v in rec.items() if k.startswith("held_")}})
        tr.save_state()
    kept = read_config(o.out / "drafter").extra
    end = {"stage": "train-end", "step": tr.step, "seconds": round(tr.elapsed, 1), **base,
           "drafter_step": kept.get("trained_steps"), "held_loss": kept.get("held_loss"),
           "held_tau": kept.get("held_tau")}
    if log is not None:
        log(end)
    return end


def jsonl_logger(path: Path) -> Any:
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(rec: dict[str, Any]) -> None:
        rec = {"time": round(time.time(), 1), **rec}
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(" ".join(f"{k}={v}" for k, v in rec.items() if k != "time"), file=sys.stderr, flush=True)

    return log


def iter_log(path: Path) -> Iterator[dict[str, Any]]:
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def pick_layers(num_layers: int, count: int, explicit: Sequence[int] = ()) -> tuple[int, ...]:
    return tuple(explicit) if explicit else default_layers(num_layers, count)
