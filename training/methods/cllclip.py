"""CLL-CLIP: a new language per task, learnt by the token embeddings alone, with TEIR (Yang et al., AAAI 2024,
arXiv:2401.17186; ../shared/methods/cll-clip.md).

Before each task the driver grows the model (`prepare_version`): the tokenizer gains the new language's
subwords (`vocabulary.grow`: append-only, earlier languages tokenise as before), the token-embedding table
gains rows (TEIR: drawn from the old table's mean/std; baseline: N(0, 0.02²)), and the text tower pools at the
end-of-text token's position (`pool_type: eos`: new ids exceed its id, so open_clip's argmax pooling would pick
the wrong token). The grown folder is a stock open_clip export whose tokenizer open_clip loads itself.

While training only the token embeddings and the temperature move; the image tower, the text transformer, the
positional embedding and the projection stay frozen. The loss is `cross_modal_weight`·L_cm (the engine's CLIP
loss: the student's text against the frozen image tower, i.e. the teacher's image features) plus
`cross_lingual_weight`·MSE(r^F, r^E), r^E the teacher's feature of the English caption (`caption_en`, else the
caption) in the teacher's tokens. The teacher is the version the language stream began from, pinned in the
state for every later task. `cross_lingual_weight: 0` switches L_cl off (no term, no teacher pass): the paper's
cross-modal-only objective (Fig. 4, right).

TEIR's regularisation (`teir_scale`): each row's gradient is scaled by λ before the optimizer sees it (λ = 1/freq
for tokens present in this task's captions, 0 for the others and the special tokens) and its decoupled weight
decay by the same λ, so rows of absent languages stay bit-identical. Without it λ ≡ 1: every row decays, as
stock AdamW would (the paper's baseline; `weight_decay: 0` switches the decay off, rows then move only where the
task's captions use them). The decay is applied to the fp32 weights after each step, which DeepSpeed's ZeRO 1-3 and
mixed precision would overwrite from their own master copy: the method runs on ZeRO 0 in fp32 only (the table
is small) and `methods.resolve` refuses anything else in one line (schema.TRAIN_REQUIRES).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from clipstream import models
from clipstream.training.data.task import Task
from clipstream.training.methods import vocabulary
from clipstream.training.methods.base import Method

TRAINED = ("token_embedding.weight", "logit_scale")  # everything else is frozen
HF_TOKENIZER = "clipstream-vocabulary"  # any non-empty name: open_clip then loads the folder's own HF tokenizer


class CllClip(Method):
    name = "cllclip"
    needs_teacher = True
    teacher_text = True  # batches carry `text_en`: the English caption in the teacher's tokens
    needs_trained_start = True
    trains_towers = ("text",)

    def __init__(self, params: dict):
        super().__init__(params)
        self.clip_weight = float(params["cross_modal_weight"])
        self.state: dict[str, Any] = {}
        self._lam: Optional[torch.Tensor] = None  # λ as a [V, 1] column on the training device

    # -- the driver: grow the vocabulary and the table before the job ------------------------------------
    def prepare_version(self, source: Optional[str], parent: Optional[str], config: dict, current: dict,
                        history: list[dict], workdir: Path) -> Optional[Path]:
        train = config["train"]  # (ZeRO 0 in fp32: `methods.resolve` refuses the rest, schema.TRAIN_REQUIRES)
        if source is None:
            raise ValueError(f"{config.get('preset', self.name)} teaches a trained CLIP new languages: start it from a registered version "
                             "(--parent) or a pretrained model (model.pretrained), not from random weights")
        p = self.params
        bundle = models.create(config["model"]["arch"], source)
        tokenizer = _hf_tokenizer(bundle)
        task = Task.load(current["path"])
        captions = [str(r["caption"]) for r in task.check("train").rows]
        if not self.state:  # the language stream begins here: its teacher and token counts start now
            earlier = [[str(r["caption"]) for r in Task.load(e["path"]).check("train").rows] for e in history]
            freq = torch.ones(len(tokenizer.get_vocab()))
            freq[:len(vocabulary.clip_tokenizer(bundle.model.context_length).get_vocab())] += 1  # CLIP's rows: c starts at 1
            for texts in earlier:
                freq[_present(tokenizer, texts, len(freq))] += 1
            self.state = {"teacher": {"version": parent} if parent else {"source": source}, "freq": freq,
                          "words": sorted(set().union(*[vocabulary.words(tokenizer, t) for t in earlier])),
                          "languages": [], "tokenizer_version": 0}
        growth = vocabulary.grow(tokenizer, captions, p["vocab_size"], protected=self.state["words"])
        generator = torch.Generator().manual_seed(int(train["seed"]) + len(self.state["languages"]))
        weight = vocabulary.grow_embedding(bundle.model.token_embedding.weight, len(growth.added), p["teir_init"], generator)
        freq = torch.cat([self.state["freq"], torch.ones(len(growth.added))])
        present = torch.zeros(len(freq), dtype=torch.bool)
        present[_present(growth.tokenizer, captions, len(freq))] = True
        lam = (vocabulary.row_scale(present, freq, growth.tokenizer.all_special_ids) if p["teir_scale"]
               else torch.ones(len(freq)))
        self.state.update(
            freq=freq + present.float(),  # as it stands after this task: present tokens count it once
            lam=lam, words=sorted(set(self.state["words"]) | vocabulary.words(growth.tokenizer, captions)),
            languages=[*self.state["languages"], str(task.meta.get("lang") or task.name)],
            tokenizer_version=self.state["tokenizer_version"] + 1,
            added=len(growth.added), refused=len(growth.refused))
        return _export_grown(bundle, growth.tokenizer, weight, workdir / "grown")

    def teacher(self) -> Optional[dict]:
        return self.state.get("teacher")

    # -- the workers -----------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        for name, param in model.named_parameters():
            param.requires_grad_(name in TRAINED)
        # λ scales the table's gradient before DeepSpeed reduces it and before AdamW's moments see it
        model.token_embedding.weight.register_hook(lambda grad: grad * self._scale(grad))
        return model

    def _scale(self, like: torch.Tensor) -> torch.Tensor:
        if self._lam is None or self._lam.device != like.device:
            self._lam = self.state["lam"].to(device=like.device, dtype=like.dtype)[:, None]
        return self._lam

    def loss_terms(self, ctx, batch, feats):
        if not self.params["cross_lingual_weight"]:
            return {}
        with torch.no_grad():
            english = ctx.teacher.encode_text(batch["text_en"])  # r^E: unnormalised, projected
        return {"cross_lingual": self.params["cross_lingual_weight"] * F.mse_loss(feats.text_raw, english)}

    def after_step(self, ctx):
        """Decoupled weight decay of each row scaled by its λ (AdamW's own decay is off for embeddings)."""
        weight = ctx.model.token_embedding.weight
        with torch.no_grad():
            weight.mul_(1 - ctx.lr * self.params["weight_decay"] * self._scale(weight))

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state, self._lam = dict(state), None


def _hf_tokenizer(bundle: models.ClipBundle):
    """The version's tokenizer as a HF fast tokenizer: its own if it grew before, else open_clip's CLIP BPE."""
    inner = getattr(bundle.tokenizer, "tokenizer", None)  # open_clip's HFTokenizer wraps one
    if inner is not None and hasattr(inner, "train_new_from_iterator"):
        return inner
    return vocabulary.clip_tokenizer(bundle.model.context_length)


def _present(tokenizer, texts: list[str], rows: int) -> torch.Tensor:
    """The ids that `texts` tokenise to (special tokens excluded)."""
    ids = {i for seq in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in seq}
    return torch.tensor(sorted(i for i in ids if i < rows), dtype=torch.long)


def _export_grown(bundle: models.ClipBundle, tokenizer, weight: torch.Tensor, folder: Path) -> Path:
    """`bundle` with the grown table and tokenizer, pooling at the end-of-text position, as a stock open_clip
    folder (open_clip reads the tokenizer from it: `text_cfg.hf_tokenizer_name` is set)."""
    model = bundle.model
    eos = tokenizer.convert_tokens_to_ids(vocabulary.EOT)
    model.token_embedding = torch.nn.Embedding.from_pretrained(weight, freeze=False)
    model.vocab_size, model.text_pool_type, model.text_eos_id = weight.shape[0], "eos", eos
    cfg = copy.deepcopy(bundle.model_cfg)
    cfg["text_cfg"].update(vocab_size=weight.shape[0], hf_tokenizer_name=HF_TOKENIZER, pool_type="eos", eos_id=eos,
                           tokenizer_kwargs={"clean": "lower"})  # lower-cased like open_clip's SimpleTokenizer
    grown = models.ClipBundle(model, bundle.preprocess_train, bundle.preprocess_val, tokenizer, bundle.arch, cfg)
    return models.export(grown, folder)

