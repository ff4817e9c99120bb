"""CTP, from "CTP: Towards Vision-Language Continual Pretraining via Compatible Momentum Contrast and
Topology Preservation" (Zhu et al., ICCV 2023, arXiv:2308.07146), adapted from its ALBEF-style model to
CLIP (no MLM terms; a fixed τ in its own terms):

- a compatible momentum model M, reset to θ(t-1) at each task start and updated every step before its
  forward pass, θc ← m·θc + (1−m)/2·θ(t−1) + (1−m)/2·θt (on the first task, with no θ(t−1), a plain
  EMA with m = first_task_momentum);
- L_cmc: each local feature contrasted against M's features of the gathered batch followed by a FIFO
  queue of K earlier M features per modality (the queue outlives tasks), less the queued features of the
  batch's own pairs (below);
- from the second task, topology preservation against the frozen θ(t−1): L_c on the cross-modal
  similarity rows, L_s on the intra-modal ones with the diagonal filled with −1000 before /τ.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from clipstream.training.losses import fill_positives, gather, positive_columns, row_kl
from clipstream.training.methods.base import Method, forward_features, frozen, gathered


class Queue:
    """A FIFO of the last `size` feature rows (a ring buffer) and the pair each row is of, as its caption's token ids
    (`key_len` of them: the batches carry no pair ids, and a pair's caption is the same whenever it comes round);
    starts as random unit vectors, as MoCo's, of no pair (keys −1, which no token id is)."""

    def __init__(self, size: int, dim: int, device, seed: int = 0, key_len: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.rows = F.normalize(torch.randn(size, dim, generator=g), dim=-1).to(device)
        self.keys = torch.full((size, key_len), -1, dtype=torch.long, device=device)
        self.ptr = 0

    def push(self, x: torch.Tensor, keys: torch.Tensor) -> None:
        x, keys = x.detach()[-len(self.rows):].to(self.rows), keys[-len(self.rows):].to(self.keys)
        idx = ((self.ptr + torch.arange(len(x))) % len(self.rows)).to(self.rows.device)
        self.rows[idx], self.keys[idx] = x, keys
        self.ptr = int((self.ptr + len(x)) % len(self.rows))

    def holding(self, keys: torch.Tensor) -> torch.Tensor:
        """[size] bool: the rows of one of the pairs `keys` (token rows), by exact equality."""
        _, ids = torch.unique(torch.cat([keys.to(self.keys), self.keys]), dim=0, return_inverse=True)
        return torch.isin(ids[len(keys):], ids[:len(keys)])

    def ordered(self) -> torch.Tensor:
        """Oldest first."""
        return torch.roll(self.rows, -self.ptr, dims=0)


def cmc_loss(img, txt, m_img, m_txt, q_img, q_txt, tau: float, stale=None):
    """L_ita^c: each local feature against [M's gathered batch ; queue] of the other modality, positive at
    its global column; `stale` ([K] bool): queue rows left out of the contrast set. Returns the loss and M's
    gathered features (for the queue)."""
    with torch.no_grad():
        m_img, m_txt = gather(m_img), gather(m_txt)
    own = positive_columns(img.shape[0], img.device)

    def logits(x, batch, queue):
        scores = x @ torch.cat([batch, queue]).T / tau
        if stale is None:
            return scores
        return scores.masked_fill(F.pad(stale, (len(batch), 0))[None], float("-inf"))  # (a softmax weight of 0)

    loss = (F.cross_entropy(logits(img, m_txt, q_txt), own) + F.cross_entropy(logits(txt, m_img, q_img), own)) / 2
    return loss, (m_img, m_txt)


def topology_losses(img, txt, r_img, r_txt, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_c, L_s) against the frozen θ(t-1)'s features r_*: KL(teacher || student) of the similarity rows
    (local rows, gathered columns); L_s on intra-modal rows with the diagonal at −1000 before /τ."""
    with torch.no_grad():
        r_all = {"img": gather(r_img), "txt": gather(r_txt)}
    s_all = {"img": gather(img), "txt": gather(txt)}
    cross = (row_kl(r_img @ r_all["txt"].T / tau, img @ s_all["txt"].T / tau).mean()
             + row_kl(r_txt @ r_all["img"].T / tau, txt @ s_all["img"].T / tau).mean()) / 2

    def own_suppressed(rows, cols):
        return fill_positives(rows @ cols.T, -1000.0) / tau

    intra = (row_kl(own_suppressed(r_img, r_all["img"]), own_suppressed(img, s_all["img"])).mean()
             + row_kl(own_suppressed(r_txt, r_all["txt"]), own_suppressed(txt, s_all["txt"])).mean()) / 2
    return cross, intra


class CTP(Method):
    name = "ctp"
    needs_teacher = True

    def __init__(self, params: dict):
        super().__init__(params)
        self.momentum_model = None
        self._start = None  # M's module, made by `prepare_model`
        self.queues: dict[str, Queue] = {}
        self._saved: dict = {}

    def prepare_model(self, model):
        # M's module: a copy made before the engine takes the model (ZeRO-3 then holds only partitions), in fp32
        # whatever the engine's precision (the small steps of an EMA vanish in bf16)
        self._start = frozen(copy.deepcopy(model).float())
        return model

    def before_task(self, ctx):
        """M = θ(t-1): the live weights as the task starts."""
        live = dict(ctx.model.named_parameters())
        with torch.no_grad(), gathered(live.values()):
            for name, p in self._start.named_parameters():
                p.copy_(live[name])
        self.momentum_model = self._start.to(ctx.device)
        self._saved.pop("momentum", None)

    def update_momentum(self, ctx) -> None:
        """One step of θc ← m·θc + (1−m)/2·θ(t−1) + (1−m)/2·θt (plain EMA without a teacher), as three
        ops over all tensors at once, as timm's EMA does, rather than three per tensor."""
        names = [n for n, _ in self.momentum_model.named_parameters()]
        mine = [p for _, p in self.momentum_model.named_parameters()]
        live = dict(ctx.model.named_parameters())
        m = self.params["momentum"] if ctx.teacher is not None else self.params["first_task_momentum"]
        with torch.no_grad(), gathered(live.values()):
            torch._foreach_mul_(mine, m)
            if ctx.teacher is None:
                torch._foreach_add_(mine, [live[n].float() for n in names], alpha=1 - m)
            else:
                old = dict(ctx.teacher.named_parameters())
                torch._foreach_add_(mine, [live[n].float() for n in names], alpha=(1 - m) / 2)
                torch._foreach_add_(mine, [old[n].float() for n in names], alpha=(1 - m) / 2)

    def loss_terms(self, ctx, batch, feats):
        if self.momentum_model is None:  # resumed mid-task: M comes back from the checkpointed state
            self.momentum_model = self._start.to(ctx.device)
            self.momentum_model.load_state_dict(self._saved.pop("momentum"))
        with record_function("momentum update"):
            self.update_momentum(ctx)  # every step, before M's forward
        # M's weights stay fp32 (an EMA's (1−m)-sized steps vanish in bf16), its forward runs at the live model's
        # precision, as the teacher's and the live forwards do: in fp32 its GEMMs were half of CTP's device time (GPU)
        dtype = next(ctx.model.parameters()).dtype
        with torch.no_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype != torch.float32), \
                record_function("momentum forward"):
            m = forward_features(self.momentum_model, batch["image"], batch["text"])
        q_img, q_txt = self._queue("image", feats, batch), self._queue("text", feats, batch)
        tau = self.params["tau"]
        # CTP's queue holds other pairs only: K = 1024 is 2 global batches, and a P9D task's 38k-236k pairs come
        # round once an epoch, 74-461 steps apart. A task smaller than the queue (here: K = 256 against tasks of
        # ~150 pairs) would contrast each pair with its own earlier momentum features, false negatives that its
        # code never meets: the queued rows of the batch's pairs are left out, which at CTP's sizes leaves out only
        # another pair with the very same caption, a text the model cannot tell from the positive's either.
        # (Both queues hold the same pairs: they are pushed together.)
        with torch.no_grad():
            pairs = gather(batch["text"])
        stale = q_txt.holding(pairs)
        cmc, (m_img, m_txt) = cmc_loss(feats.image, feats.text, m.image, m.text, q_img.rows, q_txt.rows, tau, stale)
        terms = {"cmc": self.params["cmc_weight"] * cmc}
        if ctx.teacher is not None:
            r = ctx.teacher_features(batch)
            l_c, l_s = topology_losses(feats.image, feats.text, r.image, r.text, tau)
            terms.update(topology_c=self.params["topology_weight"] * l_c, topology_s=self.params["topology_weight"] * l_s)
        q_img.push(m_img, pairs)  # after use: this step contrasted against the queue as it was
        q_txt.push(m_txt, pairs)
        return terms

    def _queue(self, modality: str, feats, batch) -> Queue:
        if modality not in self.queues:
            saved = self._saved.pop(f"queue_{modality}", None)
            queue = Queue(self.params["queue_size"], feats.image.shape[1], feats.image.device,
                          seed=self.params.get("seed", 0) + (modality == "text"), key_len=batch["text"].shape[1])
            if saved is not None:  # (a state saved without keys: its rows count as other pairs')
                queue.rows, queue.ptr = saved["rows"].to(feats.image.device), saved["ptr"]
                if "keys" in saved:
                    queue.keys = saved["keys"].to(feats.image.device)
            self.queues[modality] = queue
        return self.queues[modality]

    def state_dict(self):
        state = {f"queue_{k}": {"rows": q.rows.cpu(), "keys": q.keys.cpu(), "ptr": q.ptr}
                 for k, q in self.queues.items()}
        if self.momentum_model is not None:
            state["momentum"] = {k: v.detach().cpu() for k, v in self.momentum_model.state_dict().items()}
        return {**self._saved, **state}

    def load_state_dict(self, state):
        self._saved, self.queues = dict(state), {}
